"""A small CNN on scikit-learn's bundled 8x8 handwritten digits, in any precision.

Offline: the 1,797 images ship inside scikit-learn. The split (1,257 train / 270 validation /
270 test) is fixed by a seed, so runs in different precisions see the same data.

    python examples/digits.py --precision bf16-mixed
    python examples/digits.py --precision 16-mixed --allow-slow   # fp16 on a CPU without fp16
    python examples/digits.py --precision 32-true --devices 2     # two processes (DDP, gloo)

Prints the test accuracy; ``--json PATH`` also writes it with the timings.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec.trainer import RunEstimate, Trainer, TrainingModule

try:
    from sklearn.datasets import load_digits
except ImportError:
    raise SystemExit(
        "examples/digits.py reads scikit-learn's bundled digits: "
        'pip install "torch==2.13.0" -e ".[examples]"'
    ) from None


class DigitsCNN(TrainingModule):
    """Three 3x3 conv blocks with batch norm, global average pooling, a linear classifier."""

    def __init__(self, width: int = 64, lr: float = 3e-3, epochs: int = 20) -> None:
        super().__init__()
        self.lr, self.epochs = lr, epochs

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()
            )

        self.features = nn.Sequential(
            block(1, width),
            block(width, width),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            block(width, 2 * width),
            block(2 * width, 2 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * width, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

    def _step(self, batch: tuple[Tensor, Tensor], prefix: str) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log(f"{prefix}_loss", loss, batch_size=len(y))
        self.log(f"{prefix}_acc", acc, prog_bar=prefix == "val", batch_size=len(y))
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.epochs)
        return {"optimizer": opt, "lr_scheduler": sched}


def digits_loaders(batch_size: int, seed: int = 0) -> tuple[DataLoader, DataLoader, DataLoader]:
    """Train/validation/test loaders over the 8x8 digits, pixels scaled to [0, 1]."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    parts = order[:1257], order[1257:1527], order[1527:]

    def loader(idx: Tensor, shuffle: bool) -> DataLoader:
        return DataLoader(TensorDataset(x[idx], y[idx]), batch_size=batch_size, shuffle=shuffle)

    return loader(parts[0], True), loader(parts[1], False), loader(parts[2], False)


def median_rate(trainer: Trainer) -> float:
    """Median of the training throughput the Trainer logged (samples/s, every 10 steps):
    robust to the bursts of a shared machine, unlike the whole run's time; NaN when the
    run logged none."""
    with open(trainer.run_dir / "metrics.csv") as f:
        rates = [float(r["samples_per_sec"]) for r in csv.DictReader(f) if r.get("samples_per_sec")]
    return statistics.median(rates) if rates else math.nan


def run(
    precision: str,
    epochs: int = 20,
    batch_size: int = 64,
    devices: int = 1,
    allow_slow: bool = False,
    root: str = "runs/digits",
    seed: int = 0,
    width: int = 64,
) -> dict[str, object]:
    """Train, test, and return the test metrics with wall-clock times."""
    torch.manual_seed(seed)
    train, val, test = digits_loaders(batch_size, seed)
    model = DigitsCNN(width=width, epochs=epochs)
    trainer = Trainer(
        precision=precision,
        devices=devices,
        max_epochs=epochs,
        # 2 rows an epoch: throughput samples for median_rate (a shorter run logs its first)
        log_every_n_steps=min(10, epochs * len(train)),
        default_root_dir=root,
        seed=seed,
        allow_slow_precision=allow_slow,
        callbacks=[RunEstimate()],  # how long it will take, on stderr, after 3 batches
    )
    start = time.perf_counter()
    trainer.fit(model, train, val)
    fit_seconds = time.perf_counter() - start
    tested = Trainer(
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        allow_slow_precision=allow_slow,
    ).test(model, test)[0]
    return {
        "example": "digits",
        "precision": trainer.policy.name,
        "epochs": epochs,
        "steps": trainer.global_step,
        "fit_seconds": round(fit_seconds, 2),
        "median_samples_per_sec": round(median_rate(trainer), 1),
        "test_acc": round(tested["test_acc"], 4),
        "test_loss": round(tested["test_loss"], 4),
        "val_acc": round(trainer.callback_metrics["val_acc"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="32-true", help="any mixprec precision spec")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--devices", type=int, default=1, help="processes (ddp when > 1)")
    parser.add_argument("--width", type=int, default=64, help="channels of the first convs")
    parser.add_argument("--allow-slow", action="store_true", help="run fp16 without fp16 hardware")
    parser.add_argument("--root", default="runs/digits", help="logs and checkpoints go here")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    result = run(
        args.precision,
        args.epochs,
        args.batch_size,
        args.devices,
        args.allow_slow,
        args.root,
        width=args.width,
    )
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
