"""ZeRO saves with d2ldist.checkpoint and resumes on another number of workers.

    d2l-launch -n N -s 0 python sharded_checkpoint_job.py STAGE FOLDER LAST [--save-at K]

Without --save-at, the job loads FOLDER first (d2ldist.checkpoint.load) and goes on
from the step it holds. A small MLP in float64, Adam, ZeRO's STAGE (buckets of 30
values at stages 1-2, one unit per Linear at 3); step s trains on the global batch of 12
drawn from seed s, each worker its part, up to step LAST. Each worker prints
``RESULT {json}``: its rank, the workers, the step it began at, its final weights.
"""
import json
import sys

import torch
from torch import nn

import d2ldist
from d2ldist.collectives.sharded_module import full_weights

torch.set_num_threads(1)
stage, folder, last = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
save_at = int(sys.argv[5]) if sys.argv[4:5] == ['--save-at'] else None
d2ldist.init()
r, N = d2ldist.rank(), d2ldist.size()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
if stage == 3:
    net = d2ldist.shard_module(net)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
else:
    opt = d2ldist.ShardedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                                   stage=stage, bucket_cap_mb=30 * 8 / 2 ** 20)
state = {'model': net, 'optimizer': opt, 'step': 0}
if save_at is None:
    d2ldist.checkpoint.load(state, folder)
began = state['step']
for step in range(began, last):
    X = torch.randn(12, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
    opt.zero_grad()
    net(X[r * 12 // N:(r + 1) * 12 // N]).pow(2).mean().backward()
    opt.step()
    if step + 1 == save_at:
        state['step'] = step + 1
        d2ldist.checkpoint.save(state, folder)
weights = full_weights(net) if stage == 3 else dict(net.named_parameters())
print('RESULT ' + json.dumps({'rank': r, 'size': N, 'began': began, 'weights': {
    name: w.tolist() for name, w in weights.items()}}), flush=True)
