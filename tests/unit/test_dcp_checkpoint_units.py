"""d2ldist.checkpoint for FSDP2 (training/dcp_checkpoint.py) without processes: its
SHA-256, taken through torch's get_state_dict, is d2ldist's own format's; a folder of
one format loaded as the other is one line. tests/jobs/test_sharded_checkpoint.py saves FSDP2
among real workers and loads it in plain PyTorch."""
import json

import pytest
import torch
import torch.distributed.checkpoint

import d2ldist
from d2ldist.training import dcp_checkpoint
from d2ldist.training.checkpoint import CheckpointError
from d2ldist.training.state_hash import state_sha256

from test_sharded_checkpoint_units import steps
from test_sharded_units import OPTIMIZERS, mlp


def test_the_hash_through_get_state_dict_is_d2ldists_own_formats(tmp_path):
    """The same plain state, hashed from d2ldist's pieces and from torch's full state
    dicts: the same SHA-256 (so an FSDP2 job's line compares with any other's)."""
    net = mlp()
    opt = OPTIMIZERS['adam'](list(net.parameters()))
    steps(net, opt, 0, 1, 0, 3)
    state = {'model': net, 'optimizer': opt, 'step': 3, 'seen': torch.arange(4)}
    assert not dcp_checkpoint.holds_fsdp2(state)
    assert dcp_checkpoint.whole_sha256(state) == d2ldist.checkpoint.save(state, tmp_path)


def test_a_tensor_and_its_bytes_hash_alike():
    t = torch.linspace(0, 1, 6, dtype=torch.float64).view(2, 3)
    assert state_sha256({'t': t}, {'n': 1}) == state_sha256(
        {'t': ('float64', [2, 3], t.numpy().tobytes())}, {'n': 1})
    assert state_sha256({'t': t}, {'n': 1}) != state_sha256({'t': t.T.contiguous()}, {'n': 1})


def test_one_format_loaded_as_the_other_is_one_line(tmp_path):
    net = mlp()
    state = {'model': net, 'optimizer': OPTIMIZERS['adam'](list(net.parameters()))}
    sha = d2ldist.checkpoint.save(state, tmp_path)
    with pytest.raises(CheckpointError, match=f'^{tmp_path} holds no checkpoint of FSDP2 '):
        dcp_checkpoint.load(state, tmp_path)
    (tmp_path / 'manifest.json').write_text(json.dumps(
        {'format': dcp_checkpoint.FORMAT, 'workers': 2, 'sha256': sha}))
    with pytest.raises(CheckpointError, match='is not a checkpoint of format 1$'):
        d2ldist.checkpoint.load(state, tmp_path)


@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
def test_a_dcp_folder_that_does_not_fit_the_state_is_one_line(tmp_path):
    """DCP's own error (a tensor the folder lacks), said in one line."""
    torch.distributed.checkpoint.save({'model': {'0.weight': torch.zeros(7, 5)}},
                                      checkpoint_id=tmp_path)
    (tmp_path / 'manifest.json').write_bytes(dcp_checkpoint.manifest(1, 'sha'))
    with pytest.raises(CheckpointError, match=f'^{tmp_path} does not load into this state: '
                       r'Missing key in checkpoint state_dict: model\.0\.bias\.$'):
        dcp_checkpoint.load({'model': mlp()}, tmp_path)
