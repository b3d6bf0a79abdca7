"""The summary's memory row: the peak of tensor memory at an optimizer step (measured as
the bench measures it) with the parts a user can act on, and the process's resident memory
labelled as such; a feature that saves memory shows it there."""

from __future__ import annotations

import io
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import QUIET

from mixprec.trainer import Trainer

ROW = re.compile(
    r"(?P<peak>[\d.,]+) MiB of tensors at a step \(weights (?P<weights>[\d.,]+) MiB, "
    r"gradients (?P<gradients>[\d.,]+) MiB, optimizer states (?P<states>[\d.,]+) MiB, "
    r"activations and temporaries (?P<activations>[\d.,]+) MiB\); "
    r"(?P<resident>[\d,]+) MiB resident \(the whole process\)"
)


def _memory(states: str | None) -> dict[str, float]:
    """The memory row of a 2-step fit of 16 Linear(384, 384) layers with AdamW, its states in
    `states`: 2.4M parameters, whose float32 moments (18 MiB) outweigh what a low-bit step
    holds meanwhile whatever the model's size: one flat update's float32 copies and decoded
    moments (`optim.states.buckets.FLAT_MAX` elements), or, eager (no C++ compiler), the
    temporaries of the largest parameter's update."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(384, 384) for _ in range(16)])
    x = torch.randn(8, 384)
    t = Trainer(max_steps=2, optimizer_states=states, **QUIET)
    t.fit(model, DataLoader(TensorDataset(x, x), batch_size=4), loss_fn=F.mse_loss)
    match = ROW.fullmatch(t.summary()["peak memory"])
    assert match, t.summary()["peak memory"]
    return {k: float(v.replace(",", "")) for k, v in match.groupdict().items()}


def test_the_summary_shows_what_int8_optimizer_states_save_in_tensor_memory():
    """The process's resident memory hid it (it grows with int8 states: the kernels and
    tables loaded); the tensor peak of the second step and the optimizer states' part show
    the saving."""
    full, int8 = _memory(None), _memory("int8")
    weights = 16 * (384 * 384 + 384) * 4 / 2**20
    assert full["weights"] == int8["weights"] == round(weights, 2)
    assert full["gradients"] == int8["gradients"] == round(weights, 2)
    assert full["states"] == round(2 * weights, 2)  # AdamW's two float32 moments
    assert int8["states"] < full["states"] / 2
    assert int8["peak"] < full["peak"]
    for parts in (full, int8):
        assert parts["peak"] >= parts["weights"] + parts["gradients"] + parts["states"] - 0.02
        assert parts["resident"] > parts["peak"]


def test_the_progress_bar_says_when_the_first_step_may_compile_a_low_bit_optimizer():
    """A low-bit optimizer's first step compiles its update (seconds, once per process): the
    bar says so until that batch ends, and says nothing of the kind for an optimizer that
    does not compile."""
    from types import SimpleNamespace

    from rich.console import Console

    from mixprec.optim.states import LowBitAdamW
    from mixprec.trainer import RichProgressBar
    from mixprec.trainer.progress import COMPILING, compiles_first_step

    params = [nn.Parameter(torch.zeros(64, 64))]
    compiling, eager = LowBitAdamW(params, compile=True), LowBitAdamW(params, compile=False)
    assert compiles_first_step(compiling, "cpu") and not compiles_first_step(eager, "cpu")
    assert not compiles_first_step(LowBitAdamW(params), "cpu")  # too small to choose it
    assert not compiles_first_step(torch.optim.AdamW(params), "cpu")
    # float32 moments of float32 parameters take torch's fused kernel: nothing to build;
    # a non-contiguous one is stepped alone from a copy, by the compiled update
    assert not compiles_first_step(LowBitAdamW(params, states="float32", compile=True), "cpu")
    transposed = [nn.Parameter(torch.zeros(64, 64).t())]
    assert compiles_first_step(LowBitAdamW(transposed, states="float32", compile=True), "cpu")

    def shown(optimizer: torch.optim.Optimizer) -> tuple[str, str]:
        out = io.StringIO()
        console = Console(file=out, force_terminal=True, width=200, color_system=None)
        bar = RichProgressBar(console=console, refresh_seconds=0.0)
        trainer = SimpleNamespace(
            is_global_zero=True,
            max_epochs=1,
            current_epoch=0,
            num_training_batches=2,
            batches_done=0,
            strategy=SimpleNamespace(device=torch.device("cpu")),
            optimizers=[optimizer],
            progress_metrics=lambda: {"loss": 1.0},
        )
        bar.on_fit_start(trainer, None)
        bar.on_train_epoch_start(trainer, None)
        before = out.getvalue()
        bar.on_train_batch_end(trainer, None, None, None, 0)
        bar._progress.refresh()
        after = out.getvalue()[len(before) :]
        bar._stop()
        return before, after

    before, after = shown(compiling)
    assert COMPILING in before and COMPILING not in after and "loss 1" in after
    assert COMPILING not in "".join(shown(eager))


def test_the_gate_counts_a_step_s_elements_and_the_bar_asks_the_wrapped_optimizer():
    """Whether a first step compiles is the engine's gate's answer for the whole step (many
    parameters of a few thousand elements add up), for the low-bit updates and the
    compensated steps of torch's optimizers alike; the Trainer's bar asks the optimizer it
    holds (a LossScaleOptimizer), which answers for its compensation too."""
    from mixprec.optim import LossScaleOptimizer
    from mixprec.optim.engine import COMPILE_MIN_ELEMENTS, can_compile
    from mixprec.optim.states import LowBitAdamW
    from mixprec.trainer.progress import compiles_first_step

    pieces = COMPILE_MIN_ELEMENTS // 4096
    many = [nn.Parameter(torch.zeros(4096)) for _ in range(pieces)]  # each under the gate's size
    assert LowBitAdamW(many, min_size=1).compiles("cpu") == can_compile("cpu")
    assert not LowBitAdamW(many[:-1], min_size=1).compiles("cpu")  # one parameter fewer
    halves = [nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16)) for _ in range(pieces)]
    wrapped = LossScaleOptimizer(torch.optim.AdamW(halves), compensation="kahan")
    assert compiles_first_step(wrapped, "cpu") == can_compile("cpu")
    small = LossScaleOptimizer(torch.optim.AdamW(halves[:-1]), compensation="kahan")
    assert not compiles_first_step(small, "cpu")
    assert not compiles_first_step(LossScaleOptimizer(torch.optim.AdamW(many)), "cpu")
