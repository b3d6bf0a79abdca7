"""The bench's transformer with its loss computed in chunks: a `mixprec bench` factory that
shows what caps the activation options' gains on the bench's own transformer
(benchmarks/results/activation_memory.md).

The bench's transformer returns float32-cast logits over a vocabulary of 1000 at every
position; the loss's log-softmax keeps them, and the backward adds their gradient twice:
about 1.5 MiB a sample at the start of the backward, more than the encoder layers save, and
outside every layer's activation option. Here the same model (the same seeded weights, the
same batches) takes the targets as an input and computes the output head and the loss over
`ROWS` positions at a time, each chunk recomputed in the backward (torch's non-reentrant
checkpointing), as language models with large vocabularies do (chunked cross-entropy): one
chunk's logits are alive at a time. The loss is the same sum; the encoder layers are the
bench's, so ``--activations`` acts on the same blocks (``inner.encoder.layers.0`` and ``.1``).

    mixprec bench --model benchmarks/activation_chunked_loss.py:make --precision bf16-mixed \\
        --activations fp8 checkpoint --batch-sizes 8 --max-batch --memory-limit 128MiB ...
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mixprec.bench.models import TinyTransformer, Workload, load_workload

# positions whose logits one chunk of the loss computes
ROWS = 256


class ChunkedLoss(nn.Module):
    """`inner`'s forward and the mean cross-entropy of its logits, the head and the loss
    computed (and recomputed in the backward) `ROWS` positions at a time."""

    def __init__(self, inner: TinyTransformer) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, targets = batch
        m = self.inner
        x = m.embed(tokens) + m.pos[: tokens.shape[1]]
        hidden = m.norm(m.encoder(x)).flatten(0, 1)
        flat = targets.flatten()
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, t in zip(hidden.split(ROWS), flat.split(ROWS), strict=True):
            total = total + checkpoint(self._chunk, h, t, use_reentrant=False)
        return total / flat.numel()

    def _chunk(self, hidden: Tensor, targets: Tensor) -> Tensor:
        logits = self.inner.head(hidden).float()
        return F.cross_entropy(logits, targets, reduction="sum")


def make() -> Workload:
    """The bench's transformer, its loss in chunks: batches ``((tokens, targets), targets)``,
    the model's output the loss itself."""
    work = load_workload("transformer")

    def make_batch(n: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        tokens, targets = work.make_batch(n)
        return (tokens, targets), targets

    return Workload(
        ChunkedLoss(work.model),
        make_batch,
        lambda loss, _: loss,
        f"{work.description}; head and loss in chunks of {ROWS} positions, recomputed",
    )
