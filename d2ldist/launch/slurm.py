"""The Slurm launcher: a job's processes as one ``srun`` step inside an allocation.

``d2l-launch --launcher slurm -n 2 -s 2 python train.py``, run where ``salloc`` or
``sbatch`` put you (``SLURM_JOB_ID`` set), does what the local launcher does, on the
allocation's nodes: one ``srun --multi-prog`` step of one task per process
(``step.py``: ``RANK python -m d2ldist.launch.step --task WORD``), placed with
``--distribution=arbitrary``; output labelled by srun and shown as ``[worker 1@node2]``;
the task side's ``d2ldist.task: exit N`` (hidden) names a process that fails. The
step ends on a failure (``--kill-on-bad-exit``) or is cancelled (``scancel``); srun
runs under the guard. From a login node, ``--partition P`` (``--nodes K``, ``--time``,
``--account``, ``--gres``, ``--salloc-args``) first asks ``salloc`` for an allocation,
and gives it back when the job ends. Inside an allocation of several nodes the launcher
is ``slurm`` unless told, ``-n`` is its task count, and d2l-launch refuses to be one of
many srun tasks (``inside``).

The steps one by one: docs/design/launch.md, "Under Slurm".
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from .. import config
from ..lines import clip
from ..runtime.started import expand_nodelist, tasks_per_node
from .processes import free_port, guarded, job_specs, share_cores
from .step import CANCELLED, StepJob, task_argv

LABEL = re.compile(r'\s*(\d+): (.*)')                  # srun --label's 'N: text'
STEP = re.compile(r'd2ldist\.task: step (\d+\.\d+)')
# srun's word on tasks that ended badly: how a task that could not say it ended
TASKS_ENDED = re.compile(r'srun: error: \S+: tasks? ([\d,-]+): (?:Exited with exit code (\d+)|'
                         r'(Killed|Terminated))')
# srun's and slurmstepd's words on tasks that ended: the launcher names the failure itself
STEP_NOISE = re.compile(r'(srun: (error: \S+: tasks? [\d,-]+: |launch/slurm: _step_signal|'
                        r'Force Terminated|Job step aborted|got SIGCONT|forcing job)|'
                        r'slurmstepd(-\S+)?: error: \*\*\* STEP )')
# The allocation's task layout, which srun would take as options of the step (sbatch
# --ntasks-per-node=2 sets SLURM_NTASKS_PER_NODE=2), and warn that 7 tasks do not fit
ALLOCATION_LAYOUT = ('SLURM_NTASKS_PER_NODE', 'SLURM_NTASKS_PER_SOCKET',
                     'SLURM_NTASKS_PER_CORE')


class SlurmError(Exception):
    """Not in an allocation, or the allocation cannot be used: one line, exit code 2."""


# -- 1. the allocation ---------------------------------------------------------------
def allocation(environ=os.environ):
    """(job id, nodes, workers per node, CPUs per node) of the allocation we are in."""
    job = environ.get('SLURM_JOB_ID')
    if not job:
        raise SlurmError('--launcher slurm runs inside a Slurm allocation (SLURM_JOB_ID is '
                         'not set): salloc -N 2 d2l-launch --launcher slurm ..., '
                         'd2l-launch in an sbatch script, or --partition P to ask for one')
    if shutil.which('srun') is None:
        raise SlurmError(f'--launcher slurm: in allocation {job}, but srun is not on PATH')
    try:
        nodes = expand_nodelist(environ.get('SLURM_JOB_NODELIST', ''))
        tasks = tasks_per_node(environ.get('SLURM_TASKS_PER_NODE') or f'1(x{len(nodes)})')
        cpus = tasks_per_node(environ.get('SLURM_JOB_CPUS_PER_NODE') or f'1(x{len(nodes)})')
    except ValueError as e:
        raise SlurmError(f'--launcher slurm: {e}') from None
    if not len(nodes) == len(tasks) == len(cpus):
        raise SlurmError(f'--launcher slurm: {len(nodes)} nodes in SLURM_JOB_NODELIST but '
                         f'tasks or CPUs for {len(tasks)} in SLURM_TASKS_PER_NODE')
    return job, nodes, tasks, cpus


def inside(environ=os.environ):
    """What the allocation we run in says of the job: (launcher, its task count, the
    line that says so), or (None, None, None) outside one; SlurmError under an srun of
    several tasks, which would start as many whole jobs."""
    job = environ.get('SLURM_JOB_ID')
    if not job:
        return None, None, None
    tasks = environ.get('SLURM_STEP_NUM_TASKS') or environ.get('SLURM_NTASKS') or '1'
    if environ.get('SLURM_STEP_ID') and _number(tasks) > 1:
        raise SlurmError(f'd2l-launch runs as one of {tasks} srun tasks, which would start '
                         f'{tasks} whole jobs: run it once, in the allocation (d2l-launch '
                         '--launcher slurm ..., which starts its own srun step), or '
                         'srun -n1 d2l-launch ...')
    nodes = _number(environ.get('SLURM_JOB_NUM_NODES') or environ.get('SLURM_NNODES'))
    return ('slurm' if nodes > 1 else 'local', _number(environ.get('SLURM_NTASKS')) or None,
            f'd2l-launch: inside Slurm allocation {job} of {nodes or 1} '
            f'node{"s" * (nodes > 1)}')


def _number(text):
    """A count Slurm wrote ('4'), else 0."""
    return int(text) if text and text.isdigit() else 0


def check(partition=None, environ=os.environ):
    """Raise SlurmError unless a job can start: inside an allocation, or with
    ``--partition`` outside one (then salloc must be there to ask)."""
    job = environ.get('SLURM_JOB_ID')
    if partition and job:
        raise SlurmError(f'--partition {partition}: already inside allocation {job}, which '
                         'the job uses as it is; leave out --partition')
    if not partition:
        allocation(environ)
    elif shutil.which('salloc') is None or shutil.which('srun') is None:
        raise SlurmError(f'--partition {partition}: salloc and srun must be on PATH')


# -- 1b. an allocation of our own (--partition, from a login node) ---------------------
# salloc's command: print the allocation's variables, then wait for a signal (the job's end)
# (it ends with salloc, whatever ended salloc: a parent-death signal)
HOLD = ("import ctypes, json, os, signal; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
        "print('d2ldist.slurm: allocation ' + json.dumps({k: v for k, v in os.environ.items() "
        "if k.startswith('SLURM_')}), flush=True); signal.pause()")
GRANTED = re.compile(r'd2ldist\.slurm: allocation (\{.*\})')


class Holder:
    """salloc holding an allocation while the job runs. Its command prints the
    allocation's SLURM_* variables, then waits; when the job ends, or the launcher
    dies, the guard ends salloc, and Slurm takes the allocation back."""

    def __init__(self, salloc):
        self.argv = [*salloc, sys.executable, '-c', HOLD]
        self.popen = None

    def start(self):
        """Ask, and wait until Slurm grants it; the allocation's variables."""
        self.popen = subprocess.Popen(guarded(self.argv), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
        said = []
        for line in self.popen.stdout:
            if m := GRANTED.match(line.strip()):
                return json.loads(m[1])
            said.append(line.strip())
        self.release()
        raise SlurmError(clip(f'salloc gave no allocation: {said[-1] if said else "no word"}', 300))

    def release(self):
        """End salloc (through its guard): the allocation goes back."""
        if self.popen is None:
            return
        try:
            self.popen.stdin.close()
            self.popen.wait(timeout=config.get().kill_grace + 30)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        self.popen = None


def salloc_argv(args):
    """salloc's command line for ``--partition`` and the options that go with it."""
    more = [f'--{name}={value}' for name in ('time', 'account', 'gres')
            if (value := getattr(args, name)) is not None]
    return ['salloc', f'--partition={args.partition}',
            f'--ntasks={max(args.num_workers, args.nodes or 1)}',
            *([f'--nodes={args.nodes}'] if args.nodes else []), *more, *args.salloc_args,
            '--quiet']


def addresses(nodes):
    """{node: its IPv4 address, as its name resolves here}; SlurmError naming a node."""
    found = {}
    for node in nodes:
        try:
            found[node] = socket.gethostbyname(node)
        except OSError as e:
            raise SlurmError(f'--launcher slurm: cannot resolve node {node}: {e}') from None
    return found


# -- 2. and 3. the step ----------------------------------------------------------------
def multi_prog(specs, shared, python=sys.executable):
    """The text of srun's --multi-prog file: task N runs process N of ``specs``."""
    return ''.join(f'{rank} {" ".join(task_argv(s, shared, python))}\n'
                   for rank, s in enumerate(specs))


def srun_argv(specs, conf, name):
    """srun's command line: one task per process, each on its spec's node, labelled."""
    return ['srun', f'--ntasks={len(specs)}', f'--nodes={len({s.host for s in specs})}',
            '--distribution=arbitrary', f'--nodelist={",".join(s.host for s in specs)}',
            '--overcommit', '--label', '--kill-on-bad-exit=1', '--input=none',
            f'--job-name={name}', '--multi-prog', str(conf)]


class SlurmJob(StepJob):
    """A Job whose processes are the tasks of one srun step; see the module docstring."""
    tool = 'srun'
    drop_env = ALLOCATION_LAYOUT

    def __init__(self, specs, job_id, holder=None, tool_env=None, **kw):
        super().__init__(specs, **kw)
        self.job_id, self.step_id = job_id, None
        self.holder, self.tool_env = holder, tool_env or {}   # --partition: our allocation
        self.name = None                          # the step's name
        self.folder = None                        # the multi-prog file's, while srun reads it

    def step_argv(self, shared):
        """Write the multi-prog file; srun's command line that reads it."""
        self._forget_folder()
        self.folder = tempfile.mkdtemp(prefix='d2l-slurm-')
        conf = os.path.join(self.folder, 'multi-prog.conf')
        with open(conf, 'w') as f:
            f.write(multi_prog([p.spec for p in self.procs], shared))
        self.name, self.step_id = f'd2l-{config.get().job_id or os.getpid()}', None
        return srun_argv([p.spec for p in self.procs], conf, self.name)

    def task_line(self, line):
        m = LABEL.fullmatch(line)
        return (int(m[1]), m[2]) if m else None

    def noise(self, line, own=True):
        """srun's and slurmstepd's words on tasks that ended (taken when one could not say)."""
        if not STEP_NOISE.match(line):
            return False
        if (ended := TASKS_ENDED.match(line)) and not self.stopping:
            self._tasks_ended(*ended.groups())
        return True

    def task_said(self, proc, text):
        """Task 0 says which step this is (for scancel); srun has read the file by then."""
        if s := STEP.fullmatch(text):
            self.step_id = s[1]
            self._forget_folder()
            return True
        return False

    def _tasks_ended(self, ranks, code, signal_name):
        """srun said tasks ``ranks`` ('0-1,3') ended: those that did not say so themselves
        (their program never started, say) ended with that code."""
        code = int(code) if code else 137 if signal_name == 'Killed' else CANCELLED
        for part in ranks.split(','):
            first, _, last = part.partition('-')
            for rank in range(int(first), int(last or first) + 1):
                if rank < len(self.procs) and self.procs[rank].alive:
                    self._exited(self.procs[rank], code)

    def cancel(self):
        """scancel the step, quietly: by the id its task 0 said, else found by its name."""
        step_id = self.step_id
        try:
            if step_id is None:
                r = subprocess.run(['squeue', '-h', '-s', '-j', self.job_id, '-o', '%i %j'],
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                   timeout=30)
                step_id = next((line.split()[0] for line in r.stdout.splitlines()
                                if line.split()[1:] == [self.name]), None)
            if step_id is not None:
                subprocess.run(['scancel', '--quiet', step_id], stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass          # the controller does not answer: srun's guard still ends srun

    def _forget_folder(self):
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def run(self):
        try:
            return super().run()
        finally:
            self._forget_folder()
            if self.holder is not None:
                self.holder.release()


# -- putting it together -------------------------------------------------------------
def prepare(args, secret, out=None, notices=True, **job_options):
    """The job of the parsed ``args`` with ``--launcher slurm``: in this allocation, or
    (``--partition``) in one it asks for."""
    out = out or sys.stdout
    holder, environ = None, os.environ
    if args.partition:
        tasks = max(args.num_workers, args.nodes or 1)
        out.write(f'd2l-launch: asking Slurm for {tasks} tasks in partition {args.partition}'
                  f'{f" on {args.nodes} nodes" if args.nodes else ""} (salloc) ...\n')
        out.flush()
        holder = Holder(salloc_argv(args))
        environ = holder.start()
    try:
        return _prepare(args, secret, out, notices, holder, environ, **job_options)
    except BaseException:
        if holder is not None:
            holder.release()
        raise


def _prepare(args, secret, out, notices, holder, environ, **job_options):
    job_id, nodes, tasks, cpus = allocation(environ)
    where = addresses(nodes)
    port = args.port or free_port()
    specs = job_specs(args.num_workers, args.num_servers, args.command, secret,
                      hosts=nodes, slots=tasks, addresses=where, remote=True,
                      extra_env={**args.env, **config.env(scheduler_port=port)},
                      process_env=args.process_env)
    notice = share_cores(specs, dict(zip(nodes, cpus)))
    if notice and notices:
        out.write(notice + '\n')
    out.write(f'd2l-launch: one srun step in allocation {job_id} ({len(nodes)} '
              f'node{"s" * (len(nodes) > 1)}: {", ".join(nodes)}); the scheduler at '
              f'{where[specs[0].host]}:{port}\n')
    out.flush()
    return SlurmJob(specs, job_id, holder=holder,
                    tool_env=environ if holder is not None else None, timeout=args.timeout,
                    max_restarts=args.max_restarts, out=out, **job_options)
