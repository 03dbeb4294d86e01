"""Run under mpiexec by tests/test_flight_recorder.py: a few DDP steps with DDP's own reducer and
with ``launcher.train``'s timed hook, from the same weights and data; prints one JSON line per
rank: both parameter hashes, how many backwards were recorded and the largest difference."""

import hashlib
import json

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import launcher
from launcher.faults import ddp_steps, flight_recorder
from launcher.training.gradient_sync import timed_allreduce


def train(model, job) -> torch.Tensor:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1 + job.rank)  # each rank its own batches
    for _ in range(5):
        inputs = torch.randn(16, 32, generator=data)
        optimizer.zero_grad()
        F.mse_loss(model(inputs), inputs[:, :8]).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


with launcher.distributed(backend="gloo", timeout_s=30) as job:
    own = train(DistributedDataParallel(net()), job)
    timed = DistributedDataParallel(net())
    timed.register_comm_hook([0.0], timed_allreduce)
    hooked = train(timed, job)
    steps = [e for e in flight_recorder.snapshot() if e["note"] == ddp_steps.NOTE]
    print(json.dumps({"rank": job.rank, "own": hashlib.sha256(own.numpy()).hexdigest(),
                      "hooked": hashlib.sha256(hooked.numpy()).hexdigest(),
                      "steps": len(steps),
                      "max_difference": (own - hooked).abs().max().item()}), flush=True)
