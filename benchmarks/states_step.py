"""Low-bit optimizer states: state bytes and optimizer-step time against torch's AdamW.

Two MLPs get gradients once: ``small`` (64-256-256-32, three weights quantized, the biases
float32 as ``min_size`` keeps them) and ``large`` (~4.2M parameters: three 1024x1024
Linear layers and a 1024x1000 head). Then torch's ``AdamW(foreach=True)`` and mixprec's
optimizers at their defaults (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``, and
``LowBitAdamW(states="float32")``; ``compile=None``, so each decides whether to compile)
take turns stepping, after warm-up steps that include the first call's build. Each step is
timed in CPU time of the stepping thread on one thread (``torch.set_num_threads(1)``),
which waiting on a busy host does not inflate; the table gives the fastest, the lower
quartile and the median of ``--steps`` steps, the median against torch's, the median of the
rounds' paired ratios (each step over torch's step of the same round, with their quartiles),
and the state bytes (`mixprec.optim.states.state_bytes`, scales included) against torch's.

With ``--dtype bfloat16`` the models are pure bfloat16 (parameters and gradients), torch's
AdamW steps them as they are, and ``--compensation kahan`` or ``stochastic`` gives mixprec's
optimizers that write-back. Two more rows then take their turns: mixprec's compensated step
of torch's own AdamW (`mixprec.optim.compensated.Compensator`, the pure-bfloat16 path of
``Precision("bf16-true", compensation=...)``: its moments bfloat16, as torch keeps them for
bfloat16 parameters) and, with ``kahan``, torch-optimi's ``AdamW(kahan_sum=True)`` where it is
installed (what a user would pick instead; its moments bfloat16 too). Those two hold the
same state bytes and compare like for like; ``LowBitAdamW('float32')`` with a compensation
keeps float32 moments beside bfloat16 weights (2.5 times torch's bytes) and moves that much
more memory a step.

    python benchmarks/states_step.py [--models small large] [--steps 41]
        [--compile {none,true,false}] [--dtype {float32,bfloat16}]
        [--compensation {kahan,stochastic}]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from mixprec.optim.compensated import Compensator
from mixprec.optim.states import AdamW4bit, AdamW8bit, AdamWFp8, LowBitAdamW, state_bytes

_OPTIMIZERS = {
    "AdamW8bit": AdamW8bit,
    "AdamW4bit": AdamW4bit,
    "AdamWFp8": AdamWFp8,
    "LowBitAdamW('float32')": lambda params, **kw: LowBitAdamW(params, states="float32", **kw),
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "small":
        return nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 32))
    return nn.Sequential(
        nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1000)
    )


OPTIMI = "torch-optimi AdamW(kahan_sum=True)"
COMPENSATED = "Compensator(torch AdamW)"


class _Compensated:
    """torch's AdamW stepped by mixprec's `Compensator` (``step()`` as an optimizer's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str) -> None:
        self.optimizer = optimizer
        self.compensator = Compensator(kind, seed=0)
        self.state = optimizer.state
        self.param_groups = optimizer.param_groups

    def step(self) -> None:
        self.compensator.step(self.optimizer)


def _optimizer(
    model_name: str,
    kind: str,
    compile: bool | None,
    dtype: torch.dtype = torch.float32,
    compensation: str | None = None,
) -> torch.optim.Optimizer:
    model = _model(model_name).to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), foreach=True)
    if kind == OPTIMI:
        import optimi

        return optimi.AdamW(model.parameters(), lr=1e-3, kahan_sum=True, foreach=True)
    if kind == COMPENSATED:
        return _Compensated(torch.optim.AdamW(model.parameters()), compensation)  # type: ignore[return-value]
    return _OPTIMIZERS[kind](model.parameters(), compile=compile, compensation=compensation)


def _kinds(compensation: str | None) -> list[str]:
    """torch's AdamW; with a compensation mixprec's compensated step of torch's AdamW and
    torch-optimi's Kahan AdamW beside mixprec's Kahan steps where it is installed; then
    mixprec's optimizers."""
    kinds = ["torch"]
    if compensation is not None:
        kinds.append(COMPENSATED)
    if compensation == "kahan":
        try:
            import optimi  # noqa: F401
        except ImportError:
            print("(torch-optimi is not installed: its Kahan AdamW is left out)")
        else:
            kinds.append(OPTIMI)
    return [*kinds, *_OPTIMIZERS]


def _table(
    model_name: str,
    steps: int,
    compile: bool | None,
    dtype: torch.dtype = torch.float32,
    compensation: str | None = None,
) -> list[str]:
    kinds = _kinds(compensation)
    optimizers = {k: _optimizer(model_name, k, compile, dtype, compensation) for k in kinds}
    for opt in optimizers.values():
        for _ in range(3):
            opt.step()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(steps):
        for kind, opt in optimizers.items():
            start = time.thread_time()
            opt.step()
            times[kind].append(time.thread_time() - start)
    params = sum(p.numel() for g in optimizers["torch"].param_groups for p in g["params"])
    base_time = statistics.median(times["torch"])
    base_bytes = state_bytes(optimizers["torch"])
    setting = "" if dtype == torch.float32 else f", {str(dtype)[6:]} parameters"
    setting += f", compensation={compensation}" if compensation else ""
    lines = [
        f"{model_name}: {params} parameters{setting}, {steps} steps, one thread, CPU time of "
        "the step",
        "",
        "| optimizer | fastest ms | lower quartile ms | median ms | x torch | paired x torch"
        " | state bytes | x torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, opt in optimizers.items():
        name = {"torch": "torch AdamW(foreach=True)", COMPENSATED: f"{kind}, {compensation}"}.get(
            kind, kind
        )
        median = statistics.median(times[kind])
        quartile = statistics.quantiles(times[kind], n=4)[0]
        # each round's step over torch's in the same round: a neighbour's load that slows a
        # stretch of rounds slows both
        ratios = [t / b for t, b in zip(times[kind], times["torch"], strict=True)]
        paired = statistics.median(ratios)
        spread = statistics.quantiles(ratios, n=4)
        size = state_bytes(opt)
        lines.append(
            f"| {name} | {1000 * min(times[kind]):.2f} | {1000 * quartile:.2f} | "
            f"{1000 * median:.2f} | {median / base_time:.2f} | {paired:.2f} "
            f"({spread[0]:.2f}-{spread[2]:.2f}) | {size} | {size / base_bytes:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small", "large"])
    parser.add_argument("--steps", type=int, default=41)
    parser.add_argument("--compile", choices=["none", "true", "false"], default="none")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--compensation", choices=["kahan", "stochastic"], default=None)
    args = parser.parse_args()
    compile = {"none": None, "true": True, "false": False}[args.compile]
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    for name in args.models:
        table = _table(name, args.steps, compile, dtype, args.compensation)
        print("\n".join(table), end="\n\n")


if __name__ == "__main__":
    main()
