"""A job's timeline, read and drawn: ``d2ldist.timeline.plot('timeline.json')``.

The file comes from ``d2l-launch --timeline FILE`` (or ``%launch --timeline FILE``);
the reader and the drawing live in ``notebook/timeline_view.py``, the recording in
``runtime/spans.py``, the merging in ``launch/trace.py``.
"""
from .notebook.timeline_view import Plot, Span, breakdown, last_steps, load, plot  # noqa: F401
