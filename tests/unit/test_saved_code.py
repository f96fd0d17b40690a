"""Code a chapter saves into the library (d2l's ``#@save``) is the library's code, verbatim.

A chapter shows a function in a code cell whose first line is ``#@save``; the library
holds the same text, so the reader sees the code that runs. Edit one, edit the other.
"""
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / 'notebooks').glob('*.ipynb'))
SOURCES = {p.relative_to(ROOT).as_posix(): p.read_text()
           for p in sorted((ROOT / 'd2ldist').rglob('*.py'))}


def saved_cells():
    """(chapter, index of the cell, its code without the #@save line) for every #@save cell."""
    cells = []
    for path in CHAPTERS:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            first, _, code = cell.source.partition('\n')
            if cell.cell_type == 'code' and first.strip() == '#@save':
                cells.append(pytest.param(path.name, i, code.strip('\n'), id=f'{path.stem}-{i}'))
    return cells


def test_a_chapter_saves_code():
    assert saved_cells(), 'no #@save cell in notebooks/*.ipynb'


@pytest.mark.parametrize('chapter, index, code', saved_cells())
def test_saved_cell_is_in_the_library(chapter, index, code):
    assert code.strip(), f'{chapter}, cell {index}: #@save and nothing to save'
    where = [name for name, text in SOURCES.items() if code in text]
    assert where, (f'{chapter}, cell {index} (#@save) is not verbatim in d2ldist/: '
                   'copy the cell into the library or the library into the cell')
