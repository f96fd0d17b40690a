"""Horovod's names that d2ldist does not have, and why: using one says so in one line.

Light on purpose (no torch): both faces, ``d2ldist`` and ``d2ldist.horovod``, consult it
in their module ``__getattr__``. The error is an AttributeError, so that feature
detection in users' code (``hasattr(hvd, 'Adasum')``) answers False, and a
NotImplementedError, for what it means.
"""

NOT_YET = {
    'ProcessSet': 'process sets are out of scope for now: collectives run over all workers',
    'add_process_set': 'process sets are out of scope for now',
    'Adasum': 'Adasum is out of scope for now: use op=Average',
    'start_timeline': 'the timeline comes from the launcher: d2l-launch --timeline FILE',
    'stop_timeline': 'the timeline comes from the launcher: d2l-launch --timeline FILE',
}


class NotInD2ldist(AttributeError, NotImplementedError):
    """A Horovod name that d2ldist does not have."""


def not_yet(name):
    """The error for a Horovod name d2ldist does not have."""
    return NotInD2ldist(f'hvd.{name}: not in d2ldist: {NOT_YET[name]}')


def missing(module, name):
    """The error for ``module.name`` that does not exist: says why for Horovod's names."""
    if name in NOT_YET:
        return not_yet(name)
    return AttributeError(f'module {module!r} has no attribute {name!r}')
