"""The communication thread: collectives run on it one after another, in the order asked.

    handle = engine.run(backend.allreduce_, X, ops.Sum)   # returns at once
    ...                                                   # backward goes on meanwhile
    handle.wait()                                         # X holds the sum

Running every collective on one thread, in the order it was asked for, is what lets
the ``_async_`` variants overlap communication with computation (DistributedOptimizer
and the Trainer all-reduce gradient buckets while backward still runs) while all
workers still run the collectives in the same order: Horovod's background thread.
``world.py`` owns the one engine of a process (none when a worker is alone).
"""
import queue
import threading
import time

from ..runtime import spans


class Handle:
    """The result of a collective: ``wait()`` returns it (or raises its error)."""

    def __init__(self) -> None:
        self._done, self._result, self._error = threading.Event(), None, None
        self.on_wait = None      # called once, at the first wait() (api.py: it has ended)

    @classmethod
    def finished(cls, result: object) -> 'Handle':
        """A handle whose collective has already run (alone, or on torch.distributed)."""
        handle = cls()
        handle._finish(result)
        return handle

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> object:
        self._done.wait()
        if self.on_wait is not None:
            self.on_wait, on_wait = None, self.on_wait
            on_wait()
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._done.set()


class Engine:
    """The communication thread: runs the functions given to ``run`` one after another."""

    def __init__(self):
        self.queue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name='d2ldist-comm').start()

    def run(self, fn, *args):
        """Queue fn(*args) behind what was asked before; a Handle for its result."""
        handle = Handle()
        self.queue.put((handle, fn, args))
        return handle

    def stop(self):
        """End the thread once what was asked before has run."""
        self.queue.put(None)

    def _loop(self):
        import torch     # here, not at the top: joining a job does not load torch
        # Reduce on this one thread, as Horovod's background thread does. With torch's
        # OpenMP build this setting holds for this thread only; without it each add_
        # would wake an OpenMP team that fights the training's own threads for the
        # cores (measured on 2 cores, 2 workers: 16 MB all-reduce 630 ms -> 47 ms).
        torch.set_num_threads(1)
        while (item := self.queue.get()) is not None:
            handle, fn, args = item
            start = time.time()
            try:
                handle._finish(fn(*args))
            except BaseException as e:   # the caller's wait() raises it
                handle._finish(error=e)
            if spans.recording():        # (nothing to compute when the timeline is off)
                spans.record(fn.__name__.strip('_'), 'comm', start, time.time(), bytes=sum(
                    a.nbytes for a in args if isinstance(a, torch.Tensor)))
