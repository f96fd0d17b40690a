"""The library's own lines: one way to print them, and the two ways to shorten what goes in.

Every line d2ldist writes for a person (not a progress report, ``report.py``) starts
with ``d2ldist:``, so the launcher's log and ``%launch`` show where it came from.
``say`` prints one; ``shown`` writes a node's id as a person reads it; ``clip`` keeps
a text from a peer (an error it sent, a description of its call) to a readable length;
``go_on`` counts the workers left after a change.
"""
import sys

ERROR = 600      # characters kept of an error a peer or a process sent
NAME = 200       # ... of a call's description or a name


def say(text, err=False):
    """Print one of the library's own lines, ``d2ldist: text``, flushed at once."""
    print(f'd2ldist: {text}', file=sys.stderr if err else sys.stdout, flush=True)


def shown(node_id):
    """A node's id as a person reads it: ``'worker:3'`` -> ``'worker 3'``."""
    return str(node_id).replace(':', ' ')


def go_on(n):
    """The workers left after a change: '1 worker goes on', '2 workers go on'."""
    return f'{n} worker goes on' if n == 1 else f'{n} workers go on'


def clip(text, limit=ERROR):
    """``text`` as a str of at most ``limit`` characters."""
    return str(text)[:limit]
