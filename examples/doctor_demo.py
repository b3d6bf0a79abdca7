"""`mixprec doctor` on a model that trains in float32 and breaks in float16.

The model reads raw sensor values (in the tens of thousands), so its input projection
produces activations beyond float16's max 65504; a LayerNorm right after it makes this
harmless in float32. It then pools the sequence with a sharp attention whose softmax was
written by hand, without subtracting the max, so `exp` overflows in float16 as well.

    python examples/doctor_demo.py                 # diagnose, fix, and train three ways
    mixprec doctor examples/doctor_demo.py:make --precision 16-mixed   # the same from the CLI
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.doctor import diagnose
from mixprec.optim.scaling import LossScaleDivergedError
from mixprec.precision import Precision


class NaiveSoftmax(nn.Module):
    """softmax(x) = exp(x) / sum(exp(x)), without the usual max subtraction."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        e = x.exp()
        return e / e.sum(self.dim, keepdim=True)


class AttentionPool(nn.Module):
    """Weighted mean over the sequence; the weights compare each step with a learned query
    at a low temperature (sharp attention), so the scores are large."""

    def __init__(self, dim: int, temperature: float = 0.25) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(dim) / temperature)
        self.softmax = NaiveSoftmax(dim=1)

    def forward(self, h: Tensor) -> Tensor:
        weights = self.softmax(h @ self.query)
        return (weights.unsqueeze(-1) * h).sum(1)


class SensorNet(nn.Module):
    """Classifies sequences of raw sensor readings (batch, time, channels)."""

    def __init__(self, channels: int = 8, dim: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(channels, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.pool = AttentionPool(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.inp(x))
        h = h + self.mlp(h)
        return self.head(self.pool(h))


def make(
    batch_size: int = 64, steps: int = 32, seed: int = 0
) -> tuple[nn.Module, tuple[Tensor, Tensor], object]:
    """The factory `mixprec doctor` calls: a model, a batch of `batch_size` sequences of
    `steps` readings, and a loss function."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = SensorNet()
    labels = torch.randint(0, 4, (batch_size,), generator=g)
    # readings of 30000-60000 counts; the class raises the level of channel `label`
    x = 30_000 + 25_000 * torch.rand(batch_size, steps, 8, generator=g)
    x[torch.arange(batch_size), :, labels] += 5_000
    return model, (x, labels), F.cross_entropy


def train(model: nn.Module, batch: tuple[Tensor, Tensor], policy: object, steps: int) -> float:
    """Train on one batch for `steps` steps under `policy`; the last loss (NaN if diverged)."""
    precision = Precision(policy, allow_slow=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = precision.setup(model, optimizer)
    x, y = batch
    loss = torch.tensor(math.nan)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        precision.backward(loss)
        precision.step(optimizer)
    return float(loss.detach())


def main() -> None:
    warnings.simplefilter("ignore")  # float16 is slow on most CPUs: fine for a diagnosis
    model, batch, loss_fn = make()
    diagnosis = diagnose(model, batch, loss_fn, precision="16-mixed")
    print(diagnosis)
    fix = diagnosis.recommend()
    print("recommended policy:\n" + fix.to_code())
    for name, policy in (
        ("32-true", "32-true"),
        ("16-mixed", "16-mixed"),
        ("recommended", fix.policy),
    ):
        net, batch, _ = make()
        try:
            final = train(net, batch, policy, steps=30)
        except LossScaleDivergedError as err:
            final = math.nan
            print(f"{name:>12}: diverged ({str(err)[:60]}...)")
            continue
        print(f"{name:>12}: loss after 30 steps {final:.4f}")


if __name__ == "__main__":
    main()
