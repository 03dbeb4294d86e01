"""The classic DDP script: a Dataset, DistributedSampler, DDP, rank-0 logging and checkpoints.

    mpiexec -n 2 python examples/classic_loop.py --run-dir runs/classic
    srun --mpi=pmi2 -n 2 python examples/classic_loop.py --run-dir runs/classic
    torchrun --nproc-per-node 2 examples/classic_loop.py --run-dir runs/classic
    python examples/classic_loop.py --run-dir runs/classic

The loop the tutorials write, without their per-launcher RANK/MASTER_ADDR plumbing:
``launcher.distributed`` replaces it, and adds what they leave out (preemption with a bit-exact
resume, atomic checkpoints, one rank's exception ending every rank). Replace ``make_dataset``
and ``Classifier`` with yours.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import launcher


def make_dataset(size: int = 4096, features: int = 20, classes: int = 4) -> TensorDataset:
    """Points labelled by a fixed random linear rule: learnable, and no download."""
    generator = torch.Generator().manual_seed(0)
    points = torch.randn(size, features, generator=generator)
    labels = (points @ torch.randn(features, classes, generator=generator)).argmax(1)
    return TensorDataset(points, labels)


class Classifier(nn.Module):
    def __init__(self, features: int = 20, classes: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(64, classes))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.net(points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/classic"))
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-per-rank", type=int, default=32)
    args = parser.parse_args()
    checkpoints = args.run_dir / "checkpoints"

    with launcher.distributed(args.backend) as job:
        dataset = make_dataset()
        sampler = DistributedSampler(dataset, job.world_size, job.rank, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=args.batch_per_rank, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)  # the same initial weights on every rank
        model = Classifier().to(job.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        torch.manual_seed(1 + job.rank)  # each rank its own dropout stream
        first_epoch, done = 0, 0
        state = job.resume(checkpoints)
        with job.agree():  # every rank raises it: agree() marks it so, nobody reports twice
            if state is not None and state["world_size"] != job.world_size:
                # DistributedSampler's batches are per rank: their position means nothing on
                # another number of ranks (GlobalBatchSampler's do, see tokens_transformer)
                raise launcher.LaunchError(
                    f"{checkpoints} holds a run of {state['world_size']} ranks, this one has "
                    f"{job.world_size}", hint=f"resume with {state['world_size']} ranks")
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            first_epoch, done = state["epoch"], state["batch"]
        ddp = DistributedDataParallel(model, device_ids=job.device_ids)

        for epoch in range(first_epoch, args.epochs):
            sampler.set_epoch(epoch)
            for batch, (points, labels) in enumerate(loader):
                if batch < done:
                    continue  # consumed before the preemption
                if job.preempted():
                    path = job.save(checkpoints, epoch * len(loader) + batch, {
                        "epoch": epoch, "batch": batch, "model": model.state_dict(),
                        "optimizer": optimizer.state_dict()})
                    job.exit_preempted(path)
                loss = F.cross_entropy(ddp(points.to(job.device)), labels.to(job.device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            done = 0
            job.print(f"epoch {epoch} loss {loss.item():.4f}")
            job.save(checkpoints, (epoch + 1) * len(loader), {
                "epoch": epoch + 1, "batch": 0, "model": model.state_dict(),
                "optimizer": optimizer.state_dict()})
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()[:16]
        print(f"param-sha256 rank={job.rank} {digest}", flush=True)


if __name__ == "__main__":
    main()
