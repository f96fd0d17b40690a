"""FSDP2 on the torch backend saves with d2ldist.checkpoint, in DCP's format.

    d2l-launch -n N -s 0 --env D2L_BACKEND=torch python fsdp2_checkpoint_job.py FOLDER STEPS [--load]

A small MLP in float64 sharded by PyTorch's ``fully_shard`` (each Linear, then the
whole), Adam; step s trains on the global batch of 12 drawn from seed s, each worker its
part. Saves ``{'model', 'optimizer', 'step'}`` into FOLDER after STEPS steps; with
--load, loads FOLDER first instead (on any number of workers) and saves nothing.
"""
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import d2ldist

torch.set_num_threads(1)
folder, steps, load = sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ['--load']
d2ldist.init()
r, N = d2ldist.rank(), d2ldist.size()
torch.manual_seed(0)
net, mesh = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double(), \
    init_device_mesh('cpu', (N,))
for layer in (net[0], net[2], net):
    fully_shard(layer, mesh=mesh)
opt = torch.optim.Adam(net.parameters(), lr=0.01)
state = {'model': net, 'optimizer': opt, 'step': 0}
if load:
    d2ldist.checkpoint.load(state, folder)
else:
    for step in range(steps):
        X = torch.randn(12, 5, generator=torch.Generator().manual_seed(step),
                        dtype=torch.float64)
        opt.zero_grad()
        net(X[r * 12 // N:(r + 1) * 12 // N]).pow(2).mean().backward()
        opt.step()
    state['step'] = steps
    d2ldist.checkpoint.save(state, folder)
d2ldist.barrier()
