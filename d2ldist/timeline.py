"""A job's timeline, read and drawn: ``d2ldist.timeline.plot('timeline.json')``.

The file comes from ``d2l-launch --timeline FILE`` (or ``%launch --timeline FILE``);
the reader and the drawing live in ``notebook/timeline.py``, the recording in
``runtime/timeline.py``, the merging in ``launch/timeline.py``.
"""
from .notebook.timeline import Plot, Span, breakdown, last_steps, load, plot  # noqa: F401
