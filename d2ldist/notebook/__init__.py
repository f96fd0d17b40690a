"""In a notebook: ``%launch`` (``magic.py``), its live dashboard (``dashboard.py``) and
the final form a finished job leaves, a summary and a figure (``final.py``)."""
