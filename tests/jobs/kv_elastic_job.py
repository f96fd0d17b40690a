"""Elastic workers on the parameter server, for test_elastic.py: which pushes count.

Every step each worker pushes ``1000 ** rank`` to the key 'x' (and to each element of
'w', which D2L_KVSTORE_BIGARRAY_BOUND=1000 cuts over the servers), and the servers add
what a round sums to the value (SGD with a learning rate of -1). Written in base 1000,
the value counts each worker's pushes so far; what a sync round adds says whose pushes
it counted, and a digit 2 would be a push counted twice. In dist_async each push is
added when it arrives, so after a last barrier the value counts each worker's pushes.

A worker that joins a running job (``kv.is_recovery``) pulls the current values, then
takes JOINER_STEPS steps, pushing 1 to the key 'j' (the others push 0); with JOIN=1 the
others go on until 'j' says the rounds counted that many. The others print the values
after each step and the final one.

    d2l-launch -n 3 -s 2 --min-workers 2 --fail worker:1@step=40 python kv_elastic_job.py
"""
import json
import os
import time

import torch

import d2ldist
from d2ldist.runtime import faults, spans

STEPS, JOINER_STEPS, MOST_STEPS = 100, 20, 2000
BASE = 1000


def step(kv, mine, x, w, j):
    """One training step: the compute (d2l-launch --fail counts these), then push and
    pull; the value of 'x', and of 'j' (the joiner's pushes counted so far)."""
    time.sleep(0.03)
    faults.computed(0.03)            # (what the Trainer does after forward and backward)
    spans.step_done()
    joiner = torch.full((1,), float(kv.is_recovery), dtype=torch.float64)
    kv.pushpull(['x', 'w', 'j'], [mine, mine.expand(w.shape).contiguous(), joiner],
                out=[x, w, j])
    if kv.type != 'dist_async':               # every server's slice counted the same pushes
        assert torch.all(w == x), (w, x)
    return int(x.item()), int(j.item())


def main():
    kv = d2ldist.kv.create(os.environ.get('KV', 'dist_sync'))
    x, w, j = (torch.zeros(n, dtype=torch.float64) for n in (1, 5000, 1))
    kv.init(['x', 'w', 'j'], [x, w, j])
    kv.set_optimizer('sgd', lr=-1.0)          # value += the round's sum
    kv.pull(['x', 'w'], out=[x, w])
    mine = torch.full((1,), float(BASE ** kv.rank), dtype=torch.float64)
    if kv.is_recovery:                        # joins: trains from the current values
        print(f'worker {kv.rank} joins at {int(x.item())}', flush=True)
        for _ in range(JOINER_STEPS):
            step(kv, mine, x, w, j)
        return
    values, joined, join = [], 0, os.environ.get('JOIN') == '1'
    while len(values) < STEPS or (join and joined < JOINER_STEPS):
        assert len(values) < MOST_STEPS, 'no worker joined'
        value, joined = step(kv, mine, x, w, j)
        values.append(value)
    print(f'worker {kv.rank} values {json.dumps(values)}', flush=True)
    kv.barrier()                              # every push has arrived: the last value
    kv.pull(['x', 'w'], out=[x, w])
    print(f'worker {kv.rank} final {int(x.item())}', flush=True)


if __name__ == '__main__':
    main()
