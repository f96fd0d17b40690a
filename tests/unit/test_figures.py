"""Figures that cannot drift: every figure in a chapter's prose is its own cells' or sourced.

A **figure** is a number in a markdown cell of a chapter (or an appendix) with a decimal
point (``4.8``, ``0.37``) or three or more significant digits (``512,408``, ``125``; not
``120``, ``4,000``, ``35`` or ``1,000``: an integer's trailing zeros are not significant).
Each must be

1. **printed by a saved output** of a code cell of the same notebook (stream text or a
   ``text/plain``/``text/markdown``/``text/html`` result), or **checked by an assert**
   there (a number in an ``assert`` line of a code cell, which nbval runs: ``assert
   round(x / 1e6, 1) == 5.8`` backs 5.8 MB). The figure is what the output prints
   **rounded to the figure's own precision** (half a unit of its last decimal, or of its
   last significant digit for an integer: ``11.2`` reads 11.15 to 11.25, ``2,130,000``
   reads 2,125,000 to 2,135,000), in the same unit or another of powers of 1,000 (bytes
   as MB, seconds as ms) or of 1,024 (bytes as MiB), or as a percentage of a printed
   fraction (``4.8 %`` for 0.048) and the other way round; a figure followed by no unit
   (bytes, bits, seconds, minutes, hours, k, M, G, thousand, million, ...) or percent sign
   must be printed as it stands. A figure's caption line (``*Figure 9.2: ...*`` right
   under the code cell that draws it) may also take its numbers from that cell's code
   (the plot's settings and title are what the figure shows); or
2. in a chapter's ``## Exercises`` section only (the hints and checks): a number of
   **answers.ipynb**'s section on that chapter (the ``##`` heading with the chapter's
   title, up to a colon), in a saved output or in its code (the answer's cells use it as
   a given or assert it; nbval runs them), or a number in an inline ```assert ...``` of
   the same markdown cell that holds when this test runs it with nothing but ``math`` (an
   exercise's arithmetic check; test_the_arithmetic_checks_of_the_exercises_hold runs
   them all); or
3. **sourced in its own sentence**: the sentence (or the table row, or the list item's
   sentence) holds an author-year citation, i.e. a parenthesis or bracket with a year in
   it (``(Rajbhandari et al., 2020)``, ``Goyal et al. (2017)``), or names a file of the
   repository's ``docs/`` (``docs/performance.md``, as code or not), or links to a page
   on the web (``https://...``).

Not figures (the exclusions):

* anything in a code block, inline code (```...```) or math (``$...$``, ``$$...$$``):
  code is code, and a formula's numbers are its derivation, shown to the reader;
* link targets and HTML tags (anchors), and d2l's ``:label:`` lines;
* a chapter's ``## References`` section (volumes and pages);
* years: integers from 1950 to 2029 written without a thousands comma;
* references: a number after ``Section``, ``Chapter``, ``Figure``, ``Table``,
  ``Exercise``, ``Equation``, ``Eq.``, ``Appendix``, ``cell``, ``step``, ``epoch``,
  ``rank``, ``worker``, ``port``, ``issue`` or ``line`` (any case, plural too), so section,
  exercise, equation and cell numbers, and the names of steps and workers;
* names and versions: a number glued to letters (``fp16``, ``A100``, ``7B``, ``1st``),
  after a letter and a hyphen (``ResNet-18``, ``CIFAR-10``), with two dots or more
  (``4.2.5``, ``127.0.0.1``), after ``v``, ``:`` or ``/``, or after the name of a piece of
  software (torch, PyTorch, Python, CUDA, NCCL, JupyterLab, Horovod, ...).

The answers notebook is outside this rule: its asserts compare with values its cells
compute. Besides: no saved output of any notebook, answers too, shows an absolute path of
the machine it ran on (``/work/``, ``/tmp/``, ``/home/``, ``/root/``, ...), except the
ones listed in KNOWN_PATHS, each with why; the test fails if one of those is gone too, so
the list cannot outlive what it excuses.
"""
import ast
import math
import re

import nbformat
import pytest

from support import ROOT

NOTEBOOKS = ROOT / 'notebooks'


def book_order():
    """book/build.py's CHAPTERS (read, not imported: build.py needs nbconvert)."""
    tree = ast.parse((ROOT / 'book' / 'build.py').read_text())
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, 'id', '') == 'CHAPTERS' for t in n.targets))


def chapters():
    """The chapters in the book's order, answers aside, then any appendix notebook not in it."""
    names = [c for c in book_order() if c != 'answers']
    for pattern in ('appendix*.ipynb', 'appendix*/*.ipynb'):
        names += sorted(name for p in NOTEBOOKS.glob(pattern)
                        if (name := str(p.relative_to(NOTEBOOKS).with_suffix(''))) not in names)
    return names


FENCE = re.compile(r'^(```|~~~).*?^(```|~~~)\s*$', re.M | re.S)
MATH = re.compile(r'\$\$.*?\$\$|\$[^$\n]+\$|\\begin\{(\w+\*?)\}.*?\\end\{\1\}', re.S)
CODE = re.compile(r'`[^`\n]+`')
DOCS_CODE = re.compile(r'`(docs/[\w/.-]+\.md)`')
INLINE_ASSERT = re.compile(r'`(assert [^`\n]+)`')
LINK_TARGET = re.compile(r'(\[[^\]]*\])\(([^)\s]*)\)')
TAG = re.compile(r'</?[A-Za-z][^>]*>')
LABEL = re.compile(r'^:label:`[^`]*`\s*$', re.M)
TERM = 'TERM'
# a sentence ends at . ! ? before whitespace and a capital, a digit, an opener or TERM
END = re.compile(r'(?<!\be\.g)(?<!\bi\.e)(?<!\bal)(?<!\bcf)(?<!\bvs)(?<!\bEq)(?<!\bFig)'
                 r'[.!?]["\')\]*_]*\s+(?=["\'(\[*_]*(?:[A-Z0-9]|' + TERM + r'))')

# a number as prose and outputs write it: thousands by commas, or plain, maybe a decimal
NUMBER = re.compile(r'(?<![\w.:/-])(?<![A-Za-z]-)(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)*)'
                    r'(?![\w])(?!\.\d)')
PRINTED = re.compile(r'[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?')
REFERENCE = re.compile(r'\b(?:sections?|chapters?|figures?|tables?|exercises?|equations?|eq\.|'
                       r'appendix|appendices|cells?|steps?|epochs?|ranks?|workers?|ports?|'
                       r'issues?|lines?)\s+(?:\d[\d.]*(?:,?\s+|\s+(?:and|to|or)\s+))*$', re.I)
SOFTWARE = re.compile(r'\b(?:torch|pytorch|python|cuda|nccl|gloo|jupyterlab|jupyter|horovod|'
                      r'mpi|open mpi|zeromq|numpy|ubuntu|nbval|linux|macos|mxnet|tensorflow|'
                      r'version|v)\s*$', re.I)
SOURCE = re.compile(r'[(\[][^()\[\]]*\b(?:19[5-9]\d|20[0-2]\d)[a-z]?\b[^()\[\]]*[)\]]'
                    r'|docs/\w+\.md|https?://')
YEAR = re.compile(r'^(?:19[5-9]\d|20[0-2]\d)$')


def units(markdown):
    """A markdown cell's sentences, table rows and headings, as they read (code and math out)."""
    text = FENCE.sub('\n', markdown)
    text = MATH.sub(TERM, text)
    text = DOCS_CODE.sub(r'\1', text)          # `docs/performance.md` names its source
    text = CODE.sub(TERM, text)
    text = LABEL.sub('', text)
    text = TAG.sub('', text)
    out = []
    for para in re.split(r'\n\s*\n', text):
        lines, run = [], []
        for line in para.splitlines():
            if line.lstrip().startswith(('|', '#')) or re.match(r'\s*(?:[*+-]|\d+[.)])\s', line):
                if run:
                    lines.append(' '.join(run))
                run = [line]
                if line.lstrip().startswith(('|', '#')):
                    lines.append(line)
                    run = []
            else:
                run.append(line)
        if run:
            lines.append(' '.join(run))
        for block in lines:
            out += [s for s in END.split(block) if s.strip()]
    return out


def significant(digits):
    """The significant digits of a number written in prose (commas and the point ignored)."""
    whole, _, frac = digits.replace(',', '').partition('.')
    if frac:
        return len((whole + frac).lstrip('0'))
    return len(whole.strip('0'))


def figures_of(sentence):
    """The figures of one sentence: (text as written, value, half a unit of its precision,
    the scales it may be printed in)."""
    plain = LINK_TARGET.sub(r'\1', sentence)
    out = []
    for m in NUMBER.finditer(plain):
        text = m.group(1)
        before = plain[:m.start()]
        if text.count('.') > 1 or YEAR.match(text):
            continue
        if REFERENCE.search(before) or SOFTWARE.search(before):
            continue
        if '.' not in text and significant(text) < 3:
            continue
        whole, _, frac = text.replace(',', '').partition('.')
        if frac:
            half = 0.5 * 10 ** -len(frac)
        else:
            half = 0.5 * 10 ** (len(whole) - len(whole.rstrip('0')))
        out.append((text, float(text.replace(',', '')), half, scales_for(plain[m.end():])))
    return out


def output_text(cell):
    parts = []
    for out in cell.get('outputs', []):
        if 'text' in out:
            parts.append(out['text'])
        for kind, value in out.get('data', {}).items():
            if kind in ('text/plain', 'text/markdown', 'text/html'):
                parts.append(value if isinstance(value, str) else ''.join(value))
    return '\n'.join(parts)


def code_values(source, asserts_only=True):
    """The numbers in a cell's ``assert`` lines (or all its lines), ``1_000`` read as 1000."""
    values = set()
    for line in source.splitlines():
        if asserts_only and not line.lstrip().startswith('assert'):
            continue
        for m in PRINTED.finditer(re.sub(r'(?<=\d)_(?=\d)', '', line.split('#')[0])):
            values.add(abs(float(m.group(0).replace(',', ''))))
    return values


def printed_values(nb, code=False):
    """Every number the notebook's saved outputs print (with commas read both ways), and
    those of its ``assert`` lines (nbval runs them); with code, of all its code lines."""
    values = set()
    for cell in nb.cells:
        if cell.cell_type != 'code':
            continue
        values |= code_values(cell.source, asserts_only=not code)
        for m in PRINTED.finditer(output_text(cell)):
            for part in [m.group(0)] + m.group(0).split(','):
                try:
                    values.add(abs(float(part.replace(',', ''))))
                except ValueError:
                    pass
    return sorted(values)


UNIT_SCALES = sorted({1000.0 ** k for k in range(-4, 5)} | {1024.0 ** k for k in range(-3, 4)})
PERCENT_SCALES = [0.01, 1.0, 100.0]
# a unit after a figure: bytes, times, rates, counts in words (a figure with one of these may
# be printed in another power of 1,000 or 1,024); a percentage (printed as a fraction or not)
UNIT = re.compile(r'\s?(?:[kKMGT]i?B|[kKMGT]?bit|[kMGT]?B/s|bytes?|ms|µs|us|ns|s\b|sec|seconds?|'
                  r'minutes?|hours?|[kKMGT]\b|thousand|million|billion|trillion)')
PERCENT = re.compile(r'\s?(?:%|percent)')


def scales_for(after):
    """The scales a figure may be printed in, from the words right after it."""
    if PERCENT.match(after):
        return PERCENT_SCALES
    if UNIT.match(after):
        return UNIT_SCALES
    return [1.0]


def printed(value, half, values, scales=(1.0,)):
    for scale in scales:
        for v in values:
            if abs(v * scale - value) <= half * (1 + 1e-9) + 1e-12:
                return True
    return False


def title(nb):
    """A notebook's title: its first ``#`` heading, without an anchor."""
    for cell in nb.cells:
        if cell.cell_type == 'markdown':
            m = re.search(r'^# (.+)$', cell.source, re.M)
            if m:
                return TAG.sub('', m.group(1)).strip()
    return None


def answers_values(chapter_title):
    """What answers.ipynb prints in its section on a chapter (the ``##`` of the same title)."""
    nb = nbformat.read(NOTEBOOKS / 'answers.ipynb', as_version=4)
    section, cells = None, []
    for cell in nb.cells:
        if cell.cell_type == 'markdown':
            m = re.search(r'^## (.+)$', cell.source, re.M)
            if m:
                section = TAG.sub('', m.group(1)).strip()
        elif section and chapter_title.split(':')[0] == section.split(':')[0]:
            cells.append(cell)
    assert cells, f'answers.ipynb has no section "{chapter_title}"'
    return printed_values(nbformat.v4.new_notebook(cells=cells), code=True)


def inline_asserts(markdown):
    """The inline ``assert``s of a markdown cell, each with whether it runs with math alone:
    True (it holds), False (it fails), None (it needs the chapter's names)."""
    import math as math_module
    out = []
    for m in INLINE_ASSERT.finditer(markdown):
        try:
            exec(m.group(1), {'math': math_module, '__builtins__': __builtins__})
            out.append((m.group(1), True))
        except AssertionError:
            out.append((m.group(1), False))
        except Exception:
            out.append((m.group(1), None))
    return out


def checked(cell):
    """The numbers in the inline asserts of a cell that hold when run with math alone."""
    values = set()
    for code, holds in inline_asserts(cell.source):
        if holds:
            for m in PRINTED.finditer(re.sub(r'(?<=\d)_(?=\d)', '', code)):
                values.add(abs(float(m.group(0).replace(',', ''))))
    return sorted(values)


def unprinted(name):
    """The figures of a chapter's prose that no output prints and no source backs."""
    nb = nbformat.read(NOTEBOOKS / f'{name}.ipynb', as_version=4)
    values = printed_values(nb)
    answered = None
    missing, section = [], None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != 'markdown':
            continue
        for sentence in units(cell.source):
            heading = re.match(r'^## (.+)$', sentence.strip())
            if heading:
                section = heading.group(1).strip()
            if section == 'References' or SOURCE.search(sentence):
                continue
            if section == 'Exercises' and answered is None:
                answered = answers_values(title(nb)) if name in book_order() else []
            drawn = []
            if sentence.lstrip().startswith('*Figure ') and i and nb.cells[i - 1].cell_type == 'code':
                drawn = sorted(code_values(nb.cells[i - 1].source, asserts_only=False))
            for text, value, half, scales in figures_of(sentence):
                if printed(value, half, drawn, scales):
                    continue
                if not printed(value, half, values, scales) and not (
                        section == 'Exercises' and (printed(value, half, answered, scales) or
                                                    printed(value, half, checked(cell), scales))):
                    missing.append(f'[{i}] {text}: {" ".join(sentence.split())}')
    return missing


@pytest.mark.parametrize('name', chapters())
def test_every_figure_is_printed_by_a_cell_or_sourced(name):
    missing = unprinted(name)
    assert not missing, f'{name}: figures no cell prints and no source backs:\n' + \
        '\n'.join(missing)


# The figures rule itself, on made-up prose
def test_what_counts_as_a_figure():
    got = [t for t, _, _, _ in figures_of(
        'In 2018 Section 3.2 showed ResNet-18 on 4,000 fp16 A100s with torch 2.4 in 35 steps '
        'and 123 GB, 512,408 bytes, 0.37 s and 4.8 % (step 125, exercise 6, 127.0.0.1).')]
    assert got == ['123', '512,408', '0.37', '4.8']


def test_rounding_and_units():
    values = [11.25, 512408.0, 0.0482, 24_705_000.0]
    assert printed(11.2, 0.05, values) and printed(11.3, 0.05, values)   # 11.25 either way
    assert not printed(11.1, 0.05, values)
    (_, v, half, scales), = figures_of('FSDP2 held 512.4 KB')                # bytes as kB
    assert printed(v, half, values, scales) and not printed(v, half, values)
    (_, v, half, scales), = figures_of('it sent 4.8 % more')                 # a fraction as %
    assert printed(v, half, values, scales)
    (_, v, half, scales), = figures_of('24.7 M values')                      # as millions
    assert printed(v, half, values, scales)
    (_, v, half, scales), = figures_of('about 24.7 times')                   # no unit: as is
    assert scales == [1.0] and not printed(v, half, values, scales)
    assert not printed(512409, 0.5, values)


@pytest.mark.parametrize('name', chapters())
def test_the_arithmetic_checks_of_the_exercises_hold(name):
    nb = nbformat.read(NOTEBOOKS / f'{name}.ipynb', as_version=4)
    failing = [code for cell in nb.cells if cell.cell_type == 'markdown'
               for code, holds in inline_asserts(cell.source) if holds is False]
    assert not failing


def test_a_source_in_the_sentence():
    one, = units('The paper reports 7.5 billion parameters (Rajbhandari et al., 2020).')
    assert SOURCE.search(one)
    one, = units('Measured on a laptop, see `docs/performance.md`, 7.3 s.')
    assert SOURCE.search(one)
    one, = units('Measured on a laptop, see `benchmarks/checkpoint.py`, 7.3 s.')
    assert not SOURCE.search(one)
    two = units('It took 7.3 s, as docs/performance.md says. Then 1.18 s.')
    assert [bool(SOURCE.search(s)) for s in two] == [True, False]


# Saved outputs: no absolute path of the machine
ABSOLUTE = re.compile(r'(?<![\w.])/(?:work|tmp|home|root|Users|private|var/folders|mnt|scratch)/')

KNOWN_PATHS = {}   # (key: (notebook, cell index); value: the line, and why it may stay)


def absolute_paths():
    found = {}
    for path in sorted(NOTEBOOKS.glob('**/*.ipynb')):
        name = str(path.relative_to(NOTEBOOKS).with_suffix(''))
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == 'code':
                for line in output_text(cell).splitlines():
                    if ABSOLUTE.search(line):
                        found[(name, i)] = line.strip()[:160]
    return found


def test_no_saved_output_shows_an_absolute_path():
    found = absolute_paths()
    unknown = {k: v for k, v in found.items() if k not in KNOWN_PATHS}
    assert not unknown, f'absolute paths in saved outputs: {unknown}'
    gone = set(KNOWN_PATHS) - set(found)
    assert not gone, f'fixed, remove from KNOWN_PATHS: {gone}'
