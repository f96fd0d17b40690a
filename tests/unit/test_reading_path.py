"""The reading path (book/reading_path.py) stays true: every function it names exists, each
path stays within its bound, no step of the plain path is left out of it, and
ARCHITECTURE.md shows exactly what the script prints."""
import ast
import re

import pytest

from support import ROOT, load_script

reading_path = load_script('book/reading_path.py', 'reading_path')


@pytest.mark.parametrize('title', list(reading_path.PATHS))
def test_each_path_stays_within_its_bound(title):
    _, total = reading_path.table(title, reading_path.PATHS[title])
    assert 0 < total <= reading_path.BOUNDS[title]


def test_architecture_shows_what_the_script_prints():
    page = (ROOT / 'ARCHITECTURE.md').read_text()
    shown = re.search(r'^## Read this first\n.*?^```text\n(.*?)^```', page, re.S | re.M)
    assert shown, 'ARCHITECTURE.md has no "Read this first" printout'
    assert shown.group(1).rstrip('\n') == reading_path.report()


def own_calls(file, name):
    """The methods of its own class that a method calls as ``self.x(...)``."""
    cls, _, method = name.rpartition('.')
    tree = ast.parse((ROOT / file).read_text())
    for c in ast.walk(tree):
        if isinstance(c, ast.ClassDef) and c.name == cls:
            methods = {f.name: f for f in c.body if isinstance(f, ast.FunctionDef)}
            return {n.func.attr for n in ast.walk(methods[method])
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == 'self'
                    and n.func.attr in methods}
    return set()


@pytest.mark.parametrize('title', list(reading_path.PATHS))
def test_no_method_the_path_calls_on_itself_is_left_out(title):
    """A method on the path that calls another of its class's methods: that one is on the
    path too, or named in ASIDE (what a first reading may skip, and why)."""
    steps = reading_path.PATHS[title]
    named = {(file, name) for file, names in steps for name in names}
    for file, name in sorted(named):
        cls = name.rpartition('.')[0]
        for callee in own_calls(file, name):
            full = f'{cls}.{callee}'
            assert (file, full) in named or full in reading_path.ASIDE, \
                f'{title}: {name} calls {full}, which is neither on the path nor in ASIDE'


def test_the_check_sees_a_name_that_is_not_there():
    with pytest.raises(KeyError, match='no function'):
        reading_path.rows([('d2ldist/collectives/ring.py', ['Ring.no_such_method'])])
