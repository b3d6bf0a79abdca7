"""`mixprec doctor` on a Lightning `LightningModule`: the doctor asks its `training_step` for
the loss, as Lightning's Trainer would, on copies of the module (no Trainer needed).

The classifier reads raw counts in the thousands; its first projection reaches about 1e5,
beyond float16's max 65504, and a LayerNorm right after it makes that harmless in float32.

    python examples/doctor_lightning.py
    mixprec doctor examples/doctor_lightning.py:make --precision 16-mixed   # from the CLI
"""

from __future__ import annotations

import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.doctor import diagnose


class CountClassifier(pl.LightningModule):
    """Classifies vectors of raw counts; `training_step` logs and returns the loss."""

    def __init__(self, features: int = 8, width: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(features, width)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.mlp(self.norm(self.proj(x))))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make(batch_size: int = 32, seed: int = 0) -> tuple[CountClassifier, tuple[Tensor, Tensor]]:
    """The factory `mixprec doctor` calls: the module and a batch of (counts, labels)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = CountClassifier()
    x = 2_000 + 1_000 * torch.rand(batch_size, 8, generator=g)
    y = torch.randint(0, 4, (batch_size,), generator=g)
    with torch.no_grad():  # weights a trained model could have: outputs up to about 1e5
        model.proj.weight.mul_(1e5 / model.proj(x).abs().max())
    return model, (x, y)


def main() -> None:
    warnings.simplefilter("ignore")  # float16 is slow on most CPUs: fine for a diagnosis
    model, batch = make()
    diagnosis = diagnose(model, batch, precision="16-mixed")
    print(diagnosis)
    fix = diagnosis.recommend()
    print("recommended policy:\n" + fix.to_code())


if __name__ == "__main__":
    main()
