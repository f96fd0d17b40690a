"""A user who left d2ldist: plain PyTorch loads d2ldist's FSDP2 checkpoint.

    torchrun --standalone --nproc_per_node=N fsdp2_plain_load.py FOLDER

No d2ldist here: torch.distributed on gloo, the same MLP sharded by ``fully_shard``,
Adam, and ``torch.distributed.checkpoint.load`` of ``{'model', 'optimizer', 'step'}``,
as PyTorch's own recipe does. Rank 0 prints ``LOADED {json}``: the step and the SHA-256
of the whole state gathered, computed here in the order d2ldist's line uses (each
tensor whole, by name sorted: name, dtype, shape as JSON, then its bytes; then the
values as JSON with sorted keys).
"""
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

torch.set_num_threads(1)
dist.init_process_group('gloo')
net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
mesh = init_device_mesh('cpu', (dist.get_world_size(),))
for layer in (net[0], net[2], net):
    fully_shard(layer, mesh=mesh)
opt = torch.optim.Adam(net.parameters(), lr=0.01)

model_sd, optim_sd = get_state_dict(net, opt)
state = {'model': model_sd, 'optimizer': optim_sd, 'step': 0}
dcp.load(state, checkpoint_id=sys.argv[1])
set_state_dict(net, opt, model_state_dict=state['model'], optim_state_dict=state['optimizer'])

full_model, full_optim = get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))
tensors = {f'model.{k}': t for k, t in full_model.items()}
tensors.update({f'optimizer.state.model.{fqn}.{name}': t
                for fqn, entries in full_optim['state'].items() for name, t in entries.items()})
groups = [{**{k: v for k, v in g.items() if k != 'params'},
           'params': sorted(f'model.{fqn}' for fqn in g['params'])}
          for g in full_optim['param_groups']]
sha = hashlib.sha256()
for key in sorted(tensors):
    t = tensors[key].detach().contiguous()
    sha.update(json.dumps([key, str(t.dtype).removeprefix('torch.'), list(t.shape)]).encode())
    sha.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
sha.update(json.dumps({'optimizer.param_groups': groups, 'step': state['step']},
                      sort_keys=True).encode())
assert 'd2ldist' not in sys.modules
if dist.get_rank() == 0:
    print('LOADED ' + json.dumps({'step': state['step'], 'workers': dist.get_world_size(),
                                  'sha256': sha.hexdigest()}), flush=True)
dist.destroy_process_group()
# FSDP2 brings torch._dynamo, which keeps a reference to the group: its gloo threads outlive
# destroy_process_group and may drop a tensor (taking the GIL) while the interpreter
# finalizes, an abort ('terminate called without an active exception'). Nothing is left to
# finalize here, so skip it (d2ldist's torch backend waits for those threads instead).
sys.stdout.flush()
os._exit(0)
