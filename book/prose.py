"""How long the book's prose is, and how long its sentences: per notebook, against the targets.

    python book/prose.py              # the table, every notebook in notebooks/
    python book/prose.py --check      # the same, and exit 1 if a target is missed

A row per notebook (the chapters in the book's order, then appendices, then the answers):
the words of its markdown cells counted two ways (below), the median sentence length in
words, and the share of sentences over 40 words, each with the target beside it, and a
total line. The targets
(issue 50): a chapter's main path (its own notebook, appendices apart) at most 3,500 words
and the eleven chapters at most 30,000 together; in every notebook the median sentence at
most 20 words and at most 5 % of sentences over 40. Appendices and answers have no word
target. A row that misses a target is marked ``!``.

The word targets hold by **both** counts. The **plain** count (column ``wc -w``) is every
whitespace-separated token of the markdown cells, as ``wc -w`` on them would say: a
stricter reader's count, with formulas, code, link targets and table bars all words. The
**reader's** count (column ``words``) follows the rules below.

What the reader's count counts, in markdown cells only (code cells and outputs never):

* **dropped**: fenced code blocks (```` ``` ```` or ``~~~``), display math (``$$ ... $$``
  and ``\\begin{...} ... \\end{...}``), HTML tags (the anchors ``<a id="..."></a>``),
  d2l's ``:label:`...``` lines, images ``![alt](path)``, and a table's separator row;
* **one word each**: inline math ``$...$`` and inline code ```...```, however long (a
  formula or a name is read as one term); a link ``[text](target)`` counts its text only;
* a **word** is a run of characters between spaces that holds a letter or a digit after
  the above (so ``--``, ``|``, ``*`` and ``×`` alone are no words; ``4.8`` and
  ``data-parallel`` are one each);
* **headings** (``#`` lines) and **table rows** (lines that start with ``|``) count their
  words, but they are not sentences: a heading is a title and a cell a fragment;
* every other block of lines is a **text unit**: a paragraph (lines up to a blank line) or a
  list item (a line starting ``*``, ``-``, ``+`` or ``1.``, with its continuation lines),
  and a caption line ``*Figure 3.2: ...*`` is a paragraph of its own;
* a text unit is cut into **sentences** after ``.``, ``!`` or ``?`` (closing quotes,
  brackets and emphasis marks may follow) where whitespace and then a capital letter, a
  digit, an opening bracket or quote, or math/code follows; not after the abbreviations
  ``e.g.``, ``i.e.``, ``et al.``, ``cf.``, ``vs.``, ``etc.``, ``Fig.``, ``Eq.``, ``Sec.``,
  ``No.``. A unit's end ends its last sentence, with or without a full stop (a list item
  is at least one sentence). Colons and semicolons do not end a sentence: a sentence that
  chains clauses with them is long, and counted so.

The median of an even count is the mean of the two middle lengths.
"""
import argparse
import ast
import re
import statistics
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NOTEBOOKS = ROOT / 'notebooks'

CHAPTER_WORDS = 3500        # a chapter's main path
BOOK_WORDS = 30000          # the eleven chapters together
MEDIAN = 20                 # words, the median sentence of every notebook
LONG = 40                   # a sentence over this many words is long ...
LONG_SHARE = 0.05           # ... and at most this share of a notebook's sentences are

FENCE = re.compile(r'^(```|~~~)')
DISPLAY_MATH = re.compile(r'\$\$.*?\$\$|\\begin\{(\w+\*?)\}.*?\\end\{\1\}', re.S)
INLINE_MATH = re.compile(r'\$[^$\n]+\$')
INLINE_CODE = re.compile(r'`[^`\n]+`')
IMAGE = re.compile(r'!\[[^\]]*\]\([^)]*\)')
LINK = re.compile(r'\[([^\]]*)\]\([^)]*\)')
TAG = re.compile(r'</?[A-Za-z][^>]*>')
LABEL = re.compile(r'^:label:`[^`]*`\s*$')
HEADING = re.compile(r'^#{1,6}\s')
ITEM = re.compile(r'^\s*(?:[*+-]|\d+[.)])\s+')
TABLE_RULE = re.compile(r'^\s*\|?[\s:|-]+\|[\s:|-]*$')
WORD = re.compile(r'[A-Za-z0-9]')
TERM = 'TERM'               # what inline math and code become: one word
ABBREVIATIONS = ('e.g.', 'i.e.', 'et al.', 'cf.', 'vs.', 'etc.', 'Fig.', 'Eq.', 'Sec.', 'No.')
END = re.compile(r'[.!?]["\')\]*_]*(?=\s+["\'(\[*_]*(?:[A-Z0-9]|' + TERM + r'))')


def words(text):
    """The words of a piece of plain text (inline markup already replaced)."""
    return [w for w in text.split() if WORD.search(w)]


def plain(line):
    """A markdown line as it reads: math and code one word each, links their text, no tags."""
    line = INLINE_MATH.sub(TERM, line)
    line = INLINE_CODE.sub(TERM, line)
    line = IMAGE.sub('', line)
    line = LINK.sub(r'\1', line)
    return TAG.sub('', line)


def blocks(source):
    """A markdown cell's source as (kind, text): kind 'unit' (sentences), or 'words' only."""
    source = DISPLAY_MATH.sub('\n', source)
    out, unit, fenced = [], [], False

    def close():
        if unit:
            out.append(('unit', ' '.join(unit)))
            unit.clear()

    for line in source.splitlines():
        if FENCE.match(line.strip()):
            close()
            fenced = not fenced
            continue
        if fenced or LABEL.match(line.strip()):
            continue
        if not line.strip():
            close()
        elif HEADING.match(line):
            close()
            out.append(('words', plain(line.lstrip('#'))))
        elif line.lstrip().startswith('|'):
            close()
            if not TABLE_RULE.match(line):
                out.append(('words', plain(line.replace('|', ' '))))
        elif ITEM.match(line) or line.lstrip().startswith('*Figure '):
            close()
            unit.append(plain(ITEM.sub('', line, count=1)))
        else:
            unit.append(plain(line))
    close()
    return out


def sentences(text):
    """A text unit cut into sentences (lists of words); see the module's docstring."""
    out, start = [], 0
    for m in END.finditer(text):
        before = text[start:m.end()]
        if any(before.endswith(a) for a in ABBREVIATIONS):
            continue
        out.append(words(before))
        start = m.end()
    out.append(words(text[start:]))
    return [s for s in out if s]


def count(nb):
    """(words, sentence lengths) of a notebook's markdown cells."""
    total, lengths = 0, []
    for cell in nb.cells:
        if cell.cell_type != 'markdown':
            continue
        for kind, text in blocks(cell.source):
            if kind == 'words':
                total += len(words(text))
            else:
                for s in sentences(text):
                    total += len(s)
                    lengths.append(len(s))
    return total, lengths


def plain_count(nb):
    """Every whitespace-separated token of a notebook's markdown cells, as ``wc -w`` counts."""
    return sum(len(cell.source.split()) for cell in nb.cells if cell.cell_type == 'markdown')


def chapters_in_order():
    """book/build.py's CHAPTERS (read, not imported: build.py needs nbconvert)."""
    tree = ast.parse((HERE / 'build.py').read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, 'id', '') == 'CHAPTERS'
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit('book/build.py has no CHAPTERS')


def notebooks(folder=NOTEBOOKS):
    """(name, kind, path): the chapters in the book's order, the appendices, the answers."""
    order = [c for c in chapters_in_order() if c != 'answers']
    paths = {p.stem: p for p in folder.glob('*.ipynb')}
    paths.update({f'{p.parent.name}/{p.stem}': p for p in folder.glob('appendix*/*.ipynb')})
    rows = [(name, 'chapter', paths.pop(name)) for name in order if name in paths]
    answers = paths.pop('answers', None)
    rows += [(name, 'other', paths[name]) for name in sorted(paths)]
    if answers is not None:
        rows.append(('answers', 'other', answers))
    return rows


def row(kind, total, lengths, plain_total=0):
    """The figures of one notebook and whether each meets its target (by both word counts)."""
    median = statistics.median(lengths) if lengths else 0
    long = sum(n > LONG for n in lengths) / len(lengths) if lengths else 0
    return {'words': total, 'plain': plain_total, 'median': median, 'long': long,
            'sentences': len(lengths),
            'words_ok': kind != 'chapter' or max(total, plain_total) <= CHAPTER_WORDS,
            'median_ok': median <= MEDIAN, 'long_ok': long <= LONG_SHARE}


def table(folder=NOTEBOOKS):
    """The rows (name, figures) and the total line's figures, and whether all targets hold."""
    rows, chapters, all_lengths = [], [], []
    for name, kind, path in notebooks(folder):
        nb = nbformat.read(path, as_version=4)
        total, lengths = count(nb)
        rows.append((name, row(kind, total, lengths, plain_count(nb))))
        if kind == 'chapter':
            chapters.append(rows[-1][1])
        all_lengths += lengths
    total = row('other', sum(r['words'] for _, r in rows), all_lengths,
                sum(r['plain'] for _, r in rows))
    total['chapter_words'] = sum(r['words'] for r in chapters)
    total['chapter_plain'] = sum(r['plain'] for r in chapters)
    total['words_ok'] = max(total['chapter_words'], total['chapter_plain']) <= BOOK_WORDS
    ok = all(r['words_ok'] and r['median_ok'] and r['long_ok'] for _, r in rows + [('', total)])
    return rows, total, ok


def mark(good):
    return ' ' if good else '!'


def render(rows, total):
    width = max(len(name) for name, _ in rows + [('total', None)])
    most = '<= ' + format(CHAPTER_WORDS, ',')
    lines = [f'{"notebook":<{width}}  {"words":>7}  {"wc -w":>7}    {"sentences":>9}  '
             f'{"median":>6}    {"> 40":>6}',
             f'{"target":<{width}}  {most:>7}  {most:>7}    {"":>9}  '
             f'{"<= " + str(MEDIAN):>6}    {"<= " + format(LONG_SHARE, ".0%"):>6}']
    for name, r in rows:
        lines.append(f'{name:<{width}}  {r["words"]:>7,}  {r["plain"]:>7,} '
                     f'{mark(r["words_ok"])}  '
                     f'{r["sentences"]:>9,}  {r["median"]:>6g} {mark(r["median_ok"])}  '
                     f'{r["long"]:>6.1%} {mark(r["long_ok"])}')
    lines.append(f'{"total":<{width}}  {total["words"]:>7,}  {total["plain"]:>7,}    '
                 f'{total["sentences"]:>9,}  '
                 f'{total["median"]:>6g} {mark(total["median_ok"])}  '
                 f'{total["long"]:>6.1%} {mark(total["long_ok"])}')
    lines.append(f'the chapters\' main paths: {total["chapter_words"]:,} words, '
                 f'{total["chapter_plain"]:,} by wc -w (target <= {BOOK_WORDS:,} by both) '
                 f'{mark(total["words_ok"])}'.rstrip())
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--check', action='store_true', help='exit 1 if a target is missed')
    args = parser.parse_args(argv)
    rows, total, ok = table()
    print(render(rows, total))
    if args.check and not ok:
        sys.exit(1)


if __name__ == '__main__':
    main()
