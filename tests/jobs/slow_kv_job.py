"""Push and pull through the parameter server for a few seconds (test_faults.py)."""
import time

import torch

import d2ldist

kv = d2ldist.kv.create('dist_sync')
kv.init(['a', 'b'], [torch.zeros(1000), torch.zeros(10)])
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    kv.pushpull(['a', 'b'], [torch.ones(1000), torch.ones(10)],
                out=[torch.empty(1000), torch.empty(10)])
    time.sleep(0.01)
print('done', flush=True)
