"""d2ldist.checkpoint (training/sharded_checkpoint.py) among real workers: ZeRO saved by 3
workers and resumed by 2; FSDP2 saved in DCP's format and loaded by plain PyTorch."""
import json
import re
import sys

import torch

from support import ROOT, run_launch, run_torchrun, wait_no_survivors


# -- d2ldist.checkpoint: sharded training saved by N workers, resumed by M -------------------
SHARDED_JOB = ROOT / 'tests' / 'jobs' / 'sharded_checkpoint_job.py'


def sharded_job(n, stage, folder, *save_at):
    """The ZeRO job on the ring with n workers, to step 8; its output and RESULT records."""
    r = run_launch('-n', n, '-s', 0, '--timeout', 90, sys.executable, SHARDED_JOB, stage,
                   folder, 8, *save_at, timeout=120)
    assert wait_no_survivors(r.tag) == []
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    found = [json.loads(line) for line in re.findall(r'RESULT (.*)', r.stdout)]
    assert sorted(f['rank'] for f in found) == list(range(n))
    return r.stdout + r.stderr, found


def test_zero_stage_2_saved_by_3_workers_resumes_on_2(tmp_path):
    """3 workers save at step 4 and go on to step 8; 2 workers load it and go on to step
    8 from there: the whole state's SHA-256 at the load is the save's, and both end with
    the same weights (up to float64's rounding: 2 workers sum in another order)."""
    out, three = sharded_job(3, 2, tmp_path, '--save-at', 4)
    saved = re.findall(rf'checkpoint saved in {tmp_path} by 3 workers: state sha256 '
                       r'([0-9a-f]{64})', out)
    assert len(saved) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ['manifest.json', 'shard-0-of-3.ckpt', 'shard-1-of-3.ckpt', 'shard-2-of-3.ckpt']
    out, two = sharded_job(2, 2, tmp_path)
    assert re.findall(rf'checkpoint loaded from {tmp_path} \(saved by 3 workers\) by 2 '
                      r'workers: state sha256 ([0-9a-f]{64})', out) == saved
    assert {f['began'] for f in two} == {4} and {f['began'] for f in three} == {0}
    for f in two:
        for name, w in f['weights'].items():
            assert torch.allclose(torch.tensor(w), torch.tensor(three[0]['weights'][name]),
                                  rtol=1e-10, atol=1e-13)


# -- FSDP2 on the torch backend: DCP's format, loaded by plain PyTorch ------------------------
FSDP2_JOB = ROOT / 'tests' / 'jobs' / 'fsdp2_checkpoint_job.py'
PLAIN_LOAD = ROOT / 'tests' / 'jobs' / 'fsdp2_plain_load.py'


def fsdp2_job(n, folder, *flags):
    """The FSDP2 job on the torch backend with n workers; its output."""
    r = run_launch('-n', n, '-s', 0, '--timeout', 60, '--env', 'D2L_BACKEND=torch',
                   sys.executable, FSDP2_JOB, folder, 4, *flags, timeout=90)
    assert wait_no_survivors(r.tag) == []
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_fsdp2_saved_by_2_workers_loads_in_plain_torch_and_in_d2ldist_on_3(tmp_path):
    """2 workers train an FSDP2 MLP 4 steps and save: DCP's files. A plain PyTorch
    script (torchrun, 3 workers, no d2ldist) loads them with dcp.load into its own FSDP2
    model: its whole state's SHA-256 is the one d2ldist printed at save; d2ldist on 3
    workers loads them too, to the same line."""
    folder = tmp_path / 'ckpt'
    saved = re.findall(rf'checkpoint saved in {folder} by 2 workers: state sha256 '
                       r'([0-9a-f]{64})', fsdp2_job(2, folder))
    assert len(saved) == 1
    assert sorted(p.name for p in folder.iterdir()) == \
        ['.metadata', '__0_0.distcp', '__1_0.distcp', 'manifest.json']
    plain = run_torchrun(PLAIN_LOAD, folder, workers=3, timeout=90)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert [json.loads(x) for x in re.findall(r'LOADED (.*)', plain.stdout)] == \
        [{'step': 4, 'workers': 3, 'sha256': saved[0]}]
    assert re.findall(rf'checkpoint loaded from {folder} \(saved by 2 workers\) by 3 '
                      r'workers: state sha256 ([0-9a-f]{64})',
                      fsdp2_job(3, folder, '--load')) == saved
