"""A server node: ``python -m d2ldist.server``, started by the launcher for ``-s S``.

It registers with the scheduler and then runs the parameter server's loop
(``d2ldist/kv/server.py``) until the scheduler says the workers are done.
"""
import sys

from .node import Node, PeerFailed


def main():
    import torch
    from .kv.server import KVServer
    torch.set_num_threads(1)     # a server adds tensors up; many processes share the cores
    try:
        node = Node.from_env(role='server').start()
        KVServer(node).serve()
    except (PeerFailed, RuntimeError, TimeoutError) as e:
        sys.exit(f'd2ldist.server: {e}')
    node.stop()


if __name__ == '__main__':
    main()
