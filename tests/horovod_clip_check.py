"""Run under `horovodrun -np 2`: clipping must see the synchronized (averaged) gradients.

Rank 0's gradient is (10, 0), rank 1's is (0, 0.1). Averaged: (5, 0.05), norm ~5; clipped to 1 that is
~(0.99995, 0.0099995). Clipping each rank first and then averaging would give (0.5, 0.05).
Plain SGD with lr 1 makes the step equal to the clipped gradient.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distributed import StepOptions, topology_from_env  # noqa: E402
from distributed.horovod_backend import HorovodBackend  # noqa: E402

backend = HorovodBackend(topology_from_env(), StepOptions(clip_grad_norm=1.0))
backend.setup()
model = torch.nn.Linear(2, 1, bias=False)
with torch.no_grad():
    model.weight.zero_()
model, opt, sched = backend.prepare(
    model,
    lambda m: torch.optim.SGD(m.parameters(), lr=1.0),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0),
)
x = torch.tensor([[10.0, 0.0]]) if backend.rank == 0 else torch.tensor([[0.0, 0.1]])
backend.backward(model(x).sum())  # d/dw = x
norm, _, _ = backend.step()
avg = torch.tensor([5.0, 0.05])
expected = -avg / avg.norm()
got = model.weight.detach().flatten()
assert torch.allclose(got, expected, atol=1e-5), f"rank {backend.rank}: step {got.tolist()} != {expected.tolist()}"
assert abs(norm.item() - avg.norm().item()) < 1e-4, norm
print(f"CLIP_OK rank {backend.rank}")
backend.teardown()
