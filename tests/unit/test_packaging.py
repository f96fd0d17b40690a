"""What the wheel is made of (pyproject.toml) and d2l-book, which copies the chapters out.

tests/system/test_wheel.py builds and installs the wheel for real; these are the quick
checks: every package folder is listed, one version, and the copy's refusals.
"""
import tomllib

import pytest

import d2ldist
from d2ldist import book
from support import ROOT


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


def test_one_version():
    project, _ = setuptools_config()
    assert project['version'] == d2ldist.__version__


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
    assert names == sorted(chapters + figures + data) and len(chapters) == 12
    assert data == ['data/gpu_h200.json']                      # the scaling chapter reads it
    first = tmp_path / 'book' / book.FIRST
    assert first.read_bytes() == (ROOT / 'notebooks' / book.FIRST).read_bytes()


def test_nothing_is_overwritten_unless_asked(tmp_path):
    d2ldist.download_chapters(tmp_path)
    mine = tmp_path / 'scaling.ipynb'
    mine.write_text('my notes')
    with pytest.raises(FileExistsError, match=r" already holds 18 of the chapters' 18 files "
                                              r'\(answers.ipynb, communication_efficiency.ipynb, '
                                              r'...\): nothing copied; .* d2l-book --overwrite'):
        d2ldist.download_chapters(tmp_path)
    assert mine.read_text() == 'my notes'
    d2ldist.download_chapters(tmp_path, overwrite=True)
    assert mine.read_text() != 'my notes'


def test_the_command_says_what_it_did_or_why_not_in_one_line(tmp_path, capsys):
    assert book.main([str(tmp_path / 'b')]) == 0
    out = capsys.readouterr().out
    assert out == f'd2l-book: 12 chapters, 5 figures and 1 data file in {tmp_path / "b"}; ' \
                  f'open them with:  jupyter lab {tmp_path / "b"}\n'
    assert book.main([str(tmp_path / 'b')]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f'd2l-book: {tmp_path / "b"} already holds 18 of the chapters')
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
