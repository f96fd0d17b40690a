"""The folder layout is the map of the layers (ARCHITECTURE.md): check that it stays true.

Each folder of d2ldist is one layer; a module imports only from its own folder or from
layers below it, and nothing inside the package imports ``d2ldist/__init__.py`` (the
package's face, which gathers the public names). The D2L_* variables are read in one
place, ``d2ldist/config.py`` (the bottom layer): no other module spells their names. The
public names the README and the chapters use are listed here and imported one by one.
"""
import ast
import importlib
import re
import subprocess
import sys

import pytest

from support import ROOT

# bottom up; a layer may import the layers of a lower number only
LAYERS = {'lines': -3, 'config': -2, 'report': -1, 'runtime': 0, 'kv': 1, 'collectives': 1, 'training': 2,
          'cost': 2, 'launch': 3, 'notebook': 4, 'horovod': 5, 'timeline': 5, '__init__': 5,
          'testing': 6}


def layer_of(module):
    """'d2ldist.kv.worker' -> 'kv' (a module's folder, or its own name at the top)."""
    parts = module.split('.')
    return parts[1] if len(parts) > 1 else '__init__'


def imports_of(path, root=ROOT):
    """The d2ldist modules a file imports, as (line, absolute name, names taken from it)."""
    module = '.'.join(path.relative_to(root).with_suffix('').parts)
    package = module if path.name == '__init__.py' else module.rsplit('.', 1)[0]
    if package.endswith('.__init__'):
        package = package[:-len('.__init__')]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split('.')[0] == 'd2ldist':
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split('.')[:len(package.split('.')) - node.level + 1]
                name = '.'.join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ''
            if name.split('.')[0] == 'd2ldist':
                yield node.lineno, name, [a.name for a in node.names]


def is_module(name, root=ROOT):
    """Whether d2ldist.X names a module or package (not a name defined in __init__)."""
    path = root.joinpath(*name.split('.'))
    return path.with_suffix('.py').is_file() or (path / '__init__.py').is_file()


def violations(root=ROOT):
    """Every import that points up a layer or at the face, as 'file:line: why'."""
    found = []
    for path in sorted((root / 'd2ldist').rglob('*.py')):
        source = '.'.join(path.relative_to(root).with_suffix('').parts)
        if source == 'd2ldist.__init__':
            continue                                 # the face may import anything
        mine = layer_of(source)
        for line, target, names in imports_of(path, root):
            where = f'{path.relative_to(root)}:{line}'
            if target == 'd2ldist':                  # from d2ldist import X / from .. import X
                faces = [n for n in names if not is_module(f'd2ldist.{n}', root)]
                if faces or not names:
                    found.append(f'{where} imports the face d2ldist/__init__.py ({faces})')
                targets = [f'd2ldist.{n}' for n in names if n not in faces]
            else:
                targets = [target]
            for t in targets:
                theirs = layer_of(t)
                if theirs != mine and LAYERS[theirs] >= LAYERS[mine] \
                        and mine not in ('horovod',):
                    found.append(f'{where}: {mine} imports {t} ({theirs}), '
                                 'which is not a lower layer')
    return found


def test_imports_point_only_down_and_never_to_the_face():
    assert violations() == []


def test_the_check_sees_an_upward_import_and_the_face(tmp_path):
    """The check itself: an import from a higher layer, and one of the face, are found."""
    fake = tmp_path / 'd2ldist' / 'runtime'
    fake.mkdir(parents=True)
    (fake / 'bad.py').write_text('from ..training import trainer\nfrom .. import init\n')
    (fake / 'good.py').write_text('from . import bad\nfrom .bad import trainer\n')
    assert [n for _, n, _ in imports_of(fake / 'bad.py', tmp_path)] == \
        ['d2ldist.training', 'd2ldist']
    found = violations(tmp_path)
    assert len(found) == 2 and 'not a lower layer' in found[0] and 'face' in found[1]


def module_name(path, root=ROOT):
    """'d2ldist/kv/worker.py' -> 'd2ldist.kv.worker' (a package: its own name)."""
    name = '.'.join(path.relative_to(root).with_suffix('').parts)
    return name[:-len('.__init__')] if name.endswith('.__init__') else name


def private_reach_ins(root=ROOT):
    """Every use of another module's private name: ``from .x import _y`` or ``x._y``."""
    found = []
    for path in sorted((root / 'd2ldist').rglob('*.py')):
        modules = {}                                   # local name -> d2ldist module
        for line, target, names in imports_of(path, root):
            for n in names:
                if is_module(f'{target}.{n}', root):
                    modules[n] = f'{target}.{n}'
                elif n.startswith('_') and not n.startswith('__'):
                    found.append(f'{path.relative_to(root)}:{line} imports {target}.{n}')
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in modules and node.attr.startswith('_') \
                    and not node.attr.startswith('__'):
                found.append(f'{path.relative_to(root)}:{node.lineno} uses '
                             f'{modules[node.value.id]}.{node.attr}')
    return found


def import_circles(root=ROOT):
    """Pairs of modules that import each other, at the top or inside a function."""
    graph = {}
    for path in sorted((root / 'd2ldist').rglob('*.py')):
        targets = set()
        for _, target, names in imports_of(path, root):
            inner = [f'{target}.{n}' for n in names if is_module(f'{target}.{n}', root)]
            targets.update(inner or [target])
        graph[module_name(path, root)] = targets
    return sorted({tuple(sorted((a, b))) for a in graph for b in graph[a]
                   if a != b and a in graph.get(b, ()) and 'd2ldist' not in (a, b)})


def test_no_circles_and_no_private_reach_ins():
    assert import_circles() == [] and private_reach_ins() == []


def test_the_check_sees_a_circle_and_a_reach_in(tmp_path):
    """The check itself, on a fake package: a circle made of a function-level import,
    and another module's private name, imported and used."""
    fake = tmp_path / 'd2ldist' / 'collectives'
    fake.mkdir(parents=True)
    (fake / '__init__.py').write_text('')
    (fake / 'api.py').write_text('from . import world\nfrom .world import _engine\n')
    (fake / 'world.py').write_text('def f():\n    from . import api\n    return api._run\n')
    assert import_circles(tmp_path) == [('d2ldist.collectives.api', 'd2ldist.collectives.world')]
    assert [f.split(' ', 1)[1] for f in private_reach_ins(tmp_path)] == [
        'imports d2ldist.collectives.world._engine', 'uses d2ldist.collectives.api._run']


def variable_uses(root=ROOT):
    """Every D2L_* name a module other than config.py uses as a key, as 'file:line: NAME':
    read (os.environ[...], .get(...), os.getenv(...), ... in os.environ, from any mapping)
    or written (a subscript, a dict's key, a keyword). Only config.py spells them."""
    found = []
    for path in sorted((root / 'd2ldist').rglob('*.py')):
        if path == root / 'd2ldist' / 'config.py':
            continue
        uses = sorted((node.lineno, name) for node in ast.walk(ast.parse(path.read_text()))
                      for name in map(_variable_name, _keys(node)) if name)
        found += [f'{path.relative_to(root)}:{line}: {name}' for line, name in uses]
    return found


def _keys(node):
    """What a node uses as a key: a subscript's, the first argument of get, pop,
    setdefault and getenv, the left of ``in``, a dict's keys, keyword names."""
    if isinstance(node, ast.Subscript):
        yield node.slice
    elif isinstance(node, ast.Call):
        name = getattr(node.func, 'attr', getattr(node.func, 'id', None))
        if name in ('get', 'pop', 'setdefault', 'getenv') and node.args:
            yield node.args[0]
        yield from (ast.Constant(k.arg) for k in node.keywords if k.arg)
    elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
        yield node.left
    elif isinstance(node, ast.Dict):
        yield from (k for k in node.keys if k is not None)


def _variable_name(expr):
    """'D2L_X' for the string 'D2L_X', or an f-string that begins with 'D2L_'; else None."""
    if isinstance(expr, ast.JoinedStr) and expr.values:
        expr = expr.values[0]
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str) \
            and expr.value.startswith('D2L_'):
        return expr.value
    return None


def test_only_the_config_reads_d2l_variables():
    assert variable_uses() == []


def test_the_check_sees_every_way_of_reading_a_variable(tmp_path):
    """The check itself: reads of os.environ in each form, an alias, an f-string, a
    write, are found; config.py itself, and a name in a message, are not."""
    package = tmp_path / 'd2ldist'
    (package / 'runtime').mkdir(parents=True)
    (package / 'config.py').write_text("import os\nx = os.environ.get('D2L_ROLE')\n")
    (package / 'runtime' / 'bad.py').write_text(
        "import os\n"
        "a = os.environ['D2L_RANK']\n"
        "b = os.environ.get('D2L_SHM', '1')\n"
        "c = os.getenv(f'D2L_{a}')\n"
        "d = 'D2L_ROLE' in os.environ\n"
        "def f(env=os.environ):\n"
        "    return env.get('D2L_HANG_WARN')\n"
        "os.environ['D2L_SLOW'] = '3x'\n"
        "e = dict(D2L_FAIL='step=1')\n"
        "print('set D2L_JOB_SECRET')\n")
    found = variable_uses(tmp_path)
    assert [line.split(': ')[1] for line in found] == [
        'D2L_RANK', 'D2L_SHM', 'D2L_', 'D2L_ROLE', 'D2L_HANG_WARN', 'D2L_SLOW', 'D2L_FAIL'], found
    assert all(line.startswith('d2ldist/runtime/bad.py:') for line in found)


# Horovod's names beyond the first set (issue 20), on both faces
HOROVOD_MORE = [
    'allreduce_async', 'allgather_async', 'broadcast_async', 'poll', 'synchronize',
    'grouped_allreduce', 'grouped_allreduce_', 'grouped_allreduce_async',
    'grouped_allreduce_async_', 'broadcast_object', 'allgather_object', 'is_initialized',
    'shutdown', 'nccl_built', 'gloo_built', 'mpi_built', 'mpi_enabled', 'cross_rank',
    'cross_size', 'reducescatter', 'alltoall', 'SyncBatchNorm', 'Compression', 'join',
    'ccl_built', 'cuda_built', 'ddl_built', 'grouped_allgather', 'grouped_allgather_async',
    'sparse_allreduce_async']

# Every name the README, the chapters and the examples use.
PUBLIC = {
    'd2ldist': [
        'init', 'rank', 'size', 'local_rank', 'local_size', 'barrier', 'report', 'Node',
        'PeerFailed', 'kv', 'horovod', 'allreduce', 'allreduce_', 'allreduce_async_',
        'broadcast', 'broadcast_', 'broadcast_async_', 'allgather', 'Handle', 'Sum',
        'Average', 'Min', 'Max', 'broadcast_parameters', 'broadcast_optimizer_state',
        'DistributedOptimizer', 'metric_average', 'SplitSampler', 'load_data',
        'load_data_cifar10', 'load_data_digits', 'resnet18', 'cpu', 'try_gpu',
        'try_all_gpus', 'split_and_load', 'parse_devices', 'AllreduceStore',
        'create_store', 'Trainer', 'train_batch', 'evaluate_accuracy', 'train',
        'load_ipython_extension', 'Product', 'timeline', 'cost', 'ShardedOptimizer',
        'shard_module'] + HOROVOD_MORE,
    'd2ldist.cost': ['ps_time', 'ps_time_placed', 'ring_time', 'hierarchical_time',
                     'server_loads', 'numel'],
    'd2ldist.timeline': ['load', 'plot', 'breakdown', 'last_steps'],
    'd2ldist.runtime.compression': ['create'],
    'd2ldist.runtime.hang': ['Hang', 'Disagree'],
    'd2ldist.kv': ['create', 'place', 'KVError', 'KVStore'],
    'd2ldist.horovod': [
        'init', 'rank', 'size', 'local_rank', 'local_size', 'barrier', 'allreduce',
        'allreduce_', 'allreduce_async_', 'broadcast', 'broadcast_', 'allgather', 'Sum',
        'Average', 'Min', 'Max', 'broadcast_parameters', 'broadcast_optimizer_state',
        'DistributedOptimizer', 'metric_average', 'Product'] + HOROVOD_MORE,
    'd2ldist.training.trainer': ['STEPS', 'Step'],
    'd2ldist.training.stores': ['create_store'],
    'd2ldist.runtime.van': ['Van'],
    'd2ldist.runtime': ['pacing', 'shm', 'node', 'spans'],
    'd2ldist.runtime.node': ['current'],
    'd2ldist.runtime.spans': ['span', 'step_done'],
    'd2ldist.collectives.sharded': ['paper_memory', 'memory_by_kind', 'MemoryPeak'],
    'd2ldist.collectives.sharded_module': ['full_weights', 'units_of'],
    'd2ldist.kv.placement': ['place', 'bigarray_bound'],
}


@pytest.mark.parametrize('module,name', [(m, n) for m, names in PUBLIC.items()
                                         for n in names])
def test_public_names_import(module, name):
    assert getattr(importlib.import_module(module), name) is not None


# What ``python -m MODULE --help`` answers outside a job: (exit code, stream, first line).
# The launcher prints its usage; the processes it starts have no options of their own and
# refuse in one line, saying what is missing (the guard runs any command, even '--help').
HELP_ANSWERS = {
    'd2ldist.launch': (0, 'stdout', 'usage: d2l-launch [-h] [-n NUM_WORKERS] [-s NUM_SERVERS]'),
    'd2ldist.kv': (1, 'stderr', 'd2ldist.server: D2L_SCHEDULER_URI is not set: '
                                'start the job with d2l-launch'),
    'd2ldist.runtime.scheduler': (1, 'stderr', 'd2ldist.scheduler: D2L_NUM_WORKER is not set '
                                               '(start jobs with d2l-launch)'),
    'd2ldist.launch.step': (1, 'stderr', 'd2ldist.task: runs one task of d2l-launch '
                                         '--launcher slurm or mpi (--task WORD [--label]); '
                                         'start jobs with d2l-launch'),
    'd2ldist.launch.guard': (127, 'stderr', "d2l-launch: cannot start '--help': "
                                            'No such file or directory'),
}


@pytest.mark.parametrize('module', HELP_ANSWERS)
def test_modules_the_launcher_runs_answer(module):
    """``python -m`` of each process kind starts and answers --help as HELP_ANSWERS says."""
    r = subprocess.run([sys.executable, '-m', module, '--help'], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, env={'PATH': '/usr/bin:/bin'})
    code, stream, first = HELP_ANSWERS[module]
    out, other = (r.stdout, r.stderr) if stream == 'stdout' else (r.stderr, r.stdout)
    assert (r.returncode, other, out.splitlines()[:1]) == (code, '', [first]), r
    if code:
        assert out == first + '\n'                   # one line, no traceback
    else:
        assert '-n NUM_WORKERS, --num-workers NUM_WORKERS' in out
        assert '--launcher {local,ssh,slurm,mpi}' in out and 'positional arguments:' in out


@pytest.mark.parametrize('face', ['d2ldist', 'd2ldist.horovod'])
def test_horovod_names_not_in_d2ldist_say_so(face):
    """hvd.Adasum, hvd.elastic, ...: one line saying it is not in d2ldist, and why; and
    hasattr() answers False, as users' feature detection expects."""
    from d2ldist.collectives.missing import NOT_YET
    module = importlib.import_module(face)
    for name in NOT_YET:
        for caught in (AttributeError, NotImplementedError):   # (old code catches the 2nd)
            with pytest.raises(caught, match=f'hvd.{name}: not in d2ldist: ') as e:
                getattr(module, name)
            assert '\n' not in str(e.value)
        assert not hasattr(module, name) and getattr(module, name, None) is None
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        getattr(module, 'no_such_name')
    assert module.Compression.none.name == 'none' and module.Compression.fp16.name == 'fp16'


# -- ARCHITECTURE.md: the map names every module, every place of state, every collective ---
ARCHITECTURE = (ROOT / 'ARCHITECTURE.md').read_text()


def architecture_tree(text=ARCHITECTURE):
    """The page's map of the folders: the first fenced block."""
    return re.search(r'^```\n(.*?)^```', text, re.S | re.M).group(1)


def test_architecture_names_every_module():
    tree = architecture_tree()
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / 'd2ldist').rglob('*.py'))
               if p.name != '__init__.py' and not re.search(rf'(?<!\w){re.escape(p.name)}', tree)]
    assert missing == [], f'modules ARCHITECTURE.md does not name: {missing}'


def rebound_globals(root=ROOT):
    """Every module-level name a function of d2ldist rebinds (``global x``)."""
    names = set()
    for path in (root / 'd2ldist').rglob('*.py'):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                names.update(node.names)
    return names


def test_architecture_names_every_place_of_state():
    """The state a module keeps, job's or process's, is in the page's paragraph on it."""
    state = ARCHITECTURE[ARCHITECTURE.index('A process learns its part'):
                         ARCHITECTURE.index('## Read this first')]
    assert sorted(n for n in rebound_globals() if f'`{n}`' not in state) == []


def test_architecture_shows_every_method_of_a_backend():
    from d2ldist.collectives.backend import Backend
    block = re.search(r'^class Backend\(Protocol\):.*?^```', ARCHITECTURE, re.S | re.M).group(0)
    shown = set(re.findall(r'def (\w+)\(', block))
    assert shown == {n for n, v in vars(Backend).items()
                     if callable(v) and not n.startswith('_')}
