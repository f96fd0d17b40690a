"""A server node: ``python -m d2ldist.kv``, started by the launcher for ``-s S``.

It registers with the scheduler and then runs the parameter server's loop
(``d2ldist/kv/serving.py``) until the scheduler says the workers are done.

A parameter server written from scratch (a chapter of the book does this) runs
instead when the job sets D2L_SERVER_SCRIPT: ``d2l-launch -n 2 -s 2 --env
D2L_SERVER_SCRIPT=my_ps.py my_ps.py`` runs ``my_ps.py`` on the servers too (it
reads D2L_ROLE to know which part to play).
"""
import os
import runpy
import sys

from .. import config
from ..runtime.node import Node, PeerFailed


def main():
    try:
        script = config.get().server_script
    except ValueError as e:            # a variable of the job that cannot be read
        sys.exit(f'd2ldist.server: {e}')
    if script:                   # the user's own server: run it like `python script`
        if not os.path.isfile(script):
            sys.exit(f'd2ldist.server: D2L_SERVER_SCRIPT: no such file: {script}')
        sys.argv = [script]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name='__main__')
        return
    import torch
    from .serving import ServerLoop
    torch.set_num_threads(1)     # a server adds tensors up; many processes share the cores
    try:
        node = Node.from_env(role='server').start()
        ServerLoop(node).serve()
    except (PeerFailed, RuntimeError, TimeoutError) as e:
        sys.exit(f'd2ldist.server: {e}')
    node.stop()


if __name__ == '__main__':
    main()
