"""Activation options on examples/charlm.py's char LM (width 256, 4 blocks, context 128).

Held-out loss: for each option, the same training run (seed, data order, 300 AdamW steps at
batch 32 under bf16-mixed) with the model's saved activations kept as the option says, then
the loss over 40 held-out batches; each option beside keep's run of the same seed.

    PYTHONPATH=src python benchmarks/activation_charlm.py --options keep,bf16,fp8 --seeds 0,1 \\
        --threads 1 --json benchmarks/results/activation_memory/charlm_loss.json

With ``--grad-error``, keep's trained model of each seed also gives the gradients' relative
error, ``|g' - g| / |g|`` on the first 32 training windows, of ``bf16``, ``fp8``, and ``fp8``
with attention's saved query, key and value in fp8 too (what ``fp8`` did before it stored them
as ``bf16`` does).

`make` is a `mixprec bench` factory of the same model (random weights, batches of real
text), for the largest batch under one memory limit:

    mixprec bench --model benchmarks/activation_charlm.py:make --precision bf16-mixed \\
        --activations fp8 checkpoint --batch-sizes 8 --max-batch --memory-limit 256MiB ...
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from charlm import CharGPT, charlm_loaders, median_rate  # noqa: E402

from mixprec.hardware import detect  # noqa: E402
from mixprec.trainer import Trainer  # noqa: E402

BLOCK, WIDTH, PRECISION = 128, 256, "bf16-mixed"


def make() -> tuple[CharGPT, object, object]:
    """The char LM for `mixprec bench`: (model, make_batch, loss_fn), the loss as
    `CharGPT._loss` computes it (float32 logits)."""
    torch.manual_seed(0)
    model = CharGPT(block=BLOCK, dim=WIDTH)
    train, _ = charlm_loaders(BLOCK, 1)
    windows = train.dataset

    def make_batch(n: int) -> tuple[Tensor, Tensor]:
        pairs = [windows[i % len(windows)] for i in range(n)]
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return model, make_batch, loss_fn


def grad_errors(trained: dict[str, Tensor], width: int) -> dict[str, float]:
    """The gradients' relative error against keep's, on the first 32 training windows, of
    the model of width `width` with the `trained` weights (a state dict), under bf16-mixed
    with each activation option."""
    from mixprec.activations import wrapper
    from mixprec.precision import Precision

    _, make_batch, loss_fn = make()
    x, y = make_batch(32)

    def grads(option: str | None) -> Tensor:
        model = CharGPT(block=BLOCK, dim=width)
        model.load_state_dict(trained)
        precision = Precision(PRECISION, activations=option, device="cpu")
        model = precision.setup(model)
        with precision.forward_context():
            loss = loss_fn(model(x), y)
        precision.backward(loss)
        return torch.cat([p.grad.float().flatten() for p in model.parameters()])

    kept = grads(None)
    out = {}
    for name, option in (("bf16", "bf16"), ("fp8", "fp8"), ("fp8, attention in fp8", "fp8")):
        rule = wrapper._AttentionInBfloat16.__torch_function__
        if name.endswith("attention in fp8"):  # the rule off: attention's saves in fp8 too
            wrapper._AttentionInBfloat16.__torch_function__ = (  # type: ignore[method-assign]
                lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))
            )
        try:
            g = grads(option)
        finally:
            wrapper._AttentionInBfloat16.__torch_function__ = rule  # type: ignore[method-assign]
        out[name] = float((g - kept).norm() / kept.norm())
    return out


def run(option: str, seed: int, args: argparse.Namespace) -> dict[str, object]:
    """One training run under `option` (``keep``: none given) and its held-out loss."""
    torch.manual_seed(seed)
    train, val = charlm_loaders(BLOCK, args.batch_size)
    model = CharGPT(block=BLOCK, dim=args.width, steps=args.steps)
    common = {"limit_val_batches": args.val_batches, "enable_progress_bar": False}
    trainer = Trainer(
        precision=PRECISION,
        activations=None if option == "keep" else option,
        max_steps=args.steps,
        log_every_n_steps=min(25, args.steps),
        val_check_interval=min(len(train), args.steps),
        default_root_dir=args.root,
        seed=seed,
        **common,
    )
    start = time.perf_counter()
    trainer.fit(model, train, val)
    seconds = time.perf_counter() - start
    final = Trainer(
        precision=PRECISION, logger=False, enable_checkpointing=False, **common
    ).validate(model, val)[0]
    out = {
        "option": option,
        "seed": seed,
        "steps": trainer.global_step,
        "val_loss": final["val_loss"],
        "fit_seconds": round(seconds, 1),
        "median_ms_per_step": round(1000 * args.batch_size / median_rate(trainer), 1),
    }
    if args.grad_error and option == "keep":
        out["grad_error"] = grad_errors(copy.deepcopy(model.state_dict()), args.width)
    return out


def table(results: list[dict[str, object]]) -> str:
    """Markdown rows: each option's held-out loss beside keep's of the same seed."""
    rows = [
        "| activations | seed | held-out loss (nats/byte) | vs keep | ms/step (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    keep = {r["seed"]: r for r in results if r["option"] == "keep"}
    for r in results:
        base = keep.get(r["seed"])
        vs = f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.3f}%" if base else "-"
        rows.append(
            f"| {r['option']} | {r['seed']} | {r['val_loss']:.4f} | {vs} | "
            f"{r['median_ms_per_step']} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", default="keep,bf16,fp8", help="comma-separated")
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--val-batches", type=int, default=40)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--root", default="runs/activation_charlm")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--grad-error", action="store_true", help="also the gradients' error (keep's model)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for option in args.options.split(","):
            results.append(run(option, seed, args))
            print(json.dumps(results[-1]), flush=True)
            if args.json:  # what has finished, whatever stops the rest
                args.json.write_text(json.dumps(results, indent=2) + "\n")
    host = (
        f"{detect('cpu').describe()}; {torch.get_num_threads()} threads; torch "
        f"{torch.__version__}; python {platform.python_version()}"
    )
    print(f"host: {host}")
    print(table(results))


if __name__ == "__main__":
    main()
