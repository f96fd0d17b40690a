"""FSDP2's checkpoints, written in PyTorch's own format (torch.distributed.checkpoint).

When the state holds a module of ``fully_shard``, ``d2ldist.checkpoint.save`` and
``load`` come here: ``get_state_dict`` gives its DTensors and those of its optimizers,
``torch.distributed.checkpoint.save`` writes them (each worker its shards, plus DCP's
``.metadata``), and a load on any number of workers reshards them as DCP does. So a
user who leaves d2ldist loads the folder with ``torch.distributed.checkpoint.load``
into an FSDP2 model of their own. Beside DCP's files, worker 0 writes
``manifest.json``: the format, the workers, the SHA-256 of the whole state.

The hash is the one of d2ldist's own format (``state_hash.py``): the full tensors
(``full_state_dict``), named as if nothing were sharded. Why two formats:
docs/design/sharded_checkpoints.md.
"""
import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule

from .checkpoint import CheckpointError
from .state_hash import state_sha256

FORMAT = 'torch.distributed.checkpoint'
MANIFEST = 'manifest.json'
FULL = StateDictOptions(full_state_dict=True)


def holds_fsdp2(state):
    """Whether a module of ``state`` (a dict) is sharded by FSDP2's ``fully_shard``."""
    return isinstance(state, dict) and any(
        isinstance(m, FSDPModule) for v in state.values() if isinstance(v, nn.Module)
        for m in v.modules())


def module_of(state, optimizer, key):
    """The key of the module of ``state`` that holds ``optimizer``'s parameters."""
    first = next(p for g in optimizer.param_groups for p in g['params'])
    for k, v in state.items():
        if isinstance(v, nn.Module) and any(p is first for p in v.parameters()):
            return k
    raise TypeError(f'the parameters of {key} are in no module of the state: save the '
                    'module beside its optimizer')


def state_dict(state, options=None):
    """``state`` as DCP takes it: each module's and optimizer's state_dict (DTensors,
    or with ``FULL`` whole tensors), the other entries as they are."""
    found = {}
    for k, v in state.items():
        if isinstance(v, nn.Module):
            found[k] = get_model_state_dict(v, options=options)
        elif isinstance(v, torch.optim.Optimizer):
            found[k] = get_optimizer_state_dict(state[module_of(state, v, k)], v,
                                                options=options)
        else:
            found[k] = v
    return found


def whole_sha256(state):
    """The SHA-256 of the whole state, its tensors gathered whole, named as d2ldist's
    own format names them (``model.0.weight``, ``optimizer.state.model.0.weight.exp_avg``)."""
    tensors, values = {}, {}
    for k, v in state_dict(state, FULL).items():
        if isinstance(state[k], nn.Module):
            tensors.update({f'{k}.{name}': t for name, t in v.items()})
        elif isinstance(state[k], torch.optim.Optimizer):
            m = module_of(state, state[k], k)
            for fqn, entries in v['state'].items():
                for name, x in entries.items():
                    (tensors if torch.is_tensor(x) else values)[
                        f'{k}.state.{m}.{fqn}.{name}'] = x
            values[f'{k}.param_groups'] = [
                {**{g: x for g, x in group.items() if g != 'params'},
                 'params': sorted(f'{m}.{fqn}' for fqn in group['params'])}
                for group in v['param_groups']]
        else:
            (tensors if torch.is_tensor(v) else values)[k] = v
    return state_sha256(tensors, json.loads(json.dumps(values)))


def save(state, folder: Path):
    """Every worker's shards of ``state``, written by DCP into ``folder``."""
    dcp.save(state_dict(state), checkpoint_id=folder)


def manifest(size, sha):
    """What worker 0 writes beside DCP's files, last: the format, the workers, the hash."""
    return json.dumps({'format': FORMAT, 'workers': size, 'sha256': sha}, indent=1).encode()


def load(state, folder: Path):
    """Load the DCP checkpoint in ``folder`` into ``state``, resharded for this job's
    workers; (the workers that saved it, its SHA-256 now)."""
    try:
        layout = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f'{folder} holds no whole checkpoint ({MANIFEST}: '
                              f'{getattr(e, "strerror", None) or "not JSON"})') from None
    if not isinstance(layout, dict) or layout.get('format') != FORMAT:
        raise CheckpointError(f'{folder} holds no checkpoint of FSDP2 '
                              f'({MANIFEST} is not of format {FORMAT})')
    loaded = state_dict(state)
    try:
        dcp.load(loaded, checkpoint_id=folder)
    except CheckpointException as e:     # (each worker's error with its frames: the first)
        why = next(iter(e.failures.values()))
        raise CheckpointError(f'{folder} does not load into this state: '
                              f'{why[0] if isinstance(why, tuple) else why}') from None
    for k, v in state.items():
        if isinstance(v, nn.Module):
            set_model_state_dict(v, loaded[k])
        elif isinstance(v, torch.optim.Optimizer):
            set_optimizer_state_dict(state[module_of(state, v, k)], v, loaded[k])
        elif torch.is_tensor(v):
            v.copy_(loaded[k])
        else:
            state[k] = loaded[k]
    return layout['workers'], whole_sha256(state)
