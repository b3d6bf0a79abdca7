"""bf16-mixed vs float32 on the two real examples (digits CNN, stdlib char LM), with the
accuracy / held-out loss each reaches; the other precisions once each, to show they train.

Every run is a fresh process (`python examples/<name>.py --precision P --json FILE`), so no
run inherits another's allocator or thread state. The float32 and bf16-mixed runs alternate
(``--repeats`` times each, order flipped every round: the machine is shared and noisy);
speed is the median of the throughput the Trainer logs every 10 (digits) or 25 (charlm)
steps, and speed-ups are ratios of those medians.

    python benchmarks/examples_speedup.py [--repeats 2] [--others] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import mixprec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {"digits": ("test_acc", "test accuracy"), "charlm": ("val_loss", "val loss (nats/byte)")}
SPEED = ("32-true", "bf16-mixed")
OTHERS = ("bf16-true", "16-mixed", "16-true", "64-true")
# float16 convolutions run ~110x slower than float32 on a CPU (measured here: 1.5 s vs 13 ms
# a step for the digits CNN), so those two runs get one epoch instead of twenty
SHORTER = {("digits", "16-mixed"): ["--epochs", "1"], ("digits", "16-true"): ["--epochs", "1"]}


def run(example: str, precision: str, workdir: Path, extra: list[str]) -> dict[str, object]:
    """One run of an example in a fresh process; its JSON result."""
    out = workdir / f"{example}-{precision}.json"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / f"{example}.py"),
        "--precision",
        precision,
        "--allow-slow",
        "--root",
        str(workdir / "runs"),
        "--json",
        str(out),
        *extra,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--others", action="store_true", help="also run " + ", ".join(OTHERS))
    parser.add_argument("--examples", default="digits,charlm")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    examples = args.examples.split(",")
    results: dict[str, dict[str, list[dict[str, object]]]] = {e: {} for e in examples}
    with tempfile.TemporaryDirectory() as tmp:
        for example in examples:
            for r in range(args.repeats):
                for precision in SPEED if r % 2 == 0 else SPEED[::-1]:
                    res = run(example, precision, Path(tmp), [])
                    results[example].setdefault(precision, []).append(res)
                    print(json.dumps(res), flush=True)
            for precision in OTHERS if args.others else ():
                res = run(example, precision, Path(tmp), SHORTER.get((example, precision), []))
                results[example].setdefault(precision, []).append(res)
                print(json.dumps(res), flush=True)

    command = f"python benchmarks/examples_speedup.py --repeats {args.repeats}" + (
        " --others" if args.others else ""
    )
    device = mixprec.hardware.detect("cpu").describe()
    rows = []
    for example in examples:
        key, label = EXAMPLES[example]
        by = results[example]
        base = statistics.median(float(r["median_samples_per_sec"]) for r in by["32-true"])
        for precision, runs in by.items():
            rate = statistics.median(float(r["median_samples_per_sec"]) for r in runs)
            secs = statistics.median(float(r["fit_seconds"]) for r in runs)
            quality = statistics.mean(float(r[key]) for r in runs)
            rows.append(
                f"| {example} | {precision} | {runs[0]['steps']} | {rate:,.1f} "
                f"| {rate / base:.2f}x | {secs:.1f} | {label} {quality:.4f} | {len(runs)} |"
            )
    lines = [
        "# The examples in each precision: time and quality",
        "",
        f"Command: `{command}`",
        f"Device: {device}; torch {torch.__version__}; Python {sys.version.split()[0]}",
        "",
        "| example | precision | steps | training samples/s | speed-up vs 32-true "
        "| fit time (s) | quality | runs |",
        "|---|---|---:|---:|---:|---:|---|---:|",
        *rows,
        "",
        "digits: `examples/digits.py` (4-conv CNN with batch norm, 20 epochs, batch 64, AdamW "
        "+ cosine; 1,257 train / 270 val / 270 test images); quality is the test accuracy. "
        "charlm: `examples/charlm.py` (GPT, 4 layers, width 256, 4 heads, 128-byte context, "
        "300 steps of batch 32; the last 10% of the text held out); quality is the held-out "
        "cross-entropy in nats per byte (lower is better). Training samples/s is the median "
        "of the throughput the Trainer logs every 10 (digits) or 25 (charlm) steps (training "
        "time only; images or 128-byte sequences), the median over runs; speed-up is its "
        "ratio to 32-true. Fit time is the whole `Trainer.fit` (validation included): on "
        "this shared machine it swings with other load, the per-window median much less. "
        "Each run is a fresh process; float32 and bf16-mixed alternate. Quality is the mean "
        "over the runs. digits in 16-mixed and 16-true run 1 epoch (20 steps) instead of 20: "
        "float16 convolutions are about 110x slower than float32 on this CPU (1.5 s vs 13 ms "
        "a step), so their quality is not comparable with the 20-epoch rows.",
    ]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "examples_speedup.md").write_text("\n".join(lines) + "\n")
    payload = {"command": command, "device": device, "torch": str(torch.__version__)}
    payload["results"] = results
    (args.out_dir / "examples_speedup.json").write_text(json.dumps(payload, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
