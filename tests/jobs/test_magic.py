"""%launch in a real kernel: notebooks run by nbclient, the stop button and kernel restarts."""
import json
import queue
import re
import subprocess
import sys
import time

import nbformat
import pytest

pytest.importorskip('nbclient')
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from jupyter_client import KernelManager

from support import ROOT, new_tag, tagged_pids, wait_no_survivors
from nbtools import JOB_SCRIPT, notebook, stream_text

WRITE_JOB = '%%writefile progress_job.py\n' + JOB_SCRIPT


def run_notebook(nb, path):
    client = NotebookClient(nb, timeout=120, kernel_name='python3',
                            resources={'metadata': {'path': str(path)}})
    try:
        client.execute()
    finally:
        nbformat.write(nb, path / 'executed.ipynb')   # to look at when a test fails


def test_notebook_runs_a_job_and_keeps_its_output(tmp_path):
    tag = new_tag()
    nb = notebook('%load_ext d2ldist', WRITE_JOB,
                  'n = 2\n'
                  f'%launch -n $n -s {{n}} --env D2L_TEST_TAG={tag} progress_job.py 2 5 0.02 -1',
                  'print(_launch.exit_codes)\nprint(_launch.metrics[1])\n'
                  'print(len(_launch.log), _launch.outcome)',
                  '%launch -n 2 -s 2 no_such_script.py',
                  f'%launch -n 1 -s 0 --timeout 1 --env D2L_TEST_TAG={tag} progress_job.py 1000 10 0.1 -1',
                  'print(_launch.outcome, _launch.exit_codes)',
                  # worker 1 fails after 0.1 s; worker 0 would run 10 s: it must be stopped
                  f'%launch -n 2 -s 1 --env D2L_TEST_TAG={tag} progress_job.py 2 50 0.1 1')
    for cell in nb.cells[4:6]:
        cell.metadata['tags'] = ['raises-exception']         # nbclient goes on after them
    with pytest.raises(CellExecutionError) as failed:
        run_notebook(nb, tmp_path)
    launch = nb.cells[2]
    out = stream_text(launch)
    for rank in (0, 1):
        assert f'[worker {rank}] worker {rank} starts\n' in out
        assert f'[worker {rank}] worker {rank} done\n' in out
    assert '@d2l/1' not in out                                # reports went to the dashboard
    assert 'scheduler ready' not in out                       # the port is not the reader's
    # what stays: the header line where the dashboard was, the log, the summary, the figure
    kinds = [o.output_type for o in launch.outputs]
    assert kinds[0] == 'display_data' and kinds[-2:] == ['display_data', 'display_data']
    assert set(kinds[1:-2]) == {'stream'}
    header, summary, figure = (launch.outputs[i].data for i in (0, -2, -1))
    assert header == {'text/plain': f'%launch -n 2 -s 2 --env D2L_TEST_TAG={tag} '
                                     'progress_job.py 2 5 0.02 -1: scheduler, 2 servers, 2 workers'}
    lines = summary['text/plain'].splitlines()
    assert lines[0].startswith('job finished after ') and set(summary) == {'text/plain'}
    assert lines[6].split() == ['worker', '1', 'localhost', 'finished', '0', '|██████████|',
                                '100%', 'epoch', '2/2,', 'batch', '5/5']
    assert '  time per batch  worker 0  worker 1' in lines
    assert figure['image/png'] and figure['text/plain'].endswith(
        ': loss, accuracy and time per step of each worker')
    every = out + ''.join(o.get('data', {}).get('text/plain', '') for o in launch.outputs)
    assert every.count('worker 1 done') == 1                  # each line once
    assert 'widgets' not in nb.metadata                       # nothing of the widgets is kept
    result = stream_text(nb.cells[3]).splitlines()
    assert result[0] == "{'scheduler': 0, 'server 0': 0, 'server 1': 0, 'worker 0': 0, 'worker 1': 0}"
    assert "'epoch': 2, 'num_epochs': 2, 'batch': 5, 'num_batches': 5" in result[1]
    assert "'test_acc': 0.8" in result[1]
    assert result[2].endswith(' finished')
    # bad options: one line, no traceback, no job
    assert stream_text(nb.cells[4]) == 'UsageError: %launch: no such script: no_such_script.py\n'
    # a job that runs too long is stopped, and the cell fails
    shown = [o.data['text/plain'] for o in nb.cells[5].outputs if o.output_type == 'display_data']
    assert sum(t.startswith('job timeout after ') for t in shown) == 1
    error = [o for o in nb.cells[5].outputs if o.output_type == 'error'][0]
    assert (error.ename, error.evalue) == ('JobFailed', 'the job ran longer than --timeout 1 s; '
                                                        'it was stopped')
    assert stream_text(nb.cells[6]).startswith('timeout {')
    # a failing worker fails the cell with a real exception naming it, with its last lines
    summary = [o.data['text/plain'] for o in nb.cells[7].outputs
               if o.get('data', {}).get('text/plain', '').startswith('job failed after ')]
    assert len(summary) == 1
    rows = {tuple(line.split()[:2]): line.split()[2:5] for line in summary[0].splitlines()}
    assert rows[('worker', '1')] == ['localhost', 'failed', '3']
    assert rows[('scheduler', 'localhost')][0] == 'stopped'   # the others were stopped
    error = [o for o in nb.cells[7].outputs if o.output_type == 'error'][0]
    assert error.ename == 'JobFailed'
    assert error.evalue.startswith('worker 1 failed (exit code 3); the job was stopped.')
    assert error.evalue.endswith('\n  | worker 1 starts\n  | worker 1: something broke')
    log = stream_text(nb.cells[7])          # the log shows those lines once, as they came
    assert 'd2l-launch: worker 1 failed (exit code 3); the job was stopped.\n' in log
    assert log.count('worker 1: something broke') == 1 and 'Its last lines' not in log
    assert 'JobFailed' in str(failed.value)
    assert wait_no_survivors(tag) == []


def test_nbval_passes_on_a_launch_cell_run_again(tmp_path):
    """What a finished %launch leaves is what nbval sees when it runs the cell again.

    nbval keeps a cell's first display of each output and ignores updates, so the
    dashboard's place must read the same before and after (the header line), and what
    differs run to run in the summary must be masked by notebooks/sanitize.cfg."""
    pytest.importorskip('nbval')
    tag = new_tag()
    nb = notebook('%load_ext d2ldist', WRITE_JOB,      # one worker: its lines keep their order
                  f'%launch -n 1 -s 1 --env D2L_TEST_TAG={tag} progress_job.py 2 5 0.02 -1')
    run_notebook(nb, tmp_path)
    assert [o.output_type for o in nb.cells[2].outputs][-2:] == ['display_data'] * 2
    r = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                        '--nbval', '--nbval-current-env', '--nbval-sanitize-with',
                        str(ROOT / 'notebooks' / 'sanitize.cfg'), 'executed.ipynb'],
                       cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:]
    assert '3 passed' in r.stdout
    assert wait_no_survivors(tag) == []


def test_max_restarts_in_a_notebook_resumes_from_the_checkpoint(tmp_path):
    """%launch --max-restarts: worker 1 killed at step 25, the job started again from the
    checkpoint of step 20; the cell succeeds and its summary lists both attempts."""
    tag = new_tag()
    job = ROOT / 'tests' / 'jobs' / 'checkpoint_job.py'
    nb = notebook('%load_ext d2ldist',
                  f'%launch -n 2 -s 2 --max-restarts 1 --checkpoint-dir {tmp_path / "ckpt"} '
                  f'--checkpoint-every 10 --fail worker:1@step=25 --env D2L_TEST_TAG={tag} '
                  f'python {job} dist_sync 2',
                  'print(_launch.outcome, len(_launch.attempts))')
    run_notebook(nb, tmp_path)
    log = stream_text(nb.cells[1])
    assert 'worker 1 fails on purpose' in log and 'restart 1 of 1' in log
    # step 20's checkpoint, or step 10's where the kill cut off the write of step 20 (a
    # thread writes it while steps 21 to 25 train)
    step = re.search(r'resumed from ckpt/step-000000(10|20) '     # (relative to the kernel's folder)
                     r'\(step (\d+): epoch 1, batch \2\)', log)
    assert step and step.group(1) == step.group(2), log[-3000:]
    finals = re.findall(r'FINAL (\{.*\})', log)
    assert len(finals) == 2 and len({json.loads(f)['sha256'] for f in finals}) == 1
    summary = [o.data['text/plain'] for o in nb.cells[1].outputs
               if o.get('data', {}).get('text/plain', '').startswith('job finished after ')]
    attempts = [line.strip() for line in summary[0].splitlines() if 'attempt ' in line]
    assert attempts[0].startswith('attempt 0, started at 0.0 s: worker 1 failed'), attempts
    assert re.fullmatch(rf'attempt 1, started at [\d.]+ s, resumed from step {step.group(1)} '
                        r'\(\d+ steps? lost\): finished', attempts[1]), attempts
    assert stream_text(nb.cells[2]) == 'finished 2\n'
    assert wait_no_survivors(tag) == []


class Kernel:
    """A kernel of our own, to press its stop button and restart it."""

    def __init__(self, cwd):
        self.km = KernelManager(kernel_name='python3')
        self.km.start_kernel(cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code, timeout=60):
        """Run code to the end; return the reply's content."""
        msg_id = self.kc.execute(code)
        return self.reply(msg_id, timeout)

    def reply(self, msg_id, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            reply = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply['parent_header'].get('msg_id') == msg_id:
                return reply['content']

    def wait_for_output(self, text, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                continue
            if text in msg['content'].get('text', ''):
                return
        raise AssertionError(f'no output {text!r} within {timeout} s')

    def close(self):
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel(tmp_path):
    (tmp_path / 'progress_job.py').write_text(JOB_SCRIPT)
    k = Kernel(tmp_path)
    yield k
    k.close()


LONG_JOB = '%launch -n 2 -s 2 --env D2L_TEST_TAG={tag} python progress_job.py 1000 10 0.05 -1'


def test_stop_button_stops_every_process(kernel):
    tag = new_tag()
    assert kernel.run('%load_ext d2ldist')['status'] == 'ok'
    # (stop_on_error=False: after a cell's error the kernel aborts the requests queued
    # until it has flushed its queue, and ours comes right after the reply; a person's
    # next cell comes later, after that)
    msg_id = kernel.kc.execute(LONG_JOB.format(tag=tag), stop_on_error=False)
    kernel.wait_for_output('worker 1 starts')
    assert len(tagged_pids(tag)) >= 5            # the job runs: guards and their commands
    pressed = time.monotonic()
    kernel.km.interrupt_kernel()
    reply = kernel.reply(msg_id, timeout=30)
    assert reply['status'] == 'error' and reply['ename'] == 'KeyboardInterrupt'
    assert wait_no_survivors(tag, timeout=10) == []
    assert time.monotonic() - pressed < 8
    after = kernel.run('print(_launch.outcome, sorted(_launch.exit_codes))')
    assert after['status'] == 'ok'                # the kernel lives on


@pytest.mark.parametrize('now', [False, True], ids=['restart', 'kill'])
def test_kernel_restart_leaves_nothing_running(kernel, now):
    tag = new_tag()
    kernel.run('%load_ext d2ldist')
    kernel.kc.execute(LONG_JOB.format(tag=tag))
    kernel.wait_for_output('worker 1 starts')
    assert len(tagged_pids(tag)) >= 5
    kernel.km.restart_kernel(now=now)            # now=True: SIGKILL, the kernel cannot clean up
    assert wait_no_survivors(tag, timeout=15) == []


def test_help_lists_the_launchers_options():
    from d2ldist.notebook.magic import LaunchMagics
    doc = LaunchMagics.launch.__doc__
    assert doc.startswith('Run a distributed job') and 'usage: %launch' in doc
    for option in ('--num-workers', '--num-servers', '--launcher', '--hostfile', '--env',
                   '--timeout', 'command'):
        assert option in doc


def test_terminal_ipython_shows_the_text_form(tmp_path):
    """Without widgets (terminal IPython): the header line, the log, then the summary."""
    tag = new_tag()
    (tmp_path / 'progress_job.py').write_text(JOB_SCRIPT)
    (tmp_path / 'run.ipy').write_text(
        '%load_ext d2ldist\n'
        f'%launch -n 2 -s 1 --env D2L_TEST_TAG={tag} progress_job.py 1 4 0.01 -1\n'
        'print(_launch.ok)\n')
    r = subprocess.run([sys.executable, '-m', 'IPython', '--no-banner', '--colors=nocolor',
                        'run.ipy'], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    lines = r.stdout.splitlines()
    assert lines[0].endswith('progress_job.py 1 4 0.01 -1: scheduler, 1 server, 2 workers')
    assert any(line.startswith('job finished after') for line in lines), r.stdout + r.stderr
    final = [line for line in lines if line.lstrip().startswith('worker 1 ')][-1].split()
    assert final[:5] == ['worker', '1', 'localhost', 'finished', '0']
    assert '100%' in final and 'epoch' in final
    assert lines[-1] == 'True'
    assert wait_no_survivors(tag) == []
