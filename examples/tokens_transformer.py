"""A small transformer on token sequences of its own, trained with DDP under any launcher.

    mpiexec -n 2 python examples/tokens_transformer.py --run-dir runs/tokens
    srun --mpi=pmi2 -n 2 python examples/tokens_transformer.py --run-dir runs/tokens
    torchrun --nproc-per-node 2 examples/tokens_transformer.py --run-dir runs/tokens
    python examples/tokens_transformer.py --run-dir runs/tokens

Nothing here is tied to the launcher's built-in 28x28 digits: the dataset and the model are this
file's own; copy it and change both. ``launcher.distributed`` gives the rest: the process group
(``--backend auto|gloo|nccl|mpi``), this rank's device, checkpoints with every rank's RNG state,
preemption (SIGUSR1 or SIGTERM on any rank: a checkpoint, exit 75; run the same command again
and it continues bit-exact, or on another number of ranks by global sample), and an exception on
one rank ending every rank at once.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import launcher


class CountingSequences(Dataset):
    """Token sequences that count up by a step of their own, modulo the vocabulary: the model
    learns to continue them. Inputs are tokens 0..L-1, targets tokens 1..L."""

    def __init__(self, size: int, length: int, vocab: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab, (size, 1), generator=generator)
        step = torch.randint(1, 4, (size, 1), generator=generator)
        self.tokens = (start + step * torch.arange(length + 1)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index, :-1], self.tokens[index, 1:]


class TinyTransformer(nn.Module):
    """A causal transformer encoder: embeddings, two layers, a head over the vocabulary."""

    def __init__(self, vocab: int, length: int, width: int = 64, heads: int = 4,
                 layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.encoder(self.embed(tokens) + self.position[:length], mask=mask,
                              is_causal=True)
        return self.head(hidden)


def build_model(vocab: int, length: int) -> nn.Module:
    return TinyTransformer(vocab, length)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/tokens"))
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def parameter_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    vocab, length = 50, 32
    with launcher.distributed(args.backend) as job:
        data = CountingSequences(4096, length, vocab)
        # each step's global batch is the same samples on any number of ranks: a checkpoint
        # resumes on another world size by its global sample position. A batch that does not
        # divide is a LaunchError on every rank; agree() makes it one clean message per rank
        with job.agree():
            batches = launcher.GlobalBatchSampler(len(data), args.global_batch_size, job.rank,
                                                  job.world_size, seed=args.seed)
        # a generator of its own: a loader draws a seed from torch's global one for every
        # epoch's iterator, which would shift the dropout stream of a resumed run
        loader = DataLoader(data, batch_sampler=batches,
                            generator=torch.Generator().manual_seed(args.seed))
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = build_model(vocab, length).to(job.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        torch.manual_seed(args.seed + 1 + job.rank)  # each rank its own dropout stream
        checkpoints = args.run_dir / "checkpoints"
        step = 0
        state = job.resume(checkpoints)  # None on a fresh start; RNG states restored
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
            job.print(f"resumed at step {step}")
        ddp = DistributedDataParallel(model, device_ids=job.device_ids)

        def save() -> Path:
            return job.save(checkpoints, step, {"model": model.state_dict(),
                                                "optimizer": optimizer.state_dict()},
                            samples=step * args.global_batch_size)

        while step < args.steps:
            batches.start_at(step * args.global_batch_size)  # the rest of this step's epoch
            for inputs, targets in loader:
                if job.preempted():  # every rank the same answer, at this step boundary
                    job.exit_preempted(save())
                if step == args.steps:
                    break
                logits = ddp(inputs.to(job.device))
                loss = F.cross_entropy(logits.flatten(0, 1), targets.to(job.device).flatten())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                if step % args.log_every == 0:
                    job.print(f"step {step} loss {loss.item():.4f}")
                if step % args.checkpoint_every == 0:
                    save()
        save()
        print(f"param-sha256 rank={job.rank} {parameter_digest(model)}", flush=True)


if __name__ == "__main__":
    main()
