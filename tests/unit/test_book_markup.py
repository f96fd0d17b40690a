"""The book's markup (book/build.py): numbers, d2l's cross-references, captions, math."""
import nbformat
import pytest

from conftest import ROOT
from nbtools import load_book

pytest.importorskip('latex2mathml')
book = load_book()


def chapter(*sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(s) for s in sources]
    return nb


def test_the_book_has_every_chapter_once():
    assert sorted(book.CHAPTERS) == sorted(p.stem for p in (ROOT / 'notebooks').glob('*.ipynb'))


def test_labels_anchor_headings_and_numrefs_link_to_them():
    one = chapter('# Rings\n:label:`sec_ring`\n\nText.', '## Chunks\n:label:`sec_chunks`\n\nMore.')
    two = chapter('# Scaling\n\nAs :numref:`sec_ring` and :numref:`sec_chunks` showed, and '
                  ':numref:`sec_resnet`.', '## A\n\n## B')
    assert book.number_headings(one, 1) == 'Rings'
    assert book.number_headings(two, 2) == 'Scaling'
    refs = {**book.collect_labels(one, 'one.html'), **book.collect_labels(two, 'two.html')}
    assert refs == {'sec_ring': ('one.html#sec_ring', 'Section 1'),
                    'sec_chunks': ('one.html#sec_chunks', 'Section 1.1')}
    book.resolve(one, refs)
    book.resolve(two, refs)
    assert one.cells[0].source == '# 1. Rings <a id="sec_ring"></a>\n\nText.'
    assert one.cells[1].source == '## 1.1. Chunks <a id="sec_chunks"></a>\n\nMore.'
    assert two.cells[0].source.startswith(
        '# 2. Scaling\n\nAs [Section 1](one.html#sec_ring) and [Section 1.1](one.html#sec_chunks)'
        ' showed, and [the ResNet section of Dive into Deep Learning](https://')
    assert two.cells[1].source == '## 2.1. A\n\n## 2.2. B'


def test_an_unknown_label_stops_the_build():
    with pytest.raises(SystemExit, match='sec_nowhere'):
        book.resolve(chapter('See :numref:`sec_nowhere`.'), {})


def test_figures_are_numbered_with_their_words():
    nb = nbformat.v4.new_notebook()
    png = 'iVBORw0KGgo='
    nb.cells = [nbformat.v4.new_code_cell('# NBVAL_IGNORE_OUTPUT\nplot()', outputs=[
        nbformat.v4.new_output('display_data', {'image/png': png,
                                                'text/plain': '<Figure size 640x480 with 1 Axes>'}),
        nbformat.v4.new_output('display_data', {'image/png': png,
                                                'text/plain': '%launch x.py: loss of each worker'})])]
    book.number_figures(nb, 4)
    first, second = (o.metadata['d2l_figure'] for o in nb.cells[0].outputs)
    assert first == {'number': 'Figure 4.1', 'id': 'fig-4-1', 'caption': ''}
    assert second['number'] == 'Figure 4.2' and second['caption'] == '%launch x.py: loss of each worker'
    assert nb.cells[0].source == 'plot()'                     # no nbval markers in the book


def test_math_becomes_mathml_and_code_keeps_its_dollars():
    html = book.exporter().markdown2html({'cell': {}}, 'Send $2(N-1)/N$ of `$n` bytes:\n\n'
                                                       '$$T = \\frac{S}{B}$$')
    assert '<math' in html and 'display="block"' in html and '<mfrac>' in html
    assert '<code>$n</code>' in html
