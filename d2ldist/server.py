"""A server node: ``python -m d2ldist.server``, started by the launcher for ``-s S``.

Until the parameter server lands, a server registers with the scheduler, takes part
in barriers of the group 'all' and 'server', and waits to be told to shut down.
"""
import sys

from . import protocol as P
from .node import Node, PeerFailed


def main():
    try:
        node = Node.from_env(role='server').start()
        while node.recv([P.SHUTDOWN]) is None:
            pass
    except (PeerFailed, RuntimeError, TimeoutError) as e:
        sys.exit(f'd2ldist.server: {e}')
    node.stop()


if __name__ == '__main__':
    main()
