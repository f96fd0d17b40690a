"""The documentation stays true: what the README and docs/ say is checked against the code.

* links: every relative link and picture leads to a file, and every #anchor to a heading
  of it; every file path the pages quote exists; every ``d2ldist.name`` they quote imports;
* the README: short enough to read in five minutes; its chapter list is the book's order
  with the chapters' titles; its ``%launch`` example runs where ``make lab`` starts the
  kernel; its hang line is the one the code prints; the ``make`` targets named exist;
* docs/compat.md: its tables list exactly the MXNet kvstore names and the Horovod names
  that d2ldist provides or refuses, read from the code, and the parameters in MXNet's
  positional order where a row gives them;
* docs/launch.md: its option table is d2l-launch's options, row for row;
* docs/performance.md: every measurement names the benchmark command that made it; the
  command still runs as written (the script exists and takes those options); a quoted
  printout carries the column headers the script prints today. (The figures themselves
  are measurements: re-running every benchmark would take an hour, root and a GPU.)
* LICENSE, CITATION.cff and the README's citation agree with pyproject.toml.
"""
import ast
import importlib
import inspect
import re
import tomllib

import pytest

from support import ROOT

PAGES = sorted([ROOT / 'README.md', ROOT / 'CONTRIBUTING.md', ROOT / 'ARCHITECTURE.md',
                *(ROOT / 'docs').rglob('*.md')])
README = (ROOT / 'README.md').read_text()
PYPROJECT = tomllib.loads((ROOT / 'pyproject.toml').read_text())


def page_id(path):
    return str(path.relative_to(ROOT))


# -- reading markdown --------------------------------------------------------------------------
FENCE = re.compile(r'^```(\w*)\n(.*?)^```\s*$', re.S | re.M)


def prose(text):
    """The text without fenced code blocks (links and headings live outside them)."""
    return FENCE.sub('', text)


def fenced(text):
    """[(language, body)] of the fenced code blocks (a printout's language: text)."""
    return FENCE.findall(text)


def headings(text):
    return [m.group(2) for m in re.finditer(r'^(#{1,6}) +(.*?) *#*$', prose(text), re.M)]


def slug(heading):
    """The anchor a repository page gives a heading (GitHub's rule)."""
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading)      # a link: its words
    return re.sub(r'[^\w\- ]', '', text.strip().lower()).replace(' ', '-')


def anchors(text):
    seen, out = {}, set()
    for h in headings(text):
        s = slug(h)
        out.add(s if s not in seen else f'{s}-{seen[s]}')
        seen[s] = seen.get(s, 0) + 1
    return out


def sections(text, level='## '):
    """{heading: body} of the sections at this level."""
    parts = re.split(rf'^{level}(.*)$', text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def split_row(line):
    """The cells of a table row (a pipe written \\| stays in its cell)."""
    cells = re.split(r'(?<!\\)\|', line.strip())
    return [c.strip() for c in cells[1:-1]]


def tables(text):
    """[(header cells, [row cells])] of the markdown tables outside code blocks."""
    out, lines = [], prose(text).split('\n')
    i = 0
    while i < len(lines):
        if lines[i].startswith('|') and i + 1 < len(lines) and re.match(r'^\|[ :|-]+\|$', lines[i + 1]):
            header, rows, i = split_row(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith('|'):
                rows.append(split_row(lines[i]))
                i += 1
            out.append((header, rows))
        else:
            i += 1
    return out


def code_spans(text):
    return re.findall(r'`([^`\n]+)`', text)


# -- links, paths and names ----------------------------------------------------------------
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')


@pytest.mark.parametrize('page', PAGES, ids=page_id)
def test_relative_links_lead_to_files_and_headings(page):
    text = page.read_text()
    links = LINK.findall(prose(text))
    assert links, f'{page_id(page)} links nowhere'
    for target in links:
        if re.match(r'^[a-z]+:', target):              # https:, mailto: (not fetched)
            continue
        path, _, anchor = target.partition('#')
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f'{page_id(page)}: link to {target}: no such file'
        assert ROOT in file.parents or file == ROOT, f'{page_id(page)}: {target} leaves the repository'
        if anchor:
            assert file.suffix == '.md', f'{page_id(page)}: {target}: an anchor in a non-page'
            assert anchor in anchors(file.read_text()), \
                f'{page_id(page)}: link to {target}: no heading with that anchor in {file.name}'


def test_the_readme_shows_the_dashboard_from_a_local_file():
    pictures = re.findall(r'!\[[^\]]*\]\(([^)\s]+)\)', README)
    assert 'docs/dashboard.png' in pictures
    assert (ROOT / 'docs' / 'dashboard.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert all(not re.match(r'^[a-z]+:', p) for p in pictures), 'a picture fetched from the net'


PATH = re.compile(r'(?<![\w./-])((?:d2ldist|tests|benchmarks|examples|notebooks|book|docs|\.ci)'
                  r'/[\w./*-]*)(?:::(\w+))?')


@pytest.mark.parametrize('page', PAGES, ids=page_id)
def test_quoted_paths_exist(page):
    text = page.read_text()                   # (printouts, ```text, quote no paths)
    text = prose(text) + ''.join(body for language, body in fenced(text) if language != 'text')
    for path, test in PATH.findall(text):
        path = path.rstrip('.')
        found = sorted(ROOT.glob(path)) if '*' in path else [ROOT / path]
        assert found and all(p.exists() for p in found), f'{page_id(page)}: {path}: no such file'
        if test:
            assert re.search(rf'^def {test}\(', found[0].read_text(), re.M), \
                f'{page_id(page)}: {path}::{test}: no such test'


def resolve(dotted):
    """The object a dotted name ``d2ldist.a.b`` names (import the longest module prefix)."""
    parts = dotted.split('.')
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module('.'.join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize('page', PAGES, ids=page_id)
def test_quoted_d2ldist_names_exist(page):
    for dotted in sorted(set(re.findall(r'\bd2ldist(?:\.[A-Za-z_]\w*)+', page.read_text()))):
        try:
            resolve(dotted)
        except (ImportError, AttributeError) as e:
            pytest.fail(f'{page_id(page)} names {dotted}, which does not exist: {e}')


@pytest.mark.parametrize('page', PAGES, ids=page_id)
def test_tables_have_as_many_cells_as_their_header(page):
    for header, rows in tables(page.read_text()):
        for row in rows:
            assert len(row) == len(header), f'{page_id(page)}: {row} under {header}'


# -- the README ----------------------------------------------------------------------------
def test_the_readme_reads_in_five_minutes():
    assert len(README.splitlines()) <= 250
    for part in ('Set-up', 'Read the book', 'Running a job', 'On a cluster', 'The API',
                 'Measurements', 'Troubleshooting', 'Citing', 'License'):
        assert part in sections(README), f'the README has no section {part!r}'


def test_the_books_front_page_takes_the_readmes_first_paragraph():
    intro = README.split('\n\n')[1]          # what book/build.py puts on its front page
    assert re.match(r'[A-Z]', intro) and '\n#' not in intro, intro


def book_order():
    """book/build.py's CHAPTERS, read without importing it (it needs the book's tools)."""
    tree = ast.parse((ROOT / 'book' / 'build.py').read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', '') == 'CHAPTERS':
            return ast.literal_eval(node.value)
    raise AssertionError('book/build.py has no CHAPTERS')


def title(name):
    import nbformat
    nb = nbformat.read(ROOT / 'notebooks' / f'{name}.ipynb', as_version=4)
    for cell in nb.cells:
        m = re.search(r'^# (.+)$', cell.source, re.M) if cell.cell_type == 'markdown' else None
        if m:
            return m.group(1).strip()


def test_the_reading_path_is_the_books_order_with_the_chapters_titles():
    listed = re.findall(r'^(\d+)\. (.+) \(`(\w+)\.ipynb`\)$', sections(README)['Read the book'], re.M)
    assert [int(n) for n, _, _ in listed] == list(range(1, len(listed) + 1))
    assert [name for _, _, name in listed] == book_order()
    for _, words, name in listed:
        assert words == title(name), f'{name}: the README says {words!r}, the chapter {title(name)!r}'


def makefile_targets():
    text = (ROOT / 'Makefile').read_text()
    return dict(re.findall(r'^([\w-]+):[^=\n]*\n((?:\t.*\n?)*)', text, re.M))


@pytest.mark.parametrize('page', PAGES, ids=page_id)
def test_make_targets_named_exist(page):
    targets = makefile_targets()
    text = page.read_text()
    code = code_spans(prose(text)) + [body for _, body in fenced(text)]
    named = {t for c in code for t in re.findall(r'\bmake ([a-z][\w-]*)', c)}
    assert named <= set(targets), f'{page_id(page)} names make {named - set(targets)}'


def test_the_launch_example_runs_where_make_lab_starts_the_kernel():
    """make lab opens JupyterLab on notebooks/, where each chapter's kernel runs: the
    README's %launch lines name their scripts from there."""
    assert '$(VENV)/bin/jupyter lab notebooks/' in makefile_targets()['lab']
    lines = [line for page in PAGES for line in page.read_text().splitlines()
             if line.startswith('%launch ') and '.py' in line]
    assert any(line in README for line in lines)
    for line in lines:
        script = next(w for w in line.split() if w.endswith('.py'))
        assert (ROOT / 'notebooks' / script).is_file(), f'{line}: no {script} from notebooks/'


def test_the_hang_line_is_the_one_the_code_prints():
    from d2ldist.runtime import hang
    m = re.search(r'^\[worker (\d+)\] d2ldist: worker \1 has waited (\d+) s '
                  r'(in \w+\(.*\) \(collective (\d+)\) for worker (\d+)): (.*)$', README, re.M)
    assert m, 'the README shows no hang line of a ring collective'
    who = m.group(5)
    started = int(re.search(r'it has started (\d+) collectives', m.group(6)).group(1))
    assert m.group(6) == hang.sentence([(f'worker:{who}', {'counter': started})])
    node = (ROOT / 'd2ldist' / 'runtime' / 'node.py').read_text()
    assert "has waited {waited:g} s '" in node and 'say(line)' in node
    assert "hang.Wait(f'in {call} (collective {self.calls}) for {left}'" in \
        (ROOT / 'd2ldist' / 'collectives' / 'link.py').read_text()


def test_shared_memory_is_x86_64_linux_only_as_the_readme_says():
    from d2ldist.runtime import shm
    source = inspect.getsource(shm.enabled)
    assert "sys.platform == 'linux'" in source and "'x86_64'" in source
    assert 'x86-64' in sections(README)['Troubleshooting']


# -- docs/compat.md ------------------------------------------------------------------------
COMPAT = (ROOT / 'docs' / 'compat.md').read_text()
# MXNet's underscore names that scripts call (kv._barrier()); d2ldist's own underscore
# names are private and not listed
MXNET_PRIVATE = ('_barrier', '_set_updater')
ABSENT = object()          # what a name that d2ldist does not have looks up to


def api_rows(heading):
    """[(tokens, provided)] of the table under the heading; a token is ('kind', name),
    or (name, params or None) for ``name`` / ``name(a, b)``."""
    (header, rows), = tables(sections(COMPAT)[heading])
    out = []
    for row in rows:
        tokens = []
        for span in code_spans(row[0]):
            kind = re.fullmatch(r"create\('(\w+)'\)", span)
            call = re.fullmatch(r'([A-Za-z_][\w.]*)(?:\((.*)\))?', span)
            assert kind or call, f'compat.md: cannot read {span!r}'
            if kind:
                tokens.append(('kind', kind.group(1)))
            else:
                params = None if call.group(2) is None else \
                    [p.split('=')[0].strip() for p in call.group(2).split(',') if p.strip()]
                tokens.append((call.group(1), params))
        out.append((tokens, not row[1].startswith('no')))
    return out


def parameters(fn):
    """A callable's parameters as compat.md writes them: name, *args, **kwargs."""
    stars = {inspect.Parameter.VAR_POSITIONAL: '*', inspect.Parameter.VAR_KEYWORD: '**'}
    return [stars.get(p.kind, '') + p.name for p in inspect.signature(fn).parameters.values()
            if p.name != 'self']


def check_rows(rows, lookup, table):
    """Each named thing exists (provided) or not (refused), with the parameters given."""
    listed = set()
    for tokens, provided in rows:
        for name, params in tokens:
            if name == 'kind':
                continue
            top = name.split('.')[0]
            listed.add(top)
            obj = lookup(name)
            if not provided:
                assert obj is ABSENT, f'{table}: {name} is marked no, but d2ldist has it'
                continue
            assert obj is not ABSENT, f'{table}: {name} is marked yes, but d2ldist has no such name'
            if params is not None:
                assert parameters(obj) == params, \
                    f'{table}: {name}({", ".join(params)}), but the code has {parameters(obj)}'
    return listed


def test_compat_lists_exactly_the_kvstore_names():
    from d2ldist import kv
    from d2ldist.kv.worker import ALIASES, KINDS, REFUSED, DistKVStore
    local = kv.create('local')

    def lookup(name):
        for place in (DistKVStore, local):
            try:
                return resolve_attr(place, name)
            except AttributeError:
                pass
        return ABSENT

    rows = api_rows("MXNet's kvstore")
    listed = check_rows(rows, lookup, "compat.md, MXNet's kvstore")
    code = {n for place in (DistKVStore, local) for n in dir(place)
            if not n.startswith('_') or n in MXNET_PRIVATE}
    assert sorted(code - listed) == [], 'in the code, not in compat.md'
    assert sorted(listed - code) == [], 'in compat.md, not in the code'
    kinds = {p: {n for tokens, provided in rows if provided == p for k, n in tokens if k == 'kind'}
             for p in (True, False)}
    assert kinds[True] == set(KINDS) | set(ALIASES)
    assert kinds[False] == set(REFUSED)


def resolve_attr(obj, dotted):
    for name in dotted.split('.'):
        obj = getattr(obj, name)
    return obj


def test_compat_lists_exactly_the_horovod_names():
    import d2ldist
    import d2ldist.horovod as hvd
    from d2ldist.collectives import missing

    def lookup(name):
        try:
            return resolve_attr(hvd, name)
        except AttributeError:
            return ABSENT

    rows = api_rows('Horovod')
    listed = check_rows(rows, lookup, 'compat.md, Horovod')
    code = {n for n in dir(hvd) if not n.startswith('_')
            and (not inspect.ismodule(getattr(hvd, n)) or n == 'elastic')
            and getattr(getattr(hvd, n), '__module__', None) != missing.__name__}
    refused = {name for tokens, provided in rows if not provided for name, _ in tokens}
    assert sorted(code - listed) == [], 'in d2ldist.horovod, not in compat.md'
    assert sorted(listed - code - refused) == [], 'in compat.md, not in d2ldist.horovod'
    assert refused == set(missing.NOT_YET), "the 'no' rows are missing.py's names"
    for name in code:                     # import d2ldist as hvd: the same names
        assert hasattr(d2ldist, name), f'd2ldist.horovod.{name} is not on d2ldist'
    for name in refused:                  # feature detection works; the error says why
        for face in (hvd, d2ldist):
            assert not hasattr(face, name)
            with pytest.raises(NotImplementedError, match=rf'^hvd\.{name}: not in d2ldist: .+'):
                getattr(face, name)


# -- docs/launch.md ------------------------------------------------------------------------
def test_the_launch_table_is_d2l_launchs_options():
    from d2ldist.launch.cli import build_parser
    (header, rows), = tables(sections((ROOT / 'docs' / 'launch.md').read_text())['The options'])
    documented, positional = set(), set()
    for row in rows:
        spans = ' '.join(code_spans(row[0]))
        options = re.findall(r'(?<![\w-])(--?[A-Za-z][\w-]*)', spans)
        documented |= set(options)
        if not options:
            positional.add(spans.split()[0])
    actions = build_parser()._actions
    code = {s for a in actions for s in a.option_strings} - {'-h', '--help'}
    assert sorted(code - documented) == [], 'options of d2l-launch not in docs/launch.md'
    assert sorted(documented - code) == [], 'options in docs/launch.md that d2l-launch lacks'
    assert positional == {a.dest for a in actions if not a.option_strings}


# -- docs/performance.md -------------------------------------------------------------------
PERFORMANCE = (ROOT / 'docs' / 'performance.md').read_text()
COMMAND = re.compile(r'`((?:python|bash) (benchmarks/[\w.]+)((?: [^`]*)?))`')


def script_options(script):
    """Every option string a benchmark's argparse takes (read from its source)."""
    tree = ast.parse(script.read_text())
    return {a.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, 'attr', '') == 'add_argument'
            for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}


def header_lines(script):
    """The lines a script prints whose every field is a constant: its column headers."""
    def text(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.FormattedValue) and isinstance(node.value, ast.Constant):
            spec = text(node.format_spec) if node.format_spec else ''
            return format(node.value.value, spec)
        if isinstance(node, ast.JoinedStr):
            return ''.join(text(v) for v in node.values)
        raise ValueError('not constant')

    lines = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, 'id', '') == 'print' and node.args \
                and isinstance(node.args[0], ast.JoinedStr):
            fields = [v for v in node.args[0].values if isinstance(v, ast.FormattedValue)]
            try:
                line = text(node.args[0])
            except ValueError:
                continue
            if len(fields) >= 2:
                lines.append(line.strip())
    return lines


def commands(text):
    """[(script, its words)] of the benchmark commands, quoted or in a code block."""
    quoted = [(m.group(2), m.group(3).split()) for m in COMMAND.finditer(prose(text))]
    blocks = [(m.group(1), m.group(2).split()) for _, body in fenced(text)
              for m in re.finditer(r'^(?:python|bash) (benchmarks/\S+)([^#\n]*)', body, re.M)]
    return quoted + blocks


@pytest.mark.parametrize('page', PAGES, ids=page_id)
def test_benchmark_commands_run_as_written(page):
    for script, words in commands(page.read_text()):
        path = ROOT / script
        assert path.is_file(), f'{page_id(page)}: {script}: no such benchmark'
        if path.suffix == '.py':
            taken = script_options(path)
            for word in words:
                if word.startswith('-'):
                    assert word in taken, f'{page_id(page)}: {script} takes no {word}'


@pytest.mark.parametrize('heading', list(sections(PERFORMANCE)))
def test_every_measurement_names_the_command_that_made_it(heading):
    body = sections(PERFORMANCE)[heading]
    named = [ROOT / s for s, _ in commands(body)]
    assert named, f'performance.md, {heading}: no benchmark command named'
    for language, block in fenced(body):
        if language != 'text':           # a command to run, not a printout
            continue
        scripts = [s for s in named if s.suffix == '.py' and header_lines(s)]
        assert scripts, f'performance.md, {heading}: a printout, but no script that prints headers'
        for script in scripts:
            missing = [h for h in header_lines(script) if h not in block]
            if not missing:
                break
        else:
            pytest.fail(f'performance.md, {heading}: the printout lacks the header lines '
                        f'{script.name} prints today: {missing}')


# -- license and citation ------------------------------------------------------------------
def test_license_is_the_apache_text_pyproject_names():
    assert PYPROJECT['project']['license'] == 'Apache-2.0'          # (an SPDX expression)
    text = (ROOT / 'LICENSE').read_text()
    assert re.match(r'\s*Apache License\s+Version 2\.0, January 2004', text)
    assert 'TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION' in text
    assert 'END OF TERMS AND CONDITIONS' in text
    assert len(text.split()) > 1500               # the whole text, not a pointer to it


def test_citation_agrees_with_pyproject():
    import yaml
    cff = yaml.safe_load((ROOT / 'CITATION.cff').read_text())
    assert cff['cff-version'] == '1.2.0'
    assert {'cff-version', 'message', 'title', 'authors'} <= set(cff)
    assert cff['title'] == PYPROJECT['project']['name'] == 'd2ldist'
    assert PYPROJECT['project']['dynamic'] == ['version']      # d2ldist.__version__, once
    assert cff['version'] == importlib.import_module('d2ldist').__version__
    assert cff['license'] == PYPROJECT['project']['license']
    assert cff['authors'] == [{'name': 'The d2ldist authors'}]
    assert re.fullmatch(r'\d{4}-\d{2}-\d{2}', str(cff['date-released']))
    bib = sections(README)['Citing']
    assert f"version = {{{cff['version']}}}" in bib
    assert f"year    = {{{str(cff['date-released'])[:4]}}}" in bib
