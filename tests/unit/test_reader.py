"""A reader's check: the chapters as committed read right where no kernel runs.

Most readers meet a chapter on a repository page, in nbviewer or in an export, which
show a cell's saved outputs in the richest form they know. Converted to Markdown by
nbconvert, every %launch must show its finished job once -- one summary, no dashboard
caught 'starting' -- and every chapter must stay light (no widget state, 300 KB at
most). It reads the committed chapters (or D2L_CHAPTERS=DIR), so it passes once they
are re-executed with 'make notebooks'.
"""
import os
import re
from pathlib import Path

import nbformat
import pytest

from support import ROOT

nbconvert = pytest.importorskip('nbconvert')
CHAPTERS = Path(os.environ.get('D2L_CHAPTERS', ROOT / 'notebooks'))
PATHS = sorted(CHAPTERS.glob('*.ipynb'))
SUMMARY = re.compile(r'^ *job (finished|failed|stopped|timeout) after .*\n +process ', re.M)
LIVE = re.compile(r'^ *%launch .*: (starting|running), |'          # a dashboard caught mid-job:
                  r'^ +(scheduler|server \d+|worker \d+) +\S+ +(starting|running)\b', re.M)
MAX_BYTES = 300_000


def launches(cell):
    """How many %launch lines a cell runs for sure: a line of its own, or the first line
    of a try block (a job meant to fail, its JobFailed caught), not under an if."""
    return len(re.findall(r'^(?:try:\n[ \t]+)?%launch ', cell.source, re.M))


def as_markdown(cell):
    """The cell's outputs as nbconvert's Markdown export shows them."""
    nb = nbformat.v4.new_notebook(cells=[cell])
    exporter = nbconvert.MarkdownExporter(exclude_input=True)
    return exporter.from_notebook_node(nb)[0]


@pytest.mark.parametrize('path', PATHS, ids=[p.stem for p in PATHS])
def test_every_launch_shows_its_finished_job_once(path):
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == 'code' and '%launch' in c.source]
    for cell in cells:
        shown = as_markdown(cell)
        assert not LIVE.search(shown), shown[:3000]
        assert len(SUMMARY.findall(shown)) == launches(cell), shown[:3000]


@pytest.mark.parametrize('path', PATHS, ids=[p.stem for p in PATHS])
def test_chapter_is_light(path):
    nb = nbformat.read(path, as_version=4)
    assert 'widgets' not in nb.metadata
    assert path.stat().st_size <= MAX_BYTES
