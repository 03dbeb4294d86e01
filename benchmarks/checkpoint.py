"""Checkpoint save and load time and file size for the built-in models, one process.

    .venv/bin/python -m benchmarks.checkpoint --json benchmarks/results/checkpoint.json

The state is what ``launcher.train`` writes: model, SGD optimizer with momentum buffers, LR
scheduler, GradScaler, position and the RNG states of 2 ranks. "save" is the whole atomic write
(serialise, SHA-256, temp file, fsync, rename, directory fsync); "load" reads, verifies the
checksum and deserialises. Best of several rounds: the least noisy estimate on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from launcher.api import checkpoint
from launcher.training.models import build_model  # noqa: E402


def trainer_state(model: str) -> dict:
    spec = build_model(model, 10, dropout=0.1)
    optimizer = torch.optim.SGD(spec.module.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    images = torch.rand(8, 1, 28, 28)
    out = spec.module(images)
    loss = F.mse_loss(out, images) if spec.task == "reconstruct" else out.logsumexp(1).mean()
    loss.backward()
    optimizer.step()  # momentum buffers exist from here on, as in every real checkpoint
    scheduler.step()
    rng = checkpoint.capture_rng(torch.device("cpu"))
    return {"format": 1, "step": 1, "epoch": 0, "batch": 1, "world_size": 2, "config": {},
            "model": spec.module.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
            "rng": [rng, rng]}


def best_of(rounds: int, op) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per measurement")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for model in ("mlp", "autoencoder", "cnn"):
            state = trainer_state(model)
            params = sum(t.numel() for t in state["model"].values())
            save = best_of(args.rounds, lambda s=state: checkpoint.save(directory, 1, s, keep=1))
            path = directory / checkpoint.checkpoint_name(1)
            load = best_of(args.rounds, lambda p=path: checkpoint.load(p))
            rows.append({"model": model, "parameters": params, "bytes": path.stat().st_size,
                         "save_ms": 1e3 * save, "load_ms": 1e3 * load})
    print(f"{'model':>12} {'params':>9} {'file KiB':>9} {'save ms':>8} {'load ms':>8}")
    for r in rows:
        print(f"{r['model']:>12} {r['parameters']:>9} {r['bytes'] / 1024:>9.1f} "
              f"{r['save_ms']:>8.2f} {r['load_ms']:>8.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
