"""Write d2l's cross-references into the chapters as links that read right everywhere.

    python book/refs.py            # convert notebooks/*.ipynb in place (markdown cells only)
    python book/refs.py --check    # change nothing; list what it would change, exit 1 if any

d2l writes ``:label:`sec_x``` under a heading and ``:numref:`sec_x``` in the text, which
its own tool (and ``book/build.py``) turns into links, but which JupyterLab and a
repository page show as they are written. This script writes what all three show right:

* a line ``:label:`sec_x``` becomes ``<a id="sec_x"></a>``, an empty anchor that draws
  nothing anywhere. The book's pages, nbviewer and VS Code scroll a link's ``#sec_x`` to
  it; JupyterLab 4.2.5 and later strip ``id`` attributes from markdown unless its
  sanitizer's 'Allow named properties' setting is on, and a repository page does not
  pass the fragment on, so there a link opens its chapter at the top: the right place
  for a chapter, and the words say which section or figure;
* ``:numref:`sec_x``` becomes ``[Section 5](scaling.ipynb#sec_x)``, or
  ``[Section 5.2](#sec_x)`` within its own chapter; a figure's label, ``[Figure 3.1](#fig_x)``;
  a label of Dive into Deep Learning's own chapters (build.EXTERNAL), a link to its page;
* a figure that a code cell draws, labelled in the cell's metadata
  (``{"d2l": {"label": "fig_x"}}``), gets its anchor at the end of the caption line under
  it, ``*Figure 3.2: words* <a id="fig_x"></a>``;
* 'Figure 3.2' in plain words, where that figure has a label, becomes a link to it.

The numbers are the book's: chapters in build.CHAPTERS' order (README's list, answers
last), then the appendices lettered A, B, ... (build.APPENDICES), sections by their ``##`` headings, figures in build.py's one sequence per chapter.
The links it wrote keep their label, so running it again writes their numbers again: it
is idempotent, and after chapters or figures move it renumbers the links. An unknown
label stops it, as it stops the build. Code cells and outputs are never touched.
"""
import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402

ANCHOR = '<a id="{}"></a>'
WRITTEN = re.compile(r'\[(?:Section|Figure) (?:\d+|[A-Z])(?:\.\d+)*\]\((?:(\w+)\.ipynb)?#([\w-]+)\)')
PLAIN = re.compile(r'(?<![\[\w])Figure ((?:\d+|[A-Z])\.\d+)\b(?!\]\()')   # 'Figure 3.2', not yet a link
SKIP = re.compile(r'(`[^`]*`|\$[^$]*\$|\[[^\]]*\]\([^)]*\))')   # code, math and links keep their words


def numbers(chapters_dir):
    """{label: (chapter's name, 'Section 5.2' or 'Figure 3.1')} over the book's chapters,
    as build.py numbers them."""
    refs = {}
    for name, number in build.numbered():
        nb = copy.deepcopy(nbformat.read(Path(chapters_dir) / f'{name}.ipynb', as_version=4))
        build.number_headings(nb, number)
        build.visible_captions(nb, number)
        found = {**build.number_figures(nb, number, name, chapters_dir),
                 **build.collect_labels(nb, name)}
        for label, (href, text) in found.items():
            if label in refs:
                raise SystemExit(f'refs: the label {label} is set twice ({refs[label][0]}, {name})')
            refs[label] = (name, text)
    return refs


def link(label, refs, here):
    """The markdown link to label from the chapter here."""
    if label in refs:
        name, text = refs[label]
        return f'[{text}]({"" if name == here else name + ".ipynb"}#{label})'
    if label in build.EXTERNAL:
        text, href = build.EXTERNAL[label]
        return f'[{text}]({href})'
    raise SystemExit(f'refs: {here}: :numref:`{label}` names no label of any chapter')


def convert_line(line, refs, here, figures):
    """One line of prose with its labels, numrefs and links as they should be."""
    label = build.label_of(line)
    if label:
        return ANCHOR.format(label)
    line = build.NUMREF.sub(lambda m: link(m.group(1), refs, here), line)
    line = WRITTEN.sub(lambda m: link(m.group(2), refs, here), line)
    if build.VISIBLE.match(line):
        return line                                     # a caption line names its own figure
    parts = SKIP.split(line)
    for i in range(0, len(parts), 2):
        parts[i] = PLAIN.sub(lambda m: link(figures[m.group(1)], refs, here)
                             if m.group(1) in figures else m.group(0), parts[i])
    return ''.join(parts)


def convert(nb, refs, here):
    """Convert one chapter's markdown cells in place; returns [(cell, old line, new line)]."""
    figures = {text.split(' ', 1)[1]: label for label, (_, text) in refs.items()
               if text.startswith('Figure ')}
    pending, changes = [], []             # pending: labels of the figures a caption line may caption
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == 'code':
            pending = []
            given = cell.metadata.get('d2l', {})
            for out in cell.get('outputs', []):
                if 'image/png' in out.get('data', {}):
                    pending.append(given.get('label'))
                    given = {}
            continue
        if cell.cell_type != 'markdown':
            continue
        lines = []
        for line, prose in build.markdown_lines(cell.source):
            new = convert_line(line, refs, here, figures) if prose else line
            shown = build.VISIBLE.match(new) if prose else None
            if shown and pending:
                label = pending.pop(0)
                if label:
                    new = f'*{shown.group(1)}: {shown.group(2)}* {ANCHOR.format(label)}'
            elif prose and new.strip():
                pending = []
            if new != line:
                changes.append((i, line, new))
            lines.append(new)
        cell.source = '\n'.join(lines)
    return changes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--chapters', default=build.ROOT / 'notebooks', help='where the .ipynb are')
    parser.add_argument('--check', action='store_true',
                        help='change nothing: list what would change, exit 1 if anything would')
    args = parser.parse_args(argv)
    refs = numbers(args.chapters)
    total = 0
    for name, _ in build.numbered():
        path = Path(args.chapters) / f'{name}.ipynb'
        nb = nbformat.read(path, as_version=4)
        changes = convert(nb, refs, name)
        total += len(changes)
        for i, old, new in changes:
            print(f'{name}.ipynb, cell {i}:\n  - {old[:150]}\n  + {new[:150]}')
        if changes and not args.check:
            nbformat.write(nb, path)
    verb = 'would change' if args.check else 'changed'
    print(f'refs: {verb} {total} lines' + (' (run python book/refs.py)' if args.check and total else ''))
    return 1 if args.check and total else 0


if __name__ == '__main__':
    sys.exit(main())
