"""What the wheel is made of (pyproject.toml) and d2l-book, which copies the chapters out.

tests/system/test_wheel.py builds and installs the wheel for real; these are the quick
checks: every package folder is listed, one version, torchvision an extra, the metadata,
type hints on the public API, its reference (pdoc), and the copy's refusals.
"""
import importlib
import inspect
import re
import sys
import tomllib
import types

import pytest
import yaml

import d2ldist
from d2ldist import book
from nbtools import load_book
from support import ROOT, load_script


def setuptools_config():
    with open(ROOT / 'pyproject.toml', 'rb') as f:
        pyproject = tomllib.load(f)
    return pyproject['project'], pyproject['tool']['setuptools']


def test_every_package_folder_is_in_the_wheel():
    _, tools = setuptools_config()
    folders = {'.'.join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / 'd2ldist').rglob('__init__.py')}
    mapped = tools['package-dir']
    assert set(tools['packages']) == folders | set(mapped)
    assert mapped == {'d2ldist.examples': 'examples', 'd2ldist.chapters': 'notebooks'}
    assert (ROOT / 'examples' / '__init__.py').is_file()


def test_one_version_written_once_and_every_place_that_names_it_agrees():
    project, tools = setuptools_config()
    assert 'version' not in project and project['dynamic'] == ['version']
    assert tools['dynamic'] == {'version': {'attr': 'd2ldist.__version__'}}
    version = d2ldist.__version__
    assert re.fullmatch(r'\d+\.\d+\.\d+', version)
    assert str(yaml.safe_load((ROOT / 'CITATION.cff').read_text())['version']) == version
    readme = (ROOT / 'README.md').read_text()
    named = re.findall(r'd2ldist-(\d[\w.]*)-py3-none-any\.whl', readme)  # Set-up's wheel
    named += re.findall(r'^ +version = \{([^}]+)\},$', readme, re.M)      # the BibTeX
    chapter = (ROOT / 'notebooks' / book.FIRST).read_text()
    named += re.findall(r'd2ldist==([\w.]+)', chapter)                     # the install cell
    assert len(named) == 3 and set(named) == {version}


def test_torchvision_is_an_extra_that_make_venv_installs():
    """pip must never replace a user's own (CUDA) torch to satisfy torchvision: only the
    CIFAR-10 loader needs it. make venv (and so CI) installs it, at the pinned version."""
    project, _ = setuptools_config()
    assert not any(d.startswith('torchvision') for d in project['dependencies'])
    assert project['optional-dependencies']['vision'] == ['torchvision>=0.16']
    makefile = (ROOT / 'Makefile').read_text()
    extras, = re.findall(r"pip install -q (?:--no-compile )?-c constraints.txt -e '\.\[([\w,]+)\]'", makefile)
    assert sorted(extras.split(',')) == sorted(project['optional-dependencies'])
    pins = dict(line.split('==') for line in (ROOT / 'constraints.txt').read_text().split('\n')
                if line and not line.startswith('#'))
    assert {'torch', 'torchvision', 'pdoc'} <= set(pins)


def test_cifar10_without_torchvision_names_the_extra_in_one_line(tmp_path, monkeypatch):
    from d2ldist.training import data
    monkeypatch.setitem(sys.modules, 'torchvision', None)        # as if not installed
    with pytest.raises(ImportError) as e:
        data.load_data_cifar10(2, tmp_path)
    assert "pip install 'd2ldist[vision]'" in str(e.value) and '\n' not in str(e.value)
    with pytest.raises(ImportError, match=re.escape("'d2ldist[vision]'")):
        data.load_data('cifar10', 2, tmp_path)
    example = (ROOT / 'examples' / 'multimachine_cifar10_train.py').read_text()
    assert 'FileNotFoundError, ImportError) as e:' in example        # printed as one line


def test_metadata_says_linux_python_3_10_and_up_and_the_authors():
    project, tools = setuptools_config()
    assert project['requires-python'] == '>=3.10'
    classifiers = project['classifiers']
    assert 'Operating System :: POSIX :: Linux' in classifiers
    versions = [c.rsplit(' ', 1)[1] for c in classifiers
                if re.fullmatch(r'Programming Language :: Python :: 3\.\d+', c)]
    assert versions[0] == '3.10' and versions == [f'3.{n}' for n in range(10, 10 + len(versions))]
    assert f'3.{sys.version_info.minor}' in versions                 # the one running this
    assert any(c.startswith('Topic :: ') for c in classifiers) and 'Typing :: Typed' in classifiers
    cff = yaml.safe_load((ROOT / 'CITATION.cff').read_text())
    assert project['authors'] == cff['authors']
    assert project['license'] == cff['license']    # (an SPDX expression: no license classifier)
    assert tools['package-data']['d2ldist'] == ['py.typed']
    assert (ROOT / 'd2ldist' / 'py.typed').is_file()


def test_set_up_says_linux_python_venv_and_the_packages_make_test_needs():
    readme = (ROOT / 'README.md').read_text()
    set_up = readme.split('\n## Set-up\n', 1)[1].split('\n## ', 1)[0]
    ci = (ROOT / '.ci' / 'run').read_text()
    line = re.search(r'apt-get install -y -qq --no-install-recommends \\\n(.*?)>/dev/null', ci,
                     re.S).group(1)
    packages = line.replace('\\', ' ').split()
    assert len(packages) >= 10
    prose = re.sub(r'^```.*?^```$', '', set_up, flags=re.S | re.M)     # (no code blocks)
    named = ' '.join(re.findall(r'`([^`]+)`', prose)).split()
    assert [p for p in packages if p not in named] == []
    for words in ('Linux', 'Python 3.10+', 'python3-venv'):
        assert words in set_up


# -- the public API: typed, and documented by pdoc -------------------------------------------
PUBLIC = ['d2ldist', 'd2ldist.horovod', 'd2ldist.kv']


def public_functions():
    """{qualified name: function} for each function of PUBLIC's ``__all__`` and each public
    method (and ``__init__``) of its classes, where d2ldist defines it."""
    def ours(f):
        return (getattr(f, '__module__', None) or '').startswith('d2ldist')

    found = {}
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType) or not callable(obj) or not ours(obj):
                continue
            if not inspect.isclass(obj):
                found[f'{obj.__module__}.{obj.__qualname__}'] = obj
                continue
            for attr, raw in inspect.getmembers_static(obj):
                f = raw.fget if isinstance(raw, property) else getattr(raw, '__func__', raw)
                if (attr == '__init__' or not attr.startswith('_')) and \
                        inspect.isfunction(f) and ours(f) and f.__name__ != '<lambda>':
                    found[f'{f.__module__}.{f.__qualname__}'] = f
    return found


def shown_by_a_chapter():
    """The functions a chapter shows as the library holds them (d2l's ``#@save`` cells,
    tests/unit/test_saved_code.py): untyped there as in d2l, and in the chapter's kernel
    an annotation would need imports the chapter does not make."""
    import nbformat
    names = set()
    for path in (ROOT / 'notebooks').glob('*.ipynb'):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == 'code' and cell.source.startswith('#@save'):
                names |= set(re.findall(r'^def (\w+)\(', cell.source, re.M))
    return names


def test_every_public_function_and_method_carries_type_hints():
    found = public_functions()
    assert 'd2ldist.collectives.api.allreduce' in found and len(found) > 150
    shown = shown_by_a_chapter()
    bare = []
    for qualname, f in sorted(found.items()):
        if f.__qualname__ in shown:
            continue
        sig = inspect.signature(f)
        params = [p for i, p in enumerate(sig.parameters.values())
                  if not (i == 0 and p.name in ('self', 'cls'))]
        missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
        if sig.return_annotation is inspect.Signature.empty:
            missing.append('return')
        if missing:
            bare.append(f'{qualname}: {", ".join(missing)}')
    assert bare == [], f'{len(bare)} public functions lack type hints:\n' + '\n'.join(bare)


def test_the_api_reference_builds_offline_and_names_every_public_name(tmp_path):
    pytest.importorskip('pdoc')
    pages = load_book().api_reference(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in pages} >= {
        'd2ldist.html', 'd2ldist/horovod.html', 'd2ldist/kv.html', 'index.html'}
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        page = (tmp_path / f'{module_name.replace(".", "/")}.html').read_text()
        assert f'<title>{module_name} API documentation</title>' in page
        absent = [n for n in module.__all__ if not isinstance(getattr(module, n), types.ModuleType)
                  and f'<section id="{n}">' not in page]
        assert absent == [], f'{module_name}: {absent}'
        assert not re.search(r'<(script|link|img)\b[^>]*\b(src|href)="(https?:)?//', page)
    page = (tmp_path / 'd2ldist.html').read_text()
    section = page[page.index('<section id="allreduce">'):]
    assert d2ldist.allreduce.__doc__.split('`')[0].strip() in section[:section.index('</section>')]


def test_the_commands_are_there():
    project, _ = setuptools_config()
    assert project['scripts'] == {'d2l-launch': 'd2ldist.launch.cli:main',
                                  'd2l-book': 'd2ldist.book:main'}


def test_chapters_and_figures_are_copied(tmp_path):
    assert book.chapters_folder() == ROOT / 'notebooks'         # a clone: notebooks/
    written = d2ldist.download_chapters(tmp_path / 'book')
    names = sorted(str(p.relative_to(tmp_path / 'book')) for p in written)
    chapters = sorted(p.name for p in (ROOT / 'notebooks').glob('*.ipynb'))
    figures = sorted(f'figures/{p.name}' for p in (ROOT / 'notebooks' / 'figures').glob('*.svg'))
    data = sorted(f'data/{p.name}' for p in (ROOT / 'notebooks' / 'data').glob('*.json'))
    pages = load_script('book/build.py', 'book_build').numbered()      # chapters, appendices
    assert names == sorted(chapters + figures + data)
    assert chapters == sorted(f'{name}.ipynb' for name, _ in pages)
    assert data == ['data/gpu_h200.json']                      # the scaling chapter reads it
    first = tmp_path / 'book' / book.FIRST
    assert first.read_bytes() == (ROOT / 'notebooks' / book.FIRST).read_bytes()


def shipped():
    """The notebooks, figures and data files of notebooks/ that d2l-book copies."""
    here = ROOT / 'notebooks'
    return (sorted(here.glob('*.ipynb')), sorted((here / 'figures').glob('*.svg')),
            sorted((here / 'data').glob('*.json')))


def test_nothing_is_overwritten_unless_asked(tmp_path):
    written = d2ldist.download_chapters(tmp_path)
    notebooks, figures, data = shipped()
    n, (first, second) = len(written), [p.name for p in notebooks[:2]]
    assert n == len(notebooks) + len(figures) + len(data)
    mine = tmp_path / 'scaling.ipynb'
    mine.write_text('my notes')
    with pytest.raises(FileExistsError, match=fr" already holds {n} of the chapters' {n} files "
                                              fr'\({first}, {second}, '
                                              r'...\): nothing copied; .* d2l-book --overwrite'):
        d2ldist.download_chapters(tmp_path)
    assert mine.read_text() == 'my notes'
    d2ldist.download_chapters(tmp_path, overwrite=True)
    assert mine.read_text() != 'my notes'


def test_the_command_says_what_it_did_or_why_not_in_one_line(tmp_path, capsys):
    notebooks, figures, data = shipped()
    assert book.main([str(tmp_path / 'b')]) == 0
    out = capsys.readouterr().out
    assert out == f'd2l-book: {len(notebooks)} chapters, {len(figures)} figures and ' \
                  f'{len(data)} data file in {tmp_path / "b"}; ' \
                  f'open them with:  jupyter lab {tmp_path / "b"}\n'
    assert book.main([str(tmp_path / 'b')]) == 1
    err = capsys.readouterr().err
    n = len(notebooks) + len(figures) + len(data)
    assert err.startswith(f'd2l-book: {tmp_path / "b"} already holds {n} of the chapters')
    assert err.count('\n') == 1
    (tmp_path / 'f').write_text('')
    assert book.main([str(tmp_path / 'f')]) == 1
    assert capsys.readouterr().err == f'd2l-book: {tmp_path / "f"} is a file, not a folder ' \
                                      'for the chapters\n'


def test_chapter_one_opens_with_colabs_install_cell_for_this_version():
    """Its first code cell, commented as d2l's are: a clone has the package already."""
    import nbformat
    nb = nbformat.read(ROOT / 'notebooks' / book.FIRST, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == 'code')
    assert first.source == f'# !pip install d2ldist=={d2ldist.__version__}'
    assert first.outputs == [] and first.execution_count == 1
    assert 'Colab' in nb.cells[nb.cells.index(first) - 1].source
