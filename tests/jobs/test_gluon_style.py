"""MXNet code on d2ldist: gluon's Trainer calls, written out (gluon_style.py), run on
2 workers and 2 servers with only the import changed, give SGD's numbers."""
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from support import run_launch, wait_no_survivors

SCRIPT = Path(__file__).resolve().parent / 'gluon_style.py'
STEPS, BATCH, LR, WORKERS = 10, 8, 0.1, 2           # as in gluon_style.py

pytestmark = pytest.mark.timeout(180)


def sgd_on_both_batches():
    """Each worker's losses and the final weights of plain SGD on the mean gradient of
    both workers' batches, in one process (dense gradients: plain SGD updates the
    rows no batch used by nothing, as the servers' lazy update does)."""
    torch.manual_seed(0)
    embedding, dense = nn.Embedding(10, 4).double(), nn.Linear(4, 1).double()
    params = [embedding.weight, dense.weight, dense.bias]
    batches = []
    for rank in range(WORKERS):
        g = torch.Generator().manual_seed(rank)
        batches.append((torch.randint(0, 10, (BATCH,), generator=g),
                        torch.randn(BATCH, 1, generator=g, dtype=torch.float64)))
    losses = [[] for _ in range(WORKERS)]
    for _ in range(STEPS):
        grads = []
        for rank, (tokens, y) in enumerate(batches):
            loss = ((dense(embedding(tokens)) - y) ** 2).sum()
            grads.append(torch.autograd.grad(loss, params))
            losses[rank].append(loss.item())
        with torch.no_grad():
            for p, g0, g1 in zip(params, *grads):
                p -= LR * (g0 + g1) / (BATCH * WORKERS)
    return losses, [p.detach().reshape(-1) for p in params]


def test_a_gluon_style_script_runs_with_its_import_changed():
    """push/pull/pushpull with priority=-i, kv._barrier(), row_sparse_pull(key, out,
    priority, row_ids): both workers end with the same weights, those of SGD on both
    batches, and the loss falls."""
    mine = [line for line in SCRIPT.read_text().splitlines() if 'd2ldist' in line]
    assert mine == ['from d2ldist import kv as kvstore   # MXNet: from mxnet import kvstore']
    r = run_launch('-n', WORKERS, '-s', 2, '--timeout', 150, sys.executable, SCRIPT,
                   timeout=170)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = {int(m[1]): json.loads(m[2])
           for m in re.finditer(r'^\[worker (\d+)\] GLUON (.*)$', r.stdout, re.M)}
    assert sorted(got) == [0, 1], r.stdout[-3000:]
    assert got[0]['weights'] == got[1]['weights']                  # exactly the same
    losses, weights = sgd_on_both_batches()
    for rank, out in got.items():
        assert torch.allclose(torch.tensor(out['losses'], dtype=torch.float64),
                              torch.tensor(losses[rank], dtype=torch.float64), rtol=1e-12)
    for w, want in zip(got[0]['weights'], weights):
        assert torch.allclose(torch.tensor(w, dtype=torch.float64), want, rtol=1e-12,
                              atol=1e-12)
    first, last = (sum(out['losses'][s] for out in got.values()) for s in (0, -1))
    assert last < 0.5 * first, (first, last)
    assert wait_no_survivors(r.tag) == []
