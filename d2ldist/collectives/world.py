"""Which backend the collectives run on, and this worker's place among the workers.

The job's state lives here and in ``runtime/node.py`` (the node), both made from the
process's variables (``config.py``; other tools' in ``runtime/started.py``), nowhere else:

* ``init(backend)`` joins the job and chooses the backend: 'ring', d2ldist's own ring
  over the van (the default under d2l-launch; under another tool rank 0 hosts the
  scheduler: ``runtime/hosted.py``), or 'torch', torch.distributed (the default where
  torchrun, mpirun or srun started the processes: ``runtime/started.py``);
* ``rank()``, ``size()``, ``local_rank()``, ``local_size()``, ``barrier()``;
* ``backend()``: the backend object the collectives call, made on first use
  (``backend.py`` says what one is);
* ``run(fn, *args)``: fn on the communication thread (``engine.py``), after what was
  asked before; a Handle.

Light on purpose: ``init`` alone does not load torch (a script that only passes
messages starts fast); torch loads with the first collective.
"""
from .. import config
from ..runtime import node, started
from . import backend as backends
from .engine import Engine, Handle

BACKENDS = ('ring', 'torch')
_name = None      # the backend init() chose
_backend = None   # the backend object (RingBackend or TorchBackend), made on first use
_engine = None    # the communication thread (an Engine); None when alone


def init(backend: str | None = None) -> node.Node | None:
    """Join the job and choose the backend; returns the node (None when run alone)."""
    global _name
    node.report_in_one_line()          # (a StartError ends the process in one line)
    name, start = _choose(backend)
    if _name is not None:
        if backend is not None and name != _name:
            raise RuntimeError(f'd2ldist.init: already running with backend {_name!r}')
        return node.current()
    # also with 'torch' under d2l-launch: the scheduler watches liveness; the ring
    # started by another tool: rank 0 hosts the scheduler (runtime/hosted.py)
    joined = node.register('worker', start if name == 'ring' else None)
    if name == 'torch':
        use(backends.make(name, joined))
    _name = name   # the ring is made on first use (torch loads then)
    return joined


def _choose(backend):
    """The backend's name: asked for, or D2L_BACKEND, or torch where a tool other than
    d2l-launch (torchrun, mpirun, srun) started several processes, else the ring; and
    who started this process (None: d2l-launch)."""
    cfg = config.get()
    start = None if cfg.in_job else started.detect()
    several = start is not None and start.several
    name = backend or cfg.backend or ('torch' if several else 'ring')
    if name not in BACKENDS:
        raise ValueError(f'unknown backend {name!r}: use one of {", ".join(BACKENDS)}')
    if several:
        start.rendezvous()             # where to meet is known, or one line says what is not
    return name, start


def name():
    """The backend's name, 'ring' or 'torch' (after init)."""
    return _name


def use(backend_object):
    """Run the collectives on ``backend_object`` from now on, on a communication thread."""
    global _backend, _engine
    _backend = backend_object
    _engine = Engine() if backend_object.size > 1 else None


def backend():
    """The backend in use (joining the job first if init() was not called)."""
    if _backend is None:
        init()
        if _backend is None:
            use(backends.make(_name, node.current()))
    return _backend


def reform():
    """After a membership change (elastic): the ring anew, with the new ranks and size,
    on a fresh communication thread; the old thread ends after what it was given."""
    global _engine
    if _name != 'ring':
        raise RuntimeError(f'elastic workers need the ring backend, not {_name!r}')
    if _engine is not None:
        _engine.stop()
    use(backends.make('ring', node.current()))


def membership():
    """Which membership of the workers this is: 0, then one more after each change."""
    n = node.current()
    return n.round if n else 0


def engine():
    """The communication thread, or None (alone, or no collective has run yet)."""
    return _engine


def run(fn, *args):
    """Run fn(*args) on the communication thread, after what was asked before; a Handle.

    Alone (one worker) there is nothing to overlap: fn runs here, now."""
    backend()                                     # (joins the job, makes the thread)
    if _engine is None:
        return Handle.finished(fn(*args))
    return _engine.run(fn, *args)


def active():
    """Whether a backend has been made (a collective ran, or the backend is torch)."""
    return _backend is not None


def rank() -> int:
    """This worker's rank, 0 .. size() - 1."""
    if _name == 'torch':
        return backend().rank
    n = node.current()
    return n.workers().index(n.id) if n and n.role == 'worker' else n.rank if n else 0


def size() -> int:
    """The number of workers in the job."""
    if _name == 'torch':
        return backend().size
    n = node.current()
    return len(n.workers()) if n else 1


def local_rank() -> int:
    """This worker's rank among the workers on its machine."""
    return started.local_rank()


def local_size() -> int:
    """The number of workers on this machine."""
    return started.local_size()


def cross_rank() -> int:
    """The index of this worker's machine among the machines with workers (Horovod's)."""
    cross = config.get().cross_rank
    return started.group_rank() if cross is None else cross


def cross_size() -> int:
    """The number of machines with workers."""
    cross = config.get().cross_size
    return max(1, size() // local_size()) if cross is None else cross


def is_initialized() -> bool:
    """Whether init() has run (and shutdown() has not since)."""
    return _name is not None


def shutdown() -> None:
    """Forget the backend (after waiting for the collectives asked for); init() starts
    again. The process stays a node of the job until it ends."""
    global _name, _backend, _engine
    if _engine is not None:
        _engine.run(lambda: None).wait()
    if _name == 'torch':
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    _name = _backend = _engine = None


def barrier() -> None:
    """Wait until every worker has reached this point."""
    if active():                      # collectives run on their own thread: queue behind them
        run(_backend.barrier).wait()
    elif node.current():
        node.current().barrier('worker')
