"""The Slurm launcher: a job's processes as one ``srun`` step inside an allocation.

``d2l-launch --launcher slurm -n 2 -s 2 python train.py``, run where ``salloc`` or
``sbatch`` put you (``SLURM_JOB_ID`` set), does what the local launcher does, on the
allocation's nodes:

1. hosts: ``SLURM_JOB_NODELIST`` (``node[01-04,07]``, expanded by
   ``runtime/started.py``), workers by the allocation's tasks per node; each node's
   address is what its name resolves to here;
2. ``processes.py`` places the scheduler, the S servers and the N workers and gives each
   its environment, as for ssh; what every process shares (the secret among it) goes
   into srun's own environment, which Slurm hands to every task, never onto a command
   line;
3. one step: ``srun --multi-prog`` with a generated file of one line per task,
   ``RANK python -m d2ldist.launch.slurm --task WORD``, where WORD (base64 of JSON)
   holds that process's command and its own variables; ``--distribution=arbitrary
   -w node1,node1,node2,...`` puts each task where the placement says;
4. output: srun's ``--label`` says which task printed a line; it is shown as
   ``[worker 1@node2] ...``. The task side prints its command's exit code
   (``d2ldist.slurm: exit N``, hidden), so a process that fails is named as locally;
5. the end: a failure ends the step (``--kill-on-bad-exit``), and the launcher cancels
   it (``scancel JOB.STEP``) whenever the job ends otherwise (Ctrl-C, --timeout).
   srun runs under the guard: should the launcher die, the guard ends srun, and srun
   its step.

The scheduler listens on a port chosen before the step starts (``--port``, else one free
here), since every task starts at once and cannot wait for its first line.
"""
import base64
import selectors
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .. import config
from ..runtime.started import expand_nodelist, tasks_per_node
from .job import Job, Proc
from .processes import ProcSpec, child_env, free_port, guarded, job_specs, share_cores

LABEL = re.compile(r'\s*(\d+): (.*)')                  # srun --label's 'N: text'
EXIT = re.compile(r'd2ldist\.slurm: exit (\d+)')
STEP = re.compile(r'd2ldist\.slurm: step (\d+\.\d+)')
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
CANCELLED = 143       # SIGTERM, which Slurm sends to every task of a cancelled step


class SlurmError(Exception):
    """Not in an allocation, or the allocation cannot be used: one line, exit code 2."""


# -- 1. the allocation ---------------------------------------------------------------
def allocation(environ=os.environ):
    """(job id, nodes, workers per node, CPUs per node) of the allocation we are in."""
    job = environ.get('SLURM_JOB_ID')
    if not job:
        raise SlurmError('--launcher slurm runs inside a Slurm allocation (SLURM_JOB_ID is '
                         'not set): salloc -N 2 d2l-launch --launcher slurm ..., or '
                         'd2l-launch in an sbatch script')
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
def shared_env(specs):
    """The variables every process has, with the same value (srun hands them to all)."""
    first, *rest = (s.env for s in specs)
    return {k: v for k, v in first.items() if all(e.get(k) == v for e in rest)}


def task_word(spec, shared):
    """One task's command and own variables, as one word of the multi-prog file."""
    own = {k: v for k, v in spec.env.items() if shared.get(k) != v}
    data = json.dumps({'argv': spec.argv, 'env': own}).encode()
    return base64.urlsafe_b64encode(data).decode()


def multi_prog(specs, shared, python=sys.executable):
    """The text of srun's --multi-prog file: task N runs process N of ``specs``."""
    return ''.join(f'{rank} {python} -m d2ldist.launch.slurm --task {task_word(s, shared)}\n'
                   for rank, s in enumerate(specs))


def srun_argv(specs, conf, name):
    """srun's command line: one task per process, each on its spec's node, labelled."""
    return ['srun', f'--ntasks={len(specs)}', f'--nodes={len({s.host for s in specs})}',
            '--distribution=arbitrary', f'--nodelist={",".join(s.host for s in specs)}',
            '--overcommit', '--label', '--kill-on-bad-exit=1', '--input=none',
            f'--job-name={name}', '--multi-prog', str(conf)]


class StepSpec(ProcSpec):
    """srun itself, as the job's output and failure report name it."""

    @property
    def label(self):
        return 'srun'


class SlurmJob(Job):
    """A Job whose processes are the tasks of one srun step; see the module docstring."""

    def __init__(self, specs, job_id, **kw):
        super().__init__(specs, **kw)
        self.job_id, self.step_id = job_id, None
        self.step = None                          # srun (under the guard), as a Proc
        self.name, self.stopping = None, False    # the step's name; stop_all() under way
        self.folder = None                        # the multi-prog file's, while srun reads it

    def _start_all(self):
        """Write the multi-prog file and start the step: every process at once."""
        shared = shared_env([p.spec for p in self.procs])
        self._forget_folder()
        self.folder = tempfile.mkdtemp(prefix='d2l-slurm-')
        conf = os.path.join(self.folder, 'multi-prog.conf')
        with open(conf, 'w') as f:
            f.write(multi_prog([p.spec for p in self.procs], shared))
        name = f'd2l-{config.get().job_id or os.getpid()}'
        self.name = name
        self.step = Proc(StepSpec('srun', 0, argv=srun_argv([p.spec for p in self.procs],
                                                            conf, name), env=shared))
        env = {k: v for k, v in child_env(self.step.spec).items() if k not in ALLOCATION_LAYOUT}
        self.step.popen = subprocess.Popen(
            guarded(self.step.spec.argv), env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        os.set_blocking(self.step.popen.stdout.fileno(), False)
        self._sel.register(self.step.popen.stdout, selectors.EVENT_READ, self.step)
        self.step_id = None
        for p in self.procs:
            p.popen, p.file = self.step.popen, self._log_file(p)
            self._set_state(p, 'running')

    def _emit(self, p, line):
        """A line of srun's: to the task that printed it, or srun's own."""
        if p is not self.step:
            return super()._emit(p, line)
        m = LABEL.fullmatch(line)
        if m and int(m[1]) < len(self.procs) and not STEP_NOISE.match(m[2]):
            proc, text = self.procs[int(m[1])], m[2]
            if e := EXIT.fullmatch(text):
                return self._exited(proc, int(e[1]))
            if s := STEP.fullmatch(text):
                self.step_id = s[1]
                self._forget_folder()             # srun has read the multi-prog file by now
                return None
            return super()._emit(proc, text)
        if STEP_NOISE.match(m[2] if m else line):
            self.log.append(('srun', line))
            if (ended := TASKS_ENDED.match(line)) and not self.stopping:
                self._tasks_ended(*ended.groups())
            return None
        self.step.tail.append(line)
        self.log.append(('srun', line))
        self.out.write(f'[srun] {line}\n')
        self.out.flush()
        return None

    def _exited(self, p, code):
        """Task ``p``'s command ended with ``code``."""
        p.code, p.exited_at = code, time.monotonic()
        if p.state in ('stopped', 'finished'):
            self.on_state(p)
        elif code == 0:
            self._set_state(p, 'finished')
        elif code == CANCELLED:
            self._set_state(p, 'stopped')         # the step was cancelled under it
        else:
            self._set_state(p, 'failed')
            self.failure = self.failure or p

    def _tasks_ended(self, ranks, code, signal_name):
        """srun said tasks ``ranks`` ('0-1,3') ended: those that did not say so themselves
        (their program never started, say) ended with that code."""
        code = int(code) if code else 137 if signal_name == 'Killed' else CANCELLED
        for part in ranks.split(','):
            first, _, last = part.partition('-')
            for rank in range(int(first), int(last or first) + 1):
                if rank < len(self.procs) and self.procs[rank].alive:
                    self._exited(self.procs[rank], code)

    def _reap(self):
        """Notice that srun exited: the tasks that did not say how they ended, ended so."""
        step = self.step
        if step is None or not step.alive or step.popen.poll() is None:
            return
        self._drain(step)
        step.code = step.popen.returncode if step.popen.returncode >= 0 \
            else 128 - step.popen.returncode
        for p in self.procs:
            if p.alive:
                p.code, p.exited_at = CANCELLED if step.code else 0, time.monotonic()
                self._set_state(p, 'finished' if step.code == 0 and p.state != 'stopped'
                                else 'stopped')
        if step.code and self.failure is None and not self.stopping and not all(
                p.state == 'finished' for p in self.procs if p.spec.role == 'worker'):
            self.failure = step

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

    def stop_all(self, state='stopped'):
        """Cancel the step and wait for srun to end; then stop srun's guard (SIGTERM,
        SIGKILL after a grace), and at last SIGKILL it."""
        for p in self.procs:
            if p.alive:
                self._set_state(p, state)
        step = self.step
        if step is None or not step.alive:
            return
        self.stopping = True
        try:
            self.cancel()
            grace = config.get().kill_grace
            for stop, wait in ((lambda: None, grace + 5), (lambda: self.terminate(step),
                                                           2 * grace + 5)):
                stop()
                deadline = time.monotonic() + wait
                while step.alive and time.monotonic() < deadline:
                    self._pump(0.05)
                    self._reap()
            if step.alive:
                os.killpg(step.popen.pid, signal.SIGKILL)
                step.popen.wait()
                self._reap()
        finally:
            self.stopping = False

    def _forget_folder(self):
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def run(self):
        try:
            return super().run()
        finally:
            self._forget_folder()


# -- putting it together -------------------------------------------------------------
def prepare(args, secret, out=None, notices=True, **job_options):
    """The job of the parsed ``args`` with ``--launcher slurm``, in this allocation."""
    out = out or sys.stdout
    job_id, nodes, tasks, cpus = allocation()
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
    return SlurmJob(specs, job_id, timeout=args.timeout, max_restarts=args.max_restarts,
                    out=out, **job_options)


# -- the task side ---------------------------------------------------------------------
def task_main(word):
    """Run one task's command with its own variables; print how it ended."""
    try:
        data = json.loads(base64.urlsafe_b64decode(word))
        argv, env = data['argv'], dict(os.environ, **data['env'])
    except (ValueError, KeyError, TypeError):
        sys.exit('d2ldist.slurm: --task takes a word written by d2l-launch --launcher slurm')
    if os.environ.get('SLURM_PROCID') == '0':
        print(f'd2ldist.slurm: step {os.environ.get("SLURM_JOB_ID")}.'
              f'{os.environ.get("SLURM_STEP_ID")}', flush=True)
    try:
        child = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
    except OSError as e:
        print(f'd2l-launch: cannot start {argv[0]!r}: {e.strerror}', file=sys.stderr,
              flush=True)
        code = 127
    else:
        def forward(signum, frame):
            child.send_signal(signum)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        code = child.wait()
        code = 128 - code if code < 0 else code
    print(f'd2ldist.slurm: exit {code}', flush=True)
    sys.exit(code)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != '--task':
        sys.exit('d2ldist.slurm: runs one task of d2l-launch --launcher slurm '
                 '(--task WORD); start jobs with d2l-launch --launcher slurm')
    task_main(argv[1])


if __name__ == '__main__':
    main()
