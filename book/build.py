"""Build the chapters into a static HTML site that needs no kernel and no network.

    python book/build.py                     # notebooks/*.ipynb -> build/book/index.html
    python book/build.py --chapters DIR --out DIR

The pages: the chapters in CHAPTERS' order, numbered 1, 2, ...; then the appendices
(APPENDICES: the depth a first reading skips, each linked from its chapter), lettered
A, B, ... as d2l's are.

nbconvert does the work, with JupyterLab's HTML export as the page (``template/``:
a table of contents and a way back and forth, nothing loaded from elsewhere). Before
that, each chapter gets the book's markup that d2l's own tool would give it:

* its number, in its headings ('3. Ring All-Reduce', '3.2. ...') and figures;
* the cross-references, as ``book/refs.py`` writes them into the chapters so that they
  read right in JupyterLab and on a repository page too: an anchor line
  ``<a id="sec_x"></a>`` after a heading (d2l's ``:label:`sec_x```, which it converts)
  and links ``[Section 3](ring_allreduce_scratch.ipynb#sec_x)`` or ``[Figure 3.1](#fig_x)``
  (from d2l's ``:numref:`sec_x```). A link to a chapter becomes a link to its page; one
  to a chapter or anchor that does not exist, or whose 'Section 3'/'Figure 3.1' is not
  the number the book gives, stops the build. A raw ``:numref:`` still becomes a link
  (EXTERNAL: labels of Dive into Deep Learning's own chapters);
* every figure numbered in one sequence, 'Figure 3.1', 'Figure 3.2', ...: a diagram, a
  markdown image on a line of its own (``![caption](figures/x.svg)``, its words the
  caption, then ``:label:`fig_x``` for ``:numref:``; the file is embedded in the page),
  and each figure a code cell drew, captioned by its cell's metadata
  (``{"d2l": {"caption": ..., "label": ...}}``) or by its own words (a finished
  ``%launch`` says what its figure shows);
* the caption lines that a reader in JupyterLab or on a repository page sees under each
  figure, ``*Figure 3.2: words*`` (under a diagram's label line, or first in the markdown
  cell after a code cell's figures), taken out, since the page draws its own caption; a
  line whose number is not its figure's stops the build;
* math as MathML, which browsers draw themselves (latex2mathml), instead of MathJax;
* no nbval markers (``# NBVAL_SKIP``) in the code.

Beside the chapters, ``api/``: the API reference of ``d2ldist``, ``d2ldist.horovod`` and
``d2ldist.kv`` (their ``__all__``), generated from the docstrings by pdoc.
"""
import argparse
import base64
import html
import importlib
import mimetypes
import re
import sys
from pathlib import Path

import nbformat
from jinja2 import pass_context
from latex2mathml.converter import convert as mathml
from nbconvert import HTMLExporter
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
API = ['d2ldist', 'd2ldist.horovod', 'd2ldist.kv']    # the public modules: the API reference
TITLE = 'Multi-Machine Training, Taught by Code That Runs'
CHAPTERS = ['multi_machine_training', 'parameter_server_scratch', 'ring_allreduce_scratch',
            'multimachine_resnet18', 'scaling', 'concise', 'inside_a_job',
            'communication_efficiency', 'large_batches', 'sharding', 'fault_tolerance',
            'answers']      # the book's order (README's list); the exercises' answers last
APPENDICES = ['appendix_notation', 'appendix_parameter_server', 'appendix_ring_allreduce',
              'appendix_scaling', 'appendix_communication', 'appendix_large_batches',
              'appendix_zero', 'appendix_fsdp2', 'appendix_checkpoints',
              'appendix_replicated_servers']   # after the chapters
EXTERNAL = {'sec_resnet': ('the ResNet section of Dive into Deep Learning',
                           'https://d2l.ai/chapter_convolutional-modern/resnet.html')}
LABEL = re.compile(r'^(?::label:`([^`]+)`|<a id="([^"]+)"></a>)\s*$', re.M)   # d2l's, or refs.py's
NUMREF = re.compile(r':numref:`([^`]+)`')
LINK = re.compile(r'\[([^\]]*)\]\((?:(\w+)\.ipynb)?(?:#([\w-]+))?\)')  # [text](x.ipynb#label), [text](#label)
NUMBERED = re.compile(r'^(Section|Figure) (\d+|[A-Z])(\.\d+)*$')           # a link text the book numbers
HEADING = re.compile(r'^(#{1,2}) (.*)$')
NBVAL = re.compile(r'^# *NBVAL_\w+ *\n', re.M)
PLAIN_FIGURE = re.compile(r'^<(Figure|matplotlib)\b')   # a figure's repr, not words
IMAGE = re.compile(r'^!\[([^\]]*)\]\(([^)\s]+)\)\s*$')   # a figure: an image, a line of its own
INLINE = re.compile(r'(`[^`]+`|\$[^$]+\$)')              # code and math in a caption
VISIBLE = re.compile(r'^\*(Figure \d+\.\d+): (.+)\*\s*(?:<a id="([^"]+)"></a>)?\s*$')  # a caption line
                                                          # a reader sees, with its figure's anchor


def label_of(line):
    """The label that a line ``:label:`x``` or ``<a id="x"></a>`` sets, else None."""
    m = LABEL.match(line)
    return m and (m.group(1) or m.group(2))


# -- the markup ----------------------------------------------------------------------------
def markdown_lines(source):
    """The lines of a markdown cell with a flag: True outside fenced code."""
    fenced = False
    for line in source.split('\n'):
        if line.startswith('```'):
            fenced = not fenced
        yield line, not fenced and not line.startswith('```')


def numbered():
    """[(name, number)] for every page in the book's order: chapters '1', '2', ...,
    then appendices 'A', 'B', ..."""
    return ([(name, str(i)) for i, name in enumerate(CHAPTERS, 1)] +
            [(name, chr(ord('A') + i)) for i, name in enumerate(APPENDICES)])


def number_headings(nb, chapter):
    """'# Title' -> '# 3. Title', '## Part' -> '## 3.1. Part'; returns the chapter's title."""
    title, section = None, 0
    for cell in nb.cells:
        if cell.cell_type != 'markdown':
            continue
        lines = []
        for line, prose in markdown_lines(cell.source):
            m = HEADING.match(line) if prose else None
            if m and len(m.group(1)) == 1:
                title = title or m.group(2)
                line = f'# {chapter}. {m.group(2)}'
            elif m:
                section += 1
                line = f'## {chapter}.{section}. {m.group(2)}'
            lines.append(line)
        cell.source = '\n'.join(lines)
    return title


def collect_labels(nb, href):
    """Each ':label:' of the chapter: {label: (where it points, 'Section 3.2')}."""
    found = {}
    for cell in (c for c in nb.cells if c.cell_type == 'markdown'):
        heading = None
        for line, prose in markdown_lines(cell.source):
            m = HEADING.match(line) if prose else None
            if m:
                heading = m.group(2).split('. ', 1)[0]        # its number: '3' or '3.2'
            label = label_of(line) if prose else None
            if label:
                found[label] = (f'{href}#{label}', f'Section {heading}')
    return found


def resolve(nb, refs, href=''):
    """Labels become anchors on their heading, numrefs links, and links to a chapter
    (``x.ipynb#label``, or ``#label`` in the chapter whose page is href) links to its page;
    an unknown label, chapter or number is an error."""
    for cell in (c for c in nb.cells if c.cell_type == 'markdown'):
        lines = []
        for line, prose in markdown_lines(cell.source):
            label = label_of(line) if prose else None
            if label and lines and HEADING.match(lines[-1]):
                lines[-1] += f' <a id="{label}"></a>'
                continue
            if label:
                line = f'<a id="{label}"></a>'
            if prose:
                line = NUMREF.sub(lambda r: _link(r.group(1), refs), line)
                line = LINK.sub(lambda r: _page_link(r, refs, href), line)
            lines.append(line)
        cell.source = '\n'.join(lines)


def _page_link(m, refs, href):
    """[text](x.ipynb#label) -> [text](x.html#label), checked; other links as they are."""
    text, name, label = m.groups()
    if name is None and label is None:
        return m.group(0)
    if name is not None and name not in CHAPTERS + APPENDICES:
        raise SystemExit(f'book: the link {m.group(0)!r} names no chapter')
    page = f'{name}.html' if name is not None else href
    if label is None:
        return f'[{text}]({page})'
    if label not in refs or refs[label][0] != f'{page}#{label}':
        raise SystemExit(f'book: the link {m.group(0)!r} names no label of {page or "its chapter"}')
    if NUMBERED.match(text) and text != refs[label][1]:
        raise SystemExit(f'book: the link {m.group(0)!r} says {text}, the book {refs[label][1]}: '
                         'run python book/refs.py')
    return f'[{text}]({refs[label][0]})'


def _link(label, refs):
    if label in refs:
        href, text = refs[label]
        return f'[{text}]({href})'
    if label in EXTERNAL:
        text, href = EXTERNAL[label]
        return f'[{text}]({href})'
    raise SystemExit(f'book: :numref:`{label}` names no :label: of any chapter')


def visible_captions(nb, chapter):
    """Take out the caption line under each figure, ``*Figure 3.2: words*``, which readers
    of the notebook see (JupyterLab and repository pages show neither cell metadata nor an
    image's words); the book draws the caption itself. A code cell's figures are captioned
    by the first lines of the next markdown cell, a diagram by the line under its label.
    Returns [(number, words, caption, kind)] per figure in order: words None where the
    figure has no such line; kind 'diagram', 'metadata' (the cell's d2l.caption) or
    'output' (the figure's own words). A line that names another figure's number, or
    stands under none, stops the build."""
    found, k, expect = [], 0, []                # expect: figures a caption line may caption now

    def close():
        found.extend((number, None, caption, kind) for number, caption, kind in expect)
        expect.clear()

    for cell in nb.cells:
        if cell.cell_type == 'code':
            close()
            given = cell.metadata.get('d2l', {})
            for out in cell.get('outputs', []):
                if 'image/png' not in out.get('data', {}):
                    continue
                k += 1
                words = out.data.get('text/plain', '')
                caption, kind = given.get('caption'), 'metadata'
                if not caption:
                    caption, kind = ('' if PLAIN_FIGURE.match(words) else words), 'output'
                expect.append((f'Figure {chapter}.{k}', caption, kind))
                given = {}
            continue
        if cell.cell_type != 'markdown':
            continue
        lines, source = [], list(markdown_lines(cell.source))
        for i, (line, prose) in enumerate(source):
            shown = VISIBLE.match(line) if prose else None
            if shown:
                if not expect:
                    raise SystemExit(f'book: chapter {chapter}: the caption line {line[:60]!r} '
                                     'stands under no figure')
                number, caption, kind = expect.pop(0)
                if shown.group(1) != number:
                    raise SystemExit(f'book: chapter {chapter}: the caption line says '
                                     f'{shown.group(1)} under {number}')
                found.append((number, shown.group(2), caption, kind))
                continue
            lines.append(line)
            if not prose or not line.strip() or (LABEL.match(line) and i and
                                                 IMAGE.match(source[i - 1][0])):
                continue                                # a figure's caption may still come
            close()
            image = IMAGE.match(line)
            if image:
                k += 1
                expect.append((f'Figure {chapter}.{k}', image.group(1), 'diagram'))
        close()
        cell.source = '\n'.join(lines)
    close()
    return found


def number_figures(nb, chapter, href='', chapters_dir=ROOT / 'notebooks'):
    """Number the chapter's figures in order, 'Figure 3.1', 'Figure 3.2', ..., and caption
    them: a markdown image on a line of its own becomes the image (embedded, the file is
    chapters_dir/its path) with its words as caption; each PNG a code cell shows gets the
    caption of the cell's metadata d2l.caption (its first figure), else its own words.
    Returns {label: (where it points, 'Figure 3.2')} for :numref:."""
    refs, numbers = {}, iter(range(1, 10 ** 6))

    def number(label):
        k = next(numbers)
        anchor = label or f'fig-{chapter}-{k}'
        if label:
            refs[label] = (f'{href}#{label}', f'Figure {chapter}.{k}')
        return f'Figure {chapter}.{k}', anchor

    for cell in nb.cells:
        if cell.cell_type == 'markdown':
            lines, source = [], list(markdown_lines(cell.source))
            for i, (line, prose) in enumerate(source):
                image = IMAGE.match(line) if prose else None
                if prose and LABEL.match(line) and i and IMAGE.match(source[i - 1][0]):
                    continue                                    # the figure's label: used
                if not image:
                    lines.append(line)
                    continue
                below = label_of(source[i + 1][0]) if i + 1 < len(source) else None
                figure, anchor = number(below)
                lines += ['', figure_html(image.group(1), Path(chapters_dir) / image.group(2),
                                          figure, anchor), '']
            cell.source = '\n'.join(lines)
            continue
        if cell.cell_type != 'code':
            continue
        cell.source = NBVAL.sub('', cell.source)
        given = cell.metadata.get('d2l', {})
        for out in cell.get('outputs', []):
            if 'image/png' not in out.get('data', {}):
                continue
            words = out.data.get('text/plain', '')
            caption = given.get('caption') or ('' if not words or PLAIN_FIGURE.match(words)
                                               else words)
            figure, anchor = number(given.get('label'))
            out.metadata['d2l_figure'] = {'number': figure, 'id': anchor, 'caption': caption,
                                          'caption_html': caption_html(caption)}
            given = {}                                          # the metadata's: the first
    return refs


def caption_html(words):
    """A caption as HTML: its words, with `code` and $math$ (as MathML)."""
    parts = INLINE.split(words)
    return ''.join(html.escape(p, quote=False) if i % 2 == 0 else
                   f'<code>{html.escape(p[1:-1], quote=False)}</code>' if p.startswith('`') else
                   mathml(p[1:-1]) for i, p in enumerate(parts))


def figure_html(words, path, figure, anchor):
    """A diagram on the page: the image itself (no file to ship), its number, its caption."""
    if not path.is_file():
        raise SystemExit(f'book: {figure} shows {path}, which does not exist')
    if not words.strip():
        raise SystemExit(f'book: {figure} ({path.name}) has no caption: ![caption]({path.name})')
    kind = 'image/svg+xml' if path.suffix == '.svg' else mimetypes.guess_type(path.name)[0]
    data = base64.b64encode(path.read_bytes()).decode('ascii')
    return (f'<div class="d2l-figure d2l-diagram"><div class="d2l-image"><img src="data:{kind};'
            f'base64,{data}" alt="{html.escape(words)}"></div><p class="d2l-caption" id="{anchor}">'
            f'<b>{figure}</b>&ensp;{caption_html(words)}</p></div>')


# -- the pages -----------------------------------------------------------------------------
class MathMLRenderer(IPythonRenderer):
    """nbconvert's markdown renderer, with $...$ and $$...$$ drawn as MathML."""

    def inline_math(self, body):
        return mathml(body)

    def block_math(self, body):
        return mathml(body, display='block')

    def latex_environment(self, name, body):
        return mathml(f'\\begin{{{name}}}{body}\\end{{{name}}}', display='block')


class BookExporter(HTMLExporter):
    """JupyterLab's HTML export with the book's template and MathML math."""

    @pass_context
    def markdown2html(self, context, source):
        cell = context.get('cell', {})
        renderer = MathMLRenderer(escape=False, attachments=cell.get('attachments', {}),
                                  embed_images=True, anchor_link_text=self.anchor_link_text,
                                  exclude_anchor_links=self.exclude_anchor_links)
        return MarkdownWithMath(renderer=renderer).render(source)


def exporter():
    return BookExporter(template_name='d2lbook', extra_template_basedirs=[str(HERE / 'template')],
                        embed_images=True)


def page(exporter, nb, name, title, book):
    """One chapter (or the index) as HTML."""
    resources = {'metadata': {'name': title}, 'book': book}
    html, _ = exporter.from_notebook_node(nb, resources=resources)
    return html


def index_notebook(titles):
    """The front page: what the book is, its chapters in order, its appendices, and the
    API reference."""
    intro = ROOT.joinpath('README.md').read_text().split('\n\n')[1]
    toc = '\n'.join(f'{i}. [{title}]({name}.html)'
                    for i, (name, title) in enumerate(titles[:len(CHAPTERS)], 1))
    text = f'# {TITLE}\n\n{intro}\n\n## Chapters\n\n{toc}'
    if APPENDICES:
        text += '\n\n## Appendices\n\n' + '\n'.join(
            f'* [{number}. {title}]({name}.html)'
            for (name, number), (_, title) in zip(numbered()[len(CHAPTERS):], titles[len(CHAPTERS):]))
    api = ', '.join(f'[`{name}`](api/{name.replace(".", "/")}.html)' for name in API)
    text += f'\n\n## API reference\n\nEvery public name of {api}, from its docstring.'
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(text)]
    return nb


def api_reference(out):
    """The API reference into out (pdoc: one page per module of API, their ``__all__``,
    nothing loaded from elsewhere); returns the pages written."""
    try:
        import pdoc
    except ImportError:
        raise SystemExit("book: the API reference needs pdoc: pip install -c constraints.txt "
                         "pdoc (make venv installs it)") from None
    for name in API:                 # d2ldist's names load on first use: load them for pdoc
        module = importlib.import_module(name)
        for public in module.__all__:
            getattr(module, public)
    pdoc.render.configure(docformat='restructuredtext', show_source=False,
                          footer_text=TITLE)
    pdoc.pdoc(*API, output_directory=Path(out))
    return sorted(Path(out).rglob('*.html'))


def build(chapters_dir, out):
    """Write index.html and one page per chapter and appendix into out; returns the pages."""
    chapters_dir, out = Path(chapters_dir), Path(out)
    order = numbered()
    nbs = [nbformat.read(chapters_dir / f'{name}.ipynb', as_version=4) for name, _ in order]
    titles, refs = [], {}
    for (name, number), nb in zip(order, nbs):
        titles.append((name, number_headings(nb, number)))
        visible_captions(nb, number)
        refs.update(number_figures(nb, number, f'{name}.html', chapters_dir))
        refs.update(collect_labels(nb, f'{name}.html'))
    out.mkdir(parents=True, exist_ok=True)
    ex = exporter()
    links = [{'href': f'{name}.html', 'title': title} for name, title in titles]
    pages = [out / 'index.html']
    pages[0].write_text(page(ex, index_notebook(titles), 'index', TITLE,
                             {'title': TITLE, 'prev': None, 'next': links[0]}))
    api_reference(out / 'api')
    for i, ((name, _), nb) in enumerate(zip(order, nbs)):
        resolve(nb, refs, f'{name}.html')
        book = {'title': TITLE, 'prev': links[i - 1] if i else None,
                'next': links[i + 1] if i + 1 < len(links) else None}
        pages.append(out / f'{name}.html')
        pages[-1].write_text(page(ex, nb, name, titles[i][1], book))
    return pages


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--chapters', default=ROOT / 'notebooks', help='where the .ipynb are')
    parser.add_argument('--out', default=ROOT / 'build' / 'book', help='where the site goes')
    args = parser.parse_args(argv)
    pages = build(args.chapters, args.out)
    print(f'book: {len(pages)} pages and the API reference (api/) in {args.out} '
          f'(open {pages[0]})')


if __name__ == '__main__':
    sys.exit(main())
