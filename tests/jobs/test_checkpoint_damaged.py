"""d2ldist.checkpoint.load(state) under d2l-launch --checkpoint-dir (issue 52): a damaged
newest checkpoint is passed over in one line, as the Trainer's are, and the job resumes
from the one before. examples/zero_digits.py, ZeRO stage 2 on 2 workers; three jobs.
Values and SHA-256 lines, never times."""
import re
import shutil

from test_zero_example import only, zero_job

EVERY = 12                        # one epoch of 31 steps: step-12 and step-24 saved


def resumed(folder):
    """The example resumed from d2l-launch's --checkpoint-dir ``folder``: its output and
    the final line every worker printed."""
    out, final = zero_job(2, '--stage', 2,
                          launch=('--checkpoint-dir', folder, '--checkpoint-every', EVERY))
    return out, only(final)


def test_a_damaged_newest_is_passed_over_and_the_job_ends_as_if_resumed_from_the_one_before(
        tmp_path):
    """Worker 1's file of step-24 cut short: the job says so once, loads step-12 (the
    SHA-256 saved there) and ends with the weights of a job resumed from step-12 alone."""
    damaged, older = tmp_path / 'damaged', tmp_path / 'older'
    out, _ = resumed(damaged)
    saved = dict(re.findall(rf'checkpoint saved in {damaged}/step-(\d+) by 2 workers: '
                            r'state sha256 (\w{64})', out))
    assert sorted(saved) == ['12', '24']
    shutil.copytree(damaged / 'step-12', older / 'step-12')
    file = damaged / 'step-24' / 'shard-1-of-2.ckpt'
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])

    out, final = resumed(damaged)
    passed = [line for line in out.splitlines() if 'passed over' in line]
    assert len(passed) == 1 and passed[0].startswith(
        f'[worker 0] d2ldist: checkpoint {damaged}/step-24 passed over: worker 1: {file} '
        'is damaged or cut short'), passed
    assert passed[0].endswith('; loading the one before it')
    assert re.findall(rf'checkpoint loaded from {damaged}/step-(\d+) \(saved by 2 workers\) '
                      r'by 2 workers: state sha256 (\w{64})', out) == [('12', saved['12'])]
    out_older, final_older = resumed(older)
    assert 'passed over' not in out_older
    assert final == final_older and final.startswith('31 steps: ')
