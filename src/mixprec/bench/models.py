"""The workloads `mixprec bench` times: the seed blog's CNN, an MLP, a small transformer, or
a user's own model from a factory.

A workload is a model, a function making one synthetic batch of a given size, and a loss.
Built-in workloads are seeded, so every subprocess of a run builds the same weights and data.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.activations.options import RECOMPUTE
from mixprec.bench.factory import FactoryError, call_factory, load_factory, parse_reference

__all__ = [
    "BUILTIN_MODELS",
    "BlogCNN",
    "MLP",
    "TinyTransformer",
    "Workload",
    "activation_spec",
    "check_model",
    "check_workload",
    "find_blocks",
    "load_workload",
    "probabilities_nll",
]

BUILTIN_MODELS: tuple[str, ...] = ("cnn", "mlp", "transformer")
DEFAULT_BATCH_SIZES: dict[str, tuple[int, ...]] = {
    "cnn": (8, 16, 32),
    "mlp": (64, 128, 256),
    "transformer": (4, 8, 16),
}
DEFAULT_IMAGE_SIZE = 128
NUM_CLASSES = 10


@dataclass
class Workload:
    """One benchmark workload.

    `make_batch(batch_size)` returns `(inputs, targets)` as CPU tensors (or nested
    structures of them); `loss_fn(model(inputs), targets)` returns a scalar loss.
    """

    model: nn.Module
    make_batch: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Tensor]
    description: str


class BlogCNN(nn.Sequential):
    """The seed blog's Keras CNN in torch: conv 64 7x7/2 + relu + batchnorm, conv 128 11x11/2
    + relu + batchnorm, global average pool, dense 10, softmax ("same" padding as in Keras).

    It outputs probabilities, like the blog's model; the blog kept the softmax in float32,
    which mixprec's float32 island for softmax layers does by itself.
    """

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__(
            nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3),
            nn.ReLU(),
            nn.BatchNorm2d(64),
            nn.Conv2d(64, 128, kernel_size=11, stride=2, padding=5),
            nn.ReLU(),
            nn.BatchNorm2d(128),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, num_classes),
            nn.Softmax(dim=1),
        )


def probabilities_nll(probs: Tensor, targets: Tensor) -> Tensor:
    """Sparse categorical cross-entropy on probabilities, clipped at 1e-7 as Keras does."""
    return nn.functional.nll_loss(torch.log(probs.float().clamp_min(1e-7)), targets)


def _cnn(image_size: int) -> Workload:
    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1)
        x = torch.rand(batch_size, 3, image_size, image_size, generator=g)
        y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)
        return x, y

    return Workload(
        BlogCNN(),
        make_batch,
        probabilities_nll,
        f"blog CNN on synthetic {image_size}x{image_size} RGB images, Adam",
    )


class MLP(nn.Sequential):
    """1024-4096-4096-10 with ReLU: matmul-bound, the best case for low-precision compute."""

    def __init__(self, width: int = 4096, in_features: int = 1024) -> None:
        super().__init__(
            nn.Linear(in_features, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, NUM_CLASSES),
        )


def _mlp() -> Workload:
    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(batch_size, 1024, generator=g), torch.randint(
            0, NUM_CLASSES, (batch_size,), generator=g
        )

    return Workload(MLP(), make_batch, nn.functional.cross_entropy, "MLP 1024-4096-4096-10, Adam")


class TinyTransformer(nn.Module):
    """A small pre-norm transformer language model (embedding, encoder layers, LM head)."""

    def __init__(
        self, vocab: int = 1000, dim: int = 256, heads: int = 4, layers: int = 2, seq: int = 128
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.encoder(x)))


def _transformer() -> Workload:
    vocab, seq = 1000, 128

    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return Workload(
        TinyTransformer(vocab=vocab, seq=seq),
        make_batch,
        loss_fn,
        f"transformer LM (2 layers, dim 256, 4 heads, vocab {vocab}), {seq} tokens, Adam",
    )


def check_model_name(name: str) -> None:
    """Raise ValueError unless `name` is a built-in model or a `module:factory` reference."""
    if name in BUILTIN_MODELS:
        return
    try:
        parse_reference(name)
    except FactoryError:
        raise ValueError(
            f"unknown model {name!r}: use one of {', '.join(BUILTIN_MODELS)} or "
            "'module:factory' / 'path/to/file.py:factory' (a function returning "
            "(model, make_batch, loss_fn))"
        ) from None


def check_model(name: str) -> None:
    """Raise ValueError unless `name` is a built-in model or an importable callable factory
    (not called: see `check_workload`)."""
    check_model_name(name)
    if name not in BUILTIN_MODELS:
        load_factory(name)


def check_workload(name: str) -> None:
    """Raise ValueError unless model `name` gives a workload: a user's factory is called once
    (its model built and dropped, no batch made), so that a broken one stops a benchmark
    before any of its processes starts."""
    if name not in BUILTIN_MODELS:
        _from_factory(name)


def _from_factory(name: str) -> Workload:
    made = call_factory(load_factory(name), name)
    if isinstance(made, Workload):
        return made
    if not (isinstance(made, tuple) and len(made) == 3):
        raise FactoryError(
            f"model factory {name!r} must return (model, make_batch, loss_fn), "
            f"got {type(made).__name__}"
        )
    model, make_batch, loss_fn = made
    if not isinstance(model, nn.Module):
        raise FactoryError(
            f"model factory {name!r} returned {type(model).__name__} as the model, "
            "expected an nn.Module"
        )
    if not callable(make_batch) or not callable(loss_fn):
        raise FactoryError(
            f"model factory {name!r}: make_batch(batch_size) and loss_fn(outputs, targets) "
            "must be callables"
        )
    if len(inspect.signature(make_batch).parameters) < 1:
        raise FactoryError(f"model factory {name!r}: make_batch must take the batch size")
    return Workload(model, make_batch, loss_fn, f"{type(model).__name__} from {name}")


def load_workload(name: str, image_size: int = DEFAULT_IMAGE_SIZE, seed: int = 0) -> Workload:
    """Build workload `name` ("cnn", "mlp", "transformer" or "module:factory") with fixed
    seeds, so that every process of a run gets the same weights and data."""
    check_model_name(name)
    torch.manual_seed(seed)
    if name == "cnn":
        return _cnn(image_size)
    if name == "mlp":
        return _mlp()
    if name == "transformer":
        return _transformer()
    return _from_factory(name)


def find_blocks(model: nn.Module) -> list[str]:
    """The paths of `model`'s blocks, in order: in each outermost ``nn.ModuleList`` or
    ``nn.Sequential`` holding them, the entries of a type that comes two or more times and
    holds layers of its own (a transformer's layers; not the layers of a plain stack of
    Linear and ReLU)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if any(name == b or name.startswith(b + ".") for b in found):
            continue
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        entries = list(module.named_children())
        kinds = [type(child) for _, child in entries]
        found += [
            f"{name}.{entry}" if name else entry
            for entry, child in entries
            if kinds.count(type(child)) > 1 and next(iter(child.children()), None) is not None
        ]
    return found


def activation_spec(model: nn.Module, option: str) -> str | dict[str, str]:
    """What ``mixprec bench --activations option`` gives `model`: a recompute option
    (``checkpoint``, ``selective``) for each of its blocks (`find_blocks`), any other option
    for the whole model. ValueError when a recompute option finds no block."""
    if option not in RECOMPUTE:
        return option
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            f"--activations {option} recomputes each block of the model, and "
            f"{type(model).__name__} has none (no nn.ModuleList or nn.Sequential holding two "
            "or more modules of one type that hold layers of their own); give it per layer "
            "in a policy file's activation rules instead"
        )
    return {re.escape(path): option for path in blocks}
