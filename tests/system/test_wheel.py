"""The package as a reader gets it: build the wheel, install it into a fresh venv, and use
it from a folder that is not the clone, with no PYTHONPATH. torchvision is not installed
(it is the extra d2ldist[vision]): CIFAR-10 says which extra in one line, the rest runs.

The venv is a real one (``python -m venv``, no system site-packages, nothing of the clone
on its path) and the wheel's dependencies are really installed, torch and CUDA's
libraries included (``-c constraints.txt``: the versions CI tests; this machine's pip
finds them on local disk). That is most of the test's time: 5.6 GB written and removed
again. On this 2-core machine beside a running test suite (load 7 to 12), two runs took
4.2 and 6.5 minutes: build 12-18 s, venv and install 84-211 s, the job 13-16 s, the
chapter 32-35 s, removing the venv about 110 s. ``--no-compile`` skips byte-compiling
all of torch's files: Python compiles the modules it imports, on first use.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from support import ROOT, kill_tagged, need, need_command, new_tag, wait_no_survivors

CHAPTER = 'multi_machine_training.ipynb'


def run(argv, log, timeout, **options):
    """Run argv to the end, its output into ``log``; fail with that output's end."""
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout, **options)
    log.write_text(r.stdout)
    assert r.returncode == 0, f'{" ".join(map(str, argv))} failed:\n{r.stdout[-3000:]}'
    return r.stdout


def tree_copy(dest):
    """The files a clone has (tracked, and new ones not ignored), copied to ``dest``:
    the wheel is built from them, and the build's files stay out of the working tree."""
    names = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others',
                            '--exclude-standard'], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split('\0')
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def chapter_cells(path):
    """The chapter's code cells from the first to the one after its first %launch (the
    imports, %load_ext, the %%writefile'd script, the job, the check of its results)."""
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == 'code']
    launch = next(i for i, c in enumerate(code) if '%launch' in c.source)
    return [c.source for c in code[:launch + 2]]


CIFAR10_WITHOUT_TORCHVISION = """
import importlib.metadata, importlib.resources, importlib.util
import d2ldist
print('torchvision', importlib.util.find_spec('torchvision'))
try:
    d2ldist.load_data_cifar10(2, 'data')
except ImportError as e:
    print(f'ImportError: {e}')
print('py.typed', importlib.resources.files('d2ldist').joinpath('py.typed').is_file())
print('vision', [r.split(';')[0].strip() for r in importlib.metadata.requires('d2ldist')
                 if 'extra == "vision"' in r])
"""

VENV_BYTES = 7 * 2**30      # torch and CUDA's libraries, with room to spare


@pytest.fixture
def venv(tmp_path):
    """A fresh venv, removed afterwards (it holds torch: gigabytes). In memory (/dev/shm)
    where there is room: writing and removing 5.6 GB on disk took most of the test's time."""
    shm = Path('/dev/shm')
    in_memory = shm.is_dir() and os.access(shm, os.W_OK) \
        and shutil.disk_usage(shm).free > 2 * VENV_BYTES
    parent = Path(tempfile.mkdtemp(prefix='d2ldist-wheel-', dir=shm)) if in_memory \
        else tmp_path
    yield parent / 'venv'
    start = time.monotonic()
    shutil.rmtree(parent / 'venv', ignore_errors=True)
    if in_memory:
        shutil.rmtree(parent, ignore_errors=True)
    print(f'test_wheel: the venv removed in {time.monotonic() - start:.0f} s')


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_wheel_installs_and_runs_a_job_and_a_chapter_outside_the_tree(tmp_path, venv,
                                                                          monkeypatch):
    need_command('git')
    need(_has_module('build'), "the 'build' package (pip install build)")
    need(_has_module('ensurepip'), "Python's ensurepip, for python -m venv (python3-venv)")
    need(_has_module('nbclient'), 'nbclient')
    from nbclient import NotebookClient
    tag, times, clock = new_tag(), {}, time.monotonic()

    def lap(name):
        nonlocal clock
        times[name], clock = time.monotonic() - clock, time.monotonic()

    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH' and not k.startswith('D2L_')}
    env['D2L_TEST_TAG'] = tag        # every process started below carries it

    # 1. the sdist and the wheel (built from the sdist), as `make wheel` makes them
    src = tree_copy(tmp_path / 'src')
    run([sys.executable, '-m', 'build', '--outdir', tmp_path / 'dist', src],
        tmp_path / 'build.log', timeout=300, env=env)
    wheel, = (tmp_path / 'dist').glob('d2ldist-*-py3-none-any.whl')
    assert len(list((tmp_path / 'dist').glob('d2ldist-*.tar.gz'))) == 1
    lap('build')

    # 2. a fresh venv with the wheel, and what a kernel needs to show the dashboard and
    #    the figure (the [notebooks] extra adds JupyterLab, a front end: not needed here)
    run([sys.executable, '-m', 'venv', venv], tmp_path / 'venv.log', timeout=120, env=env)
    assert 'include-system-site-packages = false' in (venv / 'pyvenv.cfg').read_text()
    python, bin_ = venv / 'bin' / 'python', venv / 'bin'
    run([python, '-m', 'pip', 'install', '--no-compile', '-c', ROOT / 'constraints.txt',
         wheel, 'ipykernel', 'ipywidgets>=8', 'matplotlib>=3.7'],
        tmp_path / 'pip.log', timeout=600, env=env)
    lap('install')

    work = tmp_path / 'work'                  # the reader's folder: not the clone
    work.mkdir()
    try:
        where = run([python, '-c', 'import d2ldist; print(d2ldist.__file__)'],
                    tmp_path / 'where.log', timeout=60, cwd=work, env=env)
        assert where.startswith(str(venv / 'lib')), where

        # torchvision is the extra d2ldist[vision]: not installed here, and CIFAR-10 says so
        # in one line; the metadata and py.typed as a type checker finds them
        cifar = subprocess.run([python, '-c', CIFAR10_WITHOUT_TORCHVISION], capture_output=True,
                               text=True, cwd=work, env=env, timeout=120)
        assert cifar.returncode == 0, cifar.stderr[-2000:]
        assert cifar.stdout.splitlines() == [
            'torchvision None', "ImportError: CIFAR-10 is read through torchvision, which is "
            "not installed: pip install 'd2ldist[vision]'", 'py.typed True',
            "vision ['torchvision>=0.16']"]

        # 3. the commands: d2l-book, the examples' list, a 2-worker job with d2l-launch
        out = run([bin_ / 'd2l-book', 'book'], tmp_path / 'book.log', timeout=60,
                  cwd=work, env=env)
        shipped = [len(list(ROOT.glob(f'notebooks/{pattern}')))
                   for pattern in ('*.ipynb', 'figures/*.svg', 'data/*.json')]
        assert out == f'd2l-book: {shipped[0]} chapters, {shipped[1]} figures and ' \
                      f'{shipped[2]} data file in book; open them with:  jupyter lab book\n'
        again = subprocess.run([bin_ / 'd2l-book', 'book'], capture_output=True, text=True,
                               cwd=work, env=env, timeout=60)
        assert again.returncode == 1 and again.stderr.count('\n') == 1
        assert 'nothing copied' in again.stderr
        listed = run([python, '-m', 'd2ldist.examples'], tmp_path / 'examples.log',
                     timeout=60, cwd=work, env=env)
        assert [line.split()[0] for line in listed.splitlines()[:6]] == [
            'hello_roles', 'horovod_digits', 'horovod_elastic_digits', 'horovod_mlp',
            'kvstore_linreg', 'multimachine_cifar10_train']
        log = run([bin_ / 'd2l-launch', '-n', '2', '-s', '1', 'python', '-m',
                   'd2ldist.examples.hello_roles'], tmp_path / 'job.log', timeout=180,
                  cwd=work, env=env)
        for rank in (0, 1):
            assert f'[worker {rank}] worker {rank} passed the barrier' in log
        assert '[worker 0] worker 0 got "hello from worker 1"' in log
        lap('job')

        # 4. the chapter's %%writefile and %launch cells, in a kernel of the venv,
        #    in the folder d2l-book made
        kernels = tmp_path / 'jupyter' / 'kernels' / 'wheel'
        kernels.mkdir(parents=True)
        (kernels / 'kernel.json').write_text(json.dumps({
            'argv': [str(python), '-m', 'ipykernel_launcher', '-f', '{connection_file}'],
            'display_name': 'the wheel', 'language': 'python'}))
        monkeypatch.setenv('JUPYTER_PATH', str(tmp_path / 'jupyter'))
        book = work / 'book'
        cells = chapter_cells(book / CHAPTER)
        assert cells[0].startswith('# !pip install d2ldist==')
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(s) for s in cells + [
            'import sys\nfrom d2ldist.notebook.magic import widgets_possible\n'
            'print(sys.prefix)\nprint(d2ldist.__file__)\n'
            'print(type(_launch).__name__, widgets_possible(get_ipython()))']]
        client = NotebookClient(nb, timeout=300, kernel_name='wheel',
                                resources={'metadata': {'path': str(book)}})
        try:
            client.execute(env=env)
        finally:
            nbformat.write(nb, tmp_path / 'executed.ipynb')     # to look at if it failed
        lap('chapter')
        launch = next(c for c in nb.cells if '%launch' in c.source)
        shown = [o.data for o in launch.outputs if o.output_type == 'display_data']
        assert shown[0]['text/plain'] == \
            '%launch -n 2 -s 1 seven_steps.py: scheduler, 1 server, 2 workers'
        assert shown[1]['text/plain'].startswith('job finished after ')
        checked = nb.cells[nb.cells.index(launch) + 1].outputs[0].text
        assert checked.count(': True\n') == 3, checked
        prefix, module, kinds = nb.cells[-1].outputs[0].text.splitlines()
        assert Path(prefix) == venv and module.startswith(str(venv / 'lib'))
        assert kinds == 'LaunchResult True'                     # the dashboard's kernel
        assert (book / 'seven_steps.py').is_file()             # written beside the chapter
    finally:
        survivors = wait_no_survivors(tag, timeout=20)
        kill_tagged(tag)
        print('test_wheel seconds: ' + ', '.join(f'{k} {v:.0f}' for k, v in times.items()))
    assert survivors == []


def _has_module(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None
