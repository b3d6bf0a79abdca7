"""Pure bfloat16 on the char LM: held-out loss and training memory, float32 to bf16-true.

Trains examples/charlm.py (same seed, data and schedule) in float32, bf16-mixed, bf16-true
plain, bf16-true + Kahan and bf16-true + stochastic rounding, and reports each run's
held-out loss against float32's and the bytes of its training state (parameters, gradients,
optimizer state, Kahan buffers, float32 masters), counted from the tensors at the last
optimizer step, against bf16-mixed's.

    python benchmarks/pure_bf16_charlm.py --width 64 --steps 300 \
        --out benchmarks/results/pure_bf16_charlm

bfloat16 arithmetic is emulated on a CPU without bf16 instructions: there the runs are slow
and their times say nothing about bf16 hardware; the losses and bytes do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import charlm  # noqa: E402

from mixprec.hardware import detect  # noqa: E402
from mixprec.trainer import Callback, Trainer  # noqa: E402

CONFIGS = (
    ("float32", "32-true", None),
    ("bf16-mixed", "bf16-mixed", None),
    ("bf16-true plain", "bf16-true", None),
    ("bf16-true + Kahan", "bf16-true", "kahan"),
    ("bf16-true + stochastic rounding", "bf16-true", "stochastic"),
)


class TrainingBytes(Callback):
    """Bytes of the training state at the last optimizer step, counted from the tensors:
    each parameter and its gradient, and for every tensor the optimizer steps (a float32
    master when it is not the model's parameter) that tensor, its gradient and every
    parameter-shaped state tensor (moments, Kahan buffers)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.params = 0

    def on_before_optimizer_step(self, trainer: Trainer, model: nn.Module, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        counted: dict[int, int] = {}
        for p in model.parameters():
            grad = p.grad.nbytes if p.grad is not None else 0
            counted[id(p)] = p.nbytes + grad
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) not in counted:
                    counted[id(p)] = p.nbytes + (p.grad.nbytes if p.grad is not None else 0)
                for value in inner.state.get(p, {}).values():
                    if torch.is_tensor(value) and value.dim() > 0:
                        counted[id(p)] += value.nbytes
        self.bytes = sum(counted.values())
        self.params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pure_bf16_charlm"))
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[c[0] for c in CONFIGS],
        help="run these configurations; the others' rows are kept from OUT/results.json",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    previous = {r["name"]: r for r in json.loads(saved.read_text())} if saved.exists() else {}
    runs = tempfile.mkdtemp(prefix="pure_bf16_charlm-")  # logs and checkpoints, not results
    for name, precision, compensation in CONFIGS:
        if args.only and name not in args.only:
            continue
        counter = TrainingBytes()
        result = charlm.run(
            precision,
            steps=args.steps,
            batch_size=args.batch_size,
            allow_slow=True,
            root=runs,
            seed=args.seed,
            width=args.width,
            compensation=compensation,
            callbacks=[counter],
        )
        result |= {"name": name, "training_bytes": counter.bytes, "params": counter.params}
        result["command"] = shlex.join(["python", "benchmarks/pure_bf16_charlm.py", *sys.argv[1:]])
        previous[name] = result
        print(json.dumps(result), flush=True)
        saved.write_text(json.dumps(list(previous.values()), indent=2) + "\n")

    rows = [previous[c[0]] for c in CONFIGS if c[0] in previous]
    if [r["name"] for r in rows[:2]] != ["float32", "bf16-mixed"]:
        raise SystemExit("the report needs the float32 and bf16-mixed rows: run them too")
    base_loss = rows[0]["val_loss"]
    mixed_bytes = rows[1]["training_bytes"]
    commands = sorted({r["command"] for r in rows})
    lines = [
        "# Pure bfloat16 on the char LM: held-out loss and training memory",
        "",
        "Commands (each row records the one that made it, in results.json): "
        + ", ".join(f"`{c}`" for c in commands),
        f"Host: {detect('cpu').describe()}; {platform.machine()}; torch {torch.__version__};"
        f" Python {platform.python_version()}",
        f"Model: examples/charlm.py, width {args.width}, 4 layers, block 128,"
        f" {rows[0]['params']:,} parameters; batch {args.batch_size}, {args.steps} AdamW steps"
        f" (lr 2e-3, warm-up then cosine to 10%), seed {args.seed}; held-out loss over 40"
        " batches of the last 10% of the text.",
        "",
        "| run | held-out loss (nats/byte) | vs float32 | training bytes | bytes/param"
        " | vs bf16-mixed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['val_loss']:.4f} | {r['val_loss'] / base_loss - 1:+.2%}"
            f" | {r['training_bytes']:,} | {r['training_bytes'] / r['params']:.2f}"
            f" | {r['training_bytes'] / mixed_bytes:.3f}x |"
        )
    lines += [
        "",
        "Training bytes are counted from the tensors at the last optimizer step: parameters,"
        " their gradients, the optimizer's parameter-shaped state (AdamW moments, Kahan"
        " buffers) and float32 masters where a precision keeps them. Activations are not"
        " counted. The tied embedding/head weight counts once.",
    ]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
