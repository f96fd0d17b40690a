"""The book's markup (book/build.py): numbers, d2l's cross-references, captions, math."""
import re

import nbformat
import pytest

from support import ROOT, load_script
from nbtools import load_book

pytest.importorskip('latex2mathml')
book = load_book()


def load_refs():
    """book/refs.py as a module: it writes the cross-references into the chapters."""
    return load_script('book/refs.py', 'book_refs')


refs = load_refs()


def chapter(*sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(s) for s in sources]
    return nb


def test_the_book_has_every_chapter_and_appendix_once():
    names = [name for name, _ in book.numbered()]
    assert sorted(names) == sorted(p.stem for p in (ROOT / 'notebooks').glob('*.ipynb'))
    assert all(name.startswith('appendix_') for name in book.APPENDICES)


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


def test_links_to_chapters_become_links_to_their_pages(monkeypatch):
    """The form book/refs.py writes: an anchor line under the heading, and links to
    x.ipynb#label (or #label in its own chapter), which the book points at x.html#label."""
    monkeypatch.setattr(book, 'CHAPTERS', ['one', 'two'])
    one = chapter('# Rings\n<a id="sec_ring"></a>\n\nText.', '## Chunks\n<a id="sec_chunks"></a>\n\n'
                  'As [Section 1](#sec_ring) said.')
    two = chapter('# Scaling\n\nAs [Section 1.1](one.ipynb#sec_chunks) showed, '
                  '[the code](one.ipynb) and [a page](https://example.org/x#y).')
    book.number_headings(one, 1)
    book.number_headings(two, 2)
    refs = {**book.collect_labels(one, 'one.html'), **book.collect_labels(two, 'two.html')}
    assert refs == {'sec_ring': ('one.html#sec_ring', 'Section 1'),
                    'sec_chunks': ('one.html#sec_chunks', 'Section 1.1')}
    book.resolve(one, refs, 'one.html')
    book.resolve(two, refs, 'two.html')
    assert one.cells[0].source == '# 1. Rings <a id="sec_ring"></a>\n\nText.'
    assert one.cells[1].source.endswith('As [Section 1](one.html#sec_ring) said.')
    assert two.cells[0].source.endswith('As [Section 1.1](one.html#sec_chunks) showed, '
                                        '[the code](one.html) and [a page](https://example.org/x#y).')


def test_an_appendix_is_lettered_after_the_chapters_and_linked_both_ways(tmp_path, monkeypatch):
    """Appendices follow the chapters, lettered A, B, ...: their headings, their figures'
    and sections' links (written by book/refs.py), and the front page's list."""
    monkeypatch.setattr(book, 'CHAPTERS', ['one', 'two'])
    monkeypatch.setattr(book, 'APPENDICES', ['appendix_deep'])
    monkeypatch.setattr(refs.build, 'CHAPTERS', ['one', 'two'])
    monkeypatch.setattr(refs.build, 'APPENDICES', ['appendix_deep'])
    assert book.numbered() == [('one', '1'), ('two', '2'), ('appendix_deep', 'A')]
    nbformat.write(chapter('# Rings\n\nDepth: :numref:`sec_deep`.'), tmp_path / 'one.ipynb')
    nbformat.write(chapter('# Two\n\nText.'), tmp_path / 'two.ipynb')
    nbformat.write(chapter('# Deep\n:label:`sec_deep`\n\n## Part\n:label:`sec_part`\n\n'
                           'Back to [the chapter](one.ipynb).'), tmp_path / 'appendix_deep.ipynb')
    assert refs.main(['--chapters', str(tmp_path)]) == 0
    assert '[Section A](appendix_deep.ipynb#sec_deep)' in \
        nbformat.read(tmp_path / 'one.ipynb', as_version=4).cells[0].source
    out = tmp_path / 'site'
    pages = book.build(tmp_path, out)
    assert [p.name for p in pages] == ['index.html', 'one.html', 'two.html', 'appendix_deep.html']
    deep = (out / 'appendix_deep.html').read_text()
    assert 'A. Deep' in deep and 'A.1. Part' in deep and 'href="one.html"' in deep
    assert 'href="appendix_deep.html#sec_deep"' in (out / 'one.html').read_text()
    assert 'A. Deep' in (out / 'index.html').read_text()


@pytest.mark.parametrize('text, error', [
    ('[Section 1](nowhere.ipynb#sec_ring)', 'names no chapter'),
    ('[Section 1](two.ipynb#sec_ring)', 'names no label of two.html'),
    ('[Section 1](#sec_ring)', 'names no label of two.html'),
    ('[Section 1](one.ipynb#sec_nowhere)', 'names no label'),
    ('[Section 3](one.ipynb#sec_ring)', 'says Section 3, the book Section 1: run python book/refs.py')])
def test_a_link_to_no_chapter_anchor_or_number_stops_the_build(text, error, monkeypatch):
    monkeypatch.setattr(book, 'CHAPTERS', ['one', 'two'])
    with pytest.raises(SystemExit, match=re.escape(error)):
        book.resolve(chapter(f'See {text}.'), {'sec_ring': ('one.html#sec_ring', 'Section 1')},
                     'two.html')


def test_refs_writes_links_that_read_right_everywhere_and_again(tmp_path, monkeypatch):
    """book/refs.py: labels become anchors, numrefs and plain 'Figure 1.1' links with the
    book's numbers (within a chapter '#label'), a drawn figure's label an anchor on its
    caption line; run again, it changes nothing, and it renumbers links that moved."""
    png = 'iVBORw0KGgo='
    one = chapter('# Rings\n:label:`sec_ring`\n\nSee :numref:`fig_times`, :numref:`sec_two` and '
                  ':numref:`sec_resnet`; `Figure 1.1` in code stays.')
    one.cells.append(nbformat.v4.new_code_cell('plot()', outputs=[nbformat.v4.new_output(
        'display_data', {'image/png': png, 'text/plain': '<Figure size 640x480 with 1 Axes>'})],
        metadata={'d2l': {'caption': 'Times.', 'label': 'fig_times'}}))
    one.cells.append(nbformat.v4.new_markdown_cell('*Figure 1.1: Times.*\n\nFigure 1.1 shows it.'))
    two = chapter('# Two\n:label:`sec_two`\n\n## Part\n:label:`sec_part`\n\n'
                  'As :numref:`sec_ring` and :numref:`sec_part` said, and Figure 1.1.')
    nbformat.write(one, tmp_path / 'one.ipynb')
    nbformat.write(two, tmp_path / 'two.ipynb')
    monkeypatch.setattr(refs.build, 'CHAPTERS', ['one', 'two'])
    monkeypatch.setattr(refs.build, 'APPENDICES', [])
    assert refs.main(['--chapters', str(tmp_path), '--check']) == 1
    assert nbformat.read(tmp_path / 'one.ipynb', as_version=4) == one      # --check writes nothing
    assert refs.main(['--chapters', str(tmp_path)]) == 0
    one, two = (nbformat.read(tmp_path / f'{n}.ipynb', as_version=4) for n in ('one', 'two'))
    assert one.cells[0].source == (
        '# Rings\n<a id="sec_ring"></a>\n\nSee [Figure 1.1](#fig_times), [Section 2](two.ipynb#sec_two) '
        'and [the ResNet section of Dive into Deep Learning](https://d2l.ai/chapter_convolutional-'
        'modern/resnet.html); `Figure 1.1` in code stays.')
    assert one.cells[2].source == ('*Figure 1.1: Times.* <a id="fig_times"></a>\n\n'
                                   '[Figure 1.1](#fig_times) shows it.')
    assert two.cells[0].source == (
        '# Two\n<a id="sec_two"></a>\n\n## Part\n<a id="sec_part"></a>\n\nAs [Section 1](one.ipynb#sec_ring)'
        ' and [Section 2.1](#sec_part) said, and [Figure 1.1](one.ipynb#fig_times).')
    assert refs.main(['--chapters', str(tmp_path), '--check']) == 0         # idempotent
    book.number_headings(one, 1)                                            # the book reads it
    assert book.visible_captions(one, 1)[0][:2] == ('Figure 1.1', 'Times.')
    two.cells[0].source = two.cells[0].source.replace('## Part', '## First\n\n## Part')
    nbformat.write(two, tmp_path / 'two.ipynb')                             # a section comes first
    assert refs.main(['--chapters', str(tmp_path)]) == 0
    two = nbformat.read(tmp_path / 'two.ipynb', as_version=4)
    assert two.cells[0].source.endswith('As [Section 1](one.ipynb#sec_ring) and [Section 2.2]'
                                        '(#sec_part) said, and [Figure 1.1](one.ipynb#fig_times).')


def test_the_chapters_cross_references_are_written_out():
    """No chapter shows a raw :numref: or :label: (JupyterLab and a repository page print
    them as written), and every link of book/refs.py carries the book's number: after
    editing a chapter's markdown, run python book/refs.py."""
    for name in book.CHAPTERS:
        nb = nbformat.read(ROOT / 'notebooks' / f'{name}.ipynb', as_version=4)
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == 'markdown'):
            for line, prose in book.markdown_lines(cell.source):
                assert not (prose and re.search(r':(numref|label):`', line)), \
                    f'{name}: {line[:80]!r}: run python book/refs.py'
    assert refs.main(['--check']) == 0, 'run python book/refs.py'


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
    assert first == {'number': 'Figure 4.1', 'id': 'fig-4-1', 'caption': '', 'caption_html': ''}
    assert second['number'] == 'Figure 4.2' and second['caption'] == '%launch x.py: loss of each worker'
    assert nb.cells[0].source == 'plot()'                     # no nbval markers in the book


def test_diagrams_and_plots_are_numbered_in_one_sequence(tmp_path):
    (tmp_path / 'figures').mkdir()
    (tmp_path / 'figures' / 'ring.svg').write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    png = 'iVBORw0KGgo='
    nb = chapter('# Rings\n\nAs :numref:`fig_ring` and :numref:`fig_times` show:\n\n'
                 '![The ring, with `N` = 4 & $2(N-1)$ steps.](figures/ring.svg)\n:label:`fig_ring`\n\nMore.')
    nb.cells.append(nbformat.v4.new_code_cell('plot()', outputs=[nbformat.v4.new_output(
        'display_data', {'image/png': png, 'text/plain': '<Figure size 640x480 with 1 Axes>'})],
        metadata={'d2l': {'caption': 'Times of $m$ workers.', 'label': 'fig_times'}}))
    refs = book.number_figures(nb, 3, 'three.html', tmp_path)
    assert refs == {'fig_ring': ('three.html#fig_ring', 'Figure 3.1'),
                    'fig_times': ('three.html#fig_times', 'Figure 3.2')}
    diagram = nb.cells[0].source
    assert ':label:' not in diagram and diagram.split('</p></div>')[1].strip() == 'More.'
    assert '<img src="data:image/svg+xml;base64,' in diagram and 'id="fig_ring"><b>Figure 3.1</b>' in diagram
    assert '<code>N</code> = 4 &amp; <math' in diagram                 # the caption's markup
    plot = nb.cells[1].outputs[0].metadata['d2l_figure']
    assert plot['number'] == 'Figure 3.2' and plot['id'] == 'fig_times'
    assert plot['caption'] == 'Times of $m$ workers.' and '<math' in plot['caption_html']
    book.resolve(nb, refs)
    assert nb.cells[0].source.startswith('# Rings\n\nAs [Figure 3.1](three.html#fig_ring) and '
                                         '[Figure 3.2](three.html#fig_times) show:')


def test_a_figure_without_its_file_or_caption_stops_the_build(tmp_path):
    with pytest.raises(SystemExit, match='does not exist'):
        book.number_figures(chapter('![A ring.](figures/nowhere.svg)'), 1, 'one.html', tmp_path)
    (tmp_path / 'x.svg').write_text('<svg/>')
    with pytest.raises(SystemExit, match='no caption'):
        book.number_figures(chapter('![](x.svg)'), 1, 'one.html', tmp_path)


# -- the chapters' own figures ---------------------------------------------------------------
FIGURES = ROOT / 'notebooks' / 'figures'


def chapter_figures():
    """(chapter, figure) per figure of every chapter: ('diagram', alt, path, label) for a
    markdown image, ('plot', caption, cell index) for a figure a code cell drew."""
    found = []
    for name in book.CHAPTERS:
        nb = nbformat.read(ROOT / 'notebooks' / f'{name}.ipynb', as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == 'markdown':
                lines = [line for line, prose in book.markdown_lines(cell.source) if prose]
                for j, line in enumerate(lines):
                    image = book.IMAGE.match(line)
                    label = book.label_of(lines[j + 1]) if image and j + 1 < len(lines) else None
                    if image:
                        found.append((name, ('diagram', image.group(1), image.group(2), label)))
            elif cell.cell_type == 'code':
                for k, out in enumerate(o for o in cell.get('outputs', [])
                                        if 'image/png' in o.get('data', {})):
                    words = out.data.get('text/plain', '')
                    caption = (cell.metadata.get('d2l', {}).get('caption') if k == 0 else None) or \
                        ('' if book.PLAIN_FIGURE.match(words) else words)
                    found.append((name, ('plot', caption, i)))
    return found


def test_every_figure_of_the_chapters_is_there_captioned_and_referenced():
    diagrams = []
    for name, figure in chapter_figures():
        if figure[0] == 'plot':
            assert figure[1].strip(), (f'{name}, cell {figure[2]}: a figure without a caption; give '
                                       'the cell metadata {"d2l": {"caption": "...", "label": "fig_..."}}')
            continue
        _, words, path, label = figure
        assert (ROOT / 'notebooks' / path).is_file(), f'{name}: {path} does not exist'
        assert words.strip(), f'{name}: {path} has no caption: ![caption]({path})'
        assert label and label.startswith('fig_'), f'{name}: {path} needs a :label:`fig_...` line under it'
        diagrams.append((ROOT / 'notebooks' / path).resolve())
    drawn = sorted(FIGURES.glob('*.svg'))
    assert drawn and sorted(set(diagrams)) == drawn                      # none missing, none unused


def test_caption_lines_are_taken_out_and_must_name_their_figure():
    png = 'iVBORw0KGgo='
    nb = chapter('![A ring.](x.svg)\n:label:`fig_x`\n*Figure 2.1: A ring.*\n\nMore.')
    nb.cells.append(nbformat.v4.new_code_cell('plot()', outputs=[nbformat.v4.new_output(
        'display_data', {'image/png': png, 'text/plain': '<Figure size 640x480 with 1 Axes>'})],
        metadata={'d2l': {'caption': 'Times.', 'label': 'fig_t'}}))
    nb.cells.append(nbformat.v4.new_markdown_cell('*Figure 2.2: Times.*\n\nAs Figure 2.2 shows.'))
    nb.cells[2].source = nb.cells[2].source.replace('.*', '.* <a id="fig_t"></a>', 1)  # refs.py's anchor
    assert book.visible_captions(nb, 2) == [('Figure 2.1', 'A ring.', 'A ring.', 'diagram'),
                                            ('Figure 2.2', 'Times.', 'Times.', 'metadata')]
    assert nb.cells[0].source == '![A ring.](x.svg)\n:label:`fig_x`\n\nMore.'
    assert nb.cells[2].source == '\nAs Figure 2.2 shows.'
    with pytest.raises(SystemExit, match='says Figure 2.3 under Figure 2.1'):
        book.visible_captions(chapter('![A ring.](x.svg)\n*Figure 2.3: A ring.*'), 2)
    with pytest.raises(SystemExit, match='under no figure'):
        book.visible_captions(chapter('Text.\n\n*Figure 2.1: A ring.*'), 2)


def test_a_notebook_reader_sees_every_figure_numbered_and_captioned():
    """JupyterLab and a repository page show neither a cell's metadata nor an image's words:
    a line '*Figure 3.2: caption*' under every figure gives its number and caption there
    (the metadata's or the diagram's own words), and the prose names figures by those
    numbers (links that book/refs.py writes, where the figure has a label)."""
    prose, figures = [], {}
    for number, name in enumerate(book.CHAPTERS, 1):
        nb = nbformat.read(ROOT / 'notebooks' / f'{name}.ipynb', as_version=4)
        for figure, words, caption, kind in book.visible_captions(nb, number):
            assert words, f'{name}: no line *{figure}: ...* under {figure}'
            assert kind == 'output' or words == caption, \
                f'{name}: the line under {figure} is not its caption: {words!r} against {caption!r}'
            figures[figure] = kind
        text = ' '.join(c.source for c in nb.cells if c.cell_type == 'markdown')
        prose.append(text)
    named = set(re.findall(r'\bFigure \d+\.\d+\b', ' '.join(prose)))
    assert named <= set(figures), f'the prose names figures that do not exist: {named - set(figures)}'
    unnamed = [f for f, kind in figures.items() if kind == 'diagram' and f not in named]
    assert not unnamed, f'no prose names {unnamed}'


def test_the_diagrams_are_what_draw_py_draws(tmp_path):
    draw = load_script('notebooks/figures/draw.py', 'draw')
    for path in draw.draw(tmp_path):
        assert path.read_bytes() == (FIGURES / path.name).read_bytes(), \
            f'{path.name} is not what draw.py draws: make figures'
        assert b'<title>' in path.read_bytes() and b'http' not in path.read_bytes().replace(
            b'xmlns="http://www.w3.org/2000/svg"', b'')                 # nothing to fetch


def test_math_becomes_mathml_and_code_keeps_its_dollars():
    html = book.exporter().markdown2html({'cell': {}}, 'Send $2(N-1)/N$ of `$n` bytes:\n\n'
                                                       '$$T = \\frac{S}{B}$$')
    assert '<math' in html and 'display="block"' in html and '<mfrac>' in html
    assert '<code>$n</code>' in html


def test_every_exercise_has_a_hint():
    """Each numbered item of a chapter's Exercises says 'Hint:' (answers.ipynb answers them)."""
    for name in book.CHAPTERS:
        nb = nbformat.read(ROOT / 'notebooks' / f'{name}.ipynb', as_version=4)
        for cell in (c for c in nb.cells if c.cell_type == 'markdown' and '## Exercises' in c.source):
            section = cell.source.split('## Exercises', 1)[1].split('\n## ', 1)[0]
            items = re.split(r'^\d+\. ', section, flags=re.M)[1:]
            assert items, f'{name}: an Exercises section without numbered exercises'
            for k, item in enumerate(items, 1):
                assert 'Hint:' in item, f'{name}, exercise {k} has no hint: {item[:80]!r}'
