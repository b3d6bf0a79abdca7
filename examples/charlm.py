"""A small GPT-style character (byte) language model trained on Python's own standard library.

Offline: the text is a fixed, sorted list of ``.py`` files of the running interpreter's
standard library, concatenated; the last 10% is held out for validation. (Other Python
versions ship slightly different files, so compare runs made with one interpreter.)

    python examples/charlm.py --precision bf16-mixed
    python examples/charlm.py --precision 16-mixed --allow-slow   # fp16 on a CPU without fp16
    python examples/charlm.py --precision 32-true --devices 2     # two processes (DDP, gloo)

Prints the validation loss (nats per byte) and bits per byte; ``--json PATH`` writes them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from mixprec import Precision
from mixprec.trainer import Callback, RunEstimate, Trainer, TrainingModule

# Modules present, under these names, in every CPython from 3.8 on.
STDLIB_FILES = (
    "argparse.py",
    "ast.py",
    "calendar.py",
    "configparser.py",
    "contextlib.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "locale.py",
    "pathlib.py" if sys.version_info < (3, 13) else "pathlib/_local.py",
    "pickle.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
    "zipfile.py" if sys.version_info < (3, 12) else "zipfile/__init__.py",
)


def stdlib_text() -> bytes:
    """The concatenated source of `STDLIB_FILES` (sorted), as UTF-8 bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    missing = [name for name in STDLIB_FILES if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"standard library files not found under {root}: {missing}")
    return b"\n".join((root / name).read_bytes() for name in sorted(STDLIB_FILES))


class Chunks(Dataset):
    """Consecutive ``block + 1``-byte windows of ``data``: inputs and next-byte targets."""

    def __init__(self, data: Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.data[i * self.block : (i + 1) * self.block + 1].long()
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharGPT(TrainingModule):
    """A GPT over bytes: token + position embeddings, blocks, tied output head."""

    def __init__(
        self,
        block: int = 128,
        dim: int = 256,
        layers: int = 4,
        heads: int = 4,
        lr: float = 2e-3,
        steps: int = 300,
    ) -> None:
        super().__init__()
        self.lr, self.steps = lr, steps
        self.tok = nn.Embedding(256, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)
        self.head.weight = self.tok.weight
        # GPT-2's small init: N(0, 1) embeddings tied to the head give huge initial logits
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch  # the loss in float32 also when the logits are 16-bit (a *-true run)
        return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, batch_size=len(batch[0]))
        self.log("val_bpb", loss / math.log(2), batch_size=len(batch[0]))

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        warmup = max(1, self.steps // 10)

        def schedule(step: int) -> float:  # linear warmup, then cosine to 10%
            if step < warmup:
                return (step + 1) / warmup
            done = min(1.0, (step - warmup) / max(1, self.steps - warmup))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def charlm_loaders(block: int, batch_size: int) -> tuple[DataLoader, DataLoader]:
    """Training and held-out (last 10%) loaders over the standard-library text."""
    data = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8)
    split = int(len(data) * 0.9)
    train = DataLoader(Chunks(data[:split], block), batch_size=batch_size, shuffle=True)
    val = DataLoader(Chunks(data[split:], block), batch_size=batch_size)
    return train, val


def median_rate(trainer: Trainer) -> float:
    """Median of the training throughput the Trainer logged (sequences/s, every 25 steps):
    robust to the bursts of a shared machine, unlike the whole run's time."""
    with open(trainer.run_dir / "metrics.csv") as f:
        rates = [float(r["samples_per_sec"]) for r in csv.DictReader(f) if r["samples_per_sec"]]
    return statistics.median(rates)


def run(
    precision: str,
    steps: int = 300,
    batch_size: int = 32,
    devices: int = 1,
    allow_slow: bool = False,
    root: str = "runs/charlm",
    seed: int = 0,
    width: int = 256,
    compensation: str | None = None,
    callbacks: list[Callback] | None = None,
) -> dict[str, object]:
    """Train for ``steps`` optimizer steps; return the held-out loss with timings.
    ``compensation`` ("kahan" or "stochastic") steps 16-bit weights without float32 masters
    (a ``*-true`` precision)."""
    torch.manual_seed(seed)
    block = 128
    train, val = charlm_loaders(block, batch_size)
    model = CharGPT(block=block, dim=width, steps=steps)
    spec = (
        precision
        if compensation is None
        else Precision(precision, compensation=compensation, allow_slow=allow_slow)
    )
    trainer = Trainer(
        precision=spec,
        devices=devices,
        max_steps=steps,
        log_every_n_steps=min(25, steps),  # throughput samples for median_rate
        val_check_interval=min(len(train), steps),
        limit_val_batches=40,
        default_root_dir=root,
        seed=seed,
        allow_slow_precision=allow_slow,
        # how long it will take, on stderr, after 3 batches (fp16 on a CPU: hours)
        callbacks=[RunEstimate(), *(callbacks or [])],
    )
    start = time.perf_counter()
    trainer.fit(model, train, val)
    fit_seconds = time.perf_counter() - start
    final = Trainer(
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=40,
        allow_slow_precision=allow_slow,
    ).validate(model, val)[0]
    return {
        "example": "charlm",
        "precision": trainer.policy.name,
        "compensation": compensation,
        "steps": trainer.global_step,
        "train_bytes": len(train.dataset) * block,
        "fit_seconds": round(fit_seconds, 2),
        "median_samples_per_sec": round(median_rate(trainer), 2),
        "val_loss": round(final["val_loss"], 4),
        "val_bpb": round(final["val_bpb"], 4),
        "python": sys.version.split()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="32-true", help="any mixprec precision spec")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--devices", type=int, default=1, help="processes (ddp when > 1)")
    parser.add_argument("--width", type=int, default=256, help="model width (4 heads)")
    parser.add_argument("--allow-slow", action="store_true", help="run fp16 without fp16 hardware")
    parser.add_argument(
        "--compensation",
        choices=["kahan", "stochastic"],
        help="compensated updates of 16-bit weights (with a *-true precision)",
    )
    parser.add_argument("--root", default="runs/charlm", help="logs and checkpoints go here")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    result = run(
        args.precision,
        args.steps,
        args.batch_size,
        args.devices,
        args.allow_slow,
        args.root,
        width=args.width,
        compensation=args.compensation,
    )
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
