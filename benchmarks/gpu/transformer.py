"""Transformer language-model throughput per precision, mixprec against hand-written torch.

A GPT-style decoder (d=1024, 12 layers, 16 heads, 512 tokens, vocab 32k, about 217M
parameters) trains with fused AdamW in five precisions: float32 with TF32 off ("fp32
strict"), float32 with TF32 on, bf16-mixed, 16-mixed and bf16-true; each eagerly and with
`torch.compile` (each block compiled on its own, so the 12 identical blocks share one
compilation). Every configuration runs in a fresh process holding two identical models: one
set up through `mixprec.Precision`, one driven by a hand-written loop (autocast, plus
`torch.amp.GradScaler` for float16); their timed steps alternate, as in `mixprec bench`,
so both see the same machine.

Reported per configuration: tokens/s, model TFLOP/s and MFU, peak memory
(`torch.cuda.max_memory_allocated` from model build to the first optimizer update, per
loop), and mixprec's overhead against the hand-written loop.

Model FLOPs per step = 6 * N * tokens + 12 * layers * d * seq * tokens, where N counts the
parameters outside the token and position embeddings (lookups do no matmul) and the second
term is the attention scores and weighted values, forward and backward, without a causal
discount (as PaLM counts). MFU divides the achieved rate by NVIDIA's dense H100 SXM peaks:
989 TFLOP/s for bfloat16/float16 tensor cores, 494 for TF32, 67 for float32 without tensor
cores. On another GPU the MFU column is relative to those H100 figures.

    PYTHONPATH=src python benchmarks/gpu/transformer.py --out OUT             # an H100
    PYTHONPATH=src python benchmarks/gpu/transformer.py --device cpu --tiny --out OUT

`--tiny` shrinks the model (d=64, 2 layers, 32 tokens, vocab 256) and runs 2 steps: a smoke
test of the script, not a measurement. Outputs: results.json, results.md and (with
matplotlib) transformer.png in --out; the files are rewritten after every configuration, so
an interrupted run keeps what it finished.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.bench.runner import Loop

# TFLOP/s, dense, H100 SXM (NVIDIA datasheet): what MFU is measured against
PEAK_TFLOPS = {"float32": 67.0, "tf32": 494.0, "16-bit": 989.0}


@dataclass(frozen=True)
class Variant:
    """One precision row: a mixprec spec, the TF32 setting and the peak it is held to."""

    name: str
    spec: str
    tf32: bool | None
    peak: str


VARIANTS = (
    Variant("fp32 strict (TF32 off)", "32-true", False, "float32"),
    Variant("fp32 + TF32", "32-true", True, "tf32"),
    Variant("bf16-mixed", "bf16-mixed", None, "16-bit"),
    Variant("16-mixed", "16-mixed", None, "16-bit"),
    Variant("bf16-true", "bf16-true", None, "16-bit"),
)


@dataclass(frozen=True)
class Dims:
    """Model and batch shape."""

    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int


# batch 16 x 512 tokens: float32 with AdamW needs about 15 GiB (weights, gradients and
# moments 3.5 GiB, activations about 0.6 GiB per sequence), far below an H100's 80 GB,
# and every GEMM is at least 8192 x 1024 x 1024, large enough to fill the tensor cores
FULL = Dims(vocab=32000, dim=1024, layers=12, heads=16, seq=512, batch=16)
TINY = Dims(vocab=256, dim=64, layers=2, heads=4, seq=32, batch=2)


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention (SDPA) and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class LM(nn.Module):
    """Token and position embeddings, decoder blocks, final norm, untied LM head."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.embed = nn.Embedding(dims.vocab, dims.dim)
        self.pos = nn.Parameter(torch.randn(dims.seq, dims.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dims.dim, dims.heads) for _ in range(dims.layers))
        self.norm = nn.LayerNorm(dims.dim)
        self.head = nn.Linear(dims.dim, dims.vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def matmul_params(model: LM) -> int:
    """Parameters outside the embedding tables: the N of 6 * N * tokens."""
    return (
        sum(p.numel() for p in model.parameters())
        - model.embed.weight.numel()
        - (model.pos.numel())
    )


def flops_per_step(dims: Dims, n_params: int) -> float:
    """Model FLOPs of one training step (forward and backward), as in the module doc."""
    tokens = dims.batch * dims.seq
    return 6.0 * n_params * tokens + 12.0 * dims.layers * dims.dim * dims.seq * tokens


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross-entropy, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# -- the child: one configuration ----------------------------------------------------------


@dataclass
class Job:
    """One configuration; JSON-serialised for the child process."""

    variant: str
    compile: bool
    device: str
    dims: dict[str, int]
    steps: int
    warmup: int
    allow_slow: bool
    threads: int | None = None


def _build_model(dims: Dims, device: torch.device) -> LM:
    """The same weights in every loop and process: seeded, built on the device directly."""
    torch.manual_seed(0)
    with device:
        return LM(dims)


def _compile_blocks(model: LM) -> None:
    """Compile each block in place; identical blocks reuse the first one's compiled code."""
    for block in model.blocks:
        block.compile()


def _build_mixprec(job: Job, variant: Variant, dims: Dims, batch: tuple[Tensor, Tensor]) -> Loop:
    from mixprec.precision import Precision

    device = torch.device(job.device)
    model = _build_model(dims, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    precision = Precision(variant.spec, device=device, allow_slow=job.allow_slow)
    model, opt = precision.setup(model, opt)
    if job.compile:  # after setup, as a user would: the converted blocks are compiled
        _compile_blocks(model)
    tokens, targets = batch

    def step() -> Tensor:
        opt.zero_grad(set_to_none=True)
        with precision.forward_context():  # the loss where the raw loop computes it
            loss = lm_loss(model(tokens), targets)
        precision.backward(loss)
        precision.step(opt)
        return loss.detach()

    return Loop(step, opt.optimizer)


def _build_raw(job: Job, variant: Variant, dims: Dims, batch: tuple[Tensor, Tensor]) -> Loop:
    """The hand-written loop: autocast for mixed, `.to(dtype)` for true, GradScaler for fp16."""
    from mixprec.policy import Policy

    device = torch.device(job.device)
    policy = Policy(variant.spec)
    model = _build_model(dims, device)
    if not policy.is_mixed:
        model.to(policy.param_dtype)
    if job.compile:
        _compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dtype = policy.compute_dtype
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    tokens, targets = batch

    def step() -> Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=policy.is_mixed):
            loss = lm_loss(model(tokens), targets)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    return Loop(step, opt)


def _first_update(build: Callable[[], Loop], device: torch.device) -> tuple[Loop, int | None]:
    """Build a loop and run it to its first taken optimizer step (float16 may skip some);
    on CUDA also return the peak memory allocated meanwhile."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    loop = build()
    while loop.steps_taken == 0 and loop.steps_run < 32:
        loop.step()
    if not cuda:
        return loop, None
    torch.cuda.synchronize(device)
    return loop, torch.cuda.max_memory_allocated(device) - base


def run_job(job: Job) -> dict[str, Any]:
    """Build both loops, warm them up, time them alternately; the child's result."""
    from mixprec.bench.runner import is_oom, set_tf32

    variant = next(v for v in VARIANTS if v.name == job.variant)
    dims = Dims(**job.dims)
    device = torch.device(job.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if variant.tf32 is not None:
            set_tf32(variant.tf32)
        # the backward runs outside autocast, as in eager mode (compiled graphs only)
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "backward_pass_autocast"):
            functorch_config.backward_pass_autocast = "off"
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, dims.vocab, (dims.batch, dims.seq + 1), generator=g).to(device)
    batch = (data[:, :-1], data[:, 1:])

    out: dict[str, Any] = {"status": "ok"}
    loops: dict[str, Loop] = {}
    try:
        for name, build in (("mixprec", _build_mixprec), ("raw", _build_raw)):
            t0 = time.perf_counter()
            loops[name], peak = _first_update(lambda b=build: b(job, variant, dims, batch), device)
            out[name] = {"peak_memory": peak, "first_step_s": time.perf_counter() - t0}
        for _ in range(job.warmup):
            for loop in loops.values():
                loop.step()
        sync()
        times: dict[str, list[float]] = {name: [] for name in loops}
        last: dict[str, Tensor] = {}
        names = list(loops)
        gc.collect()
        gc.disable()
        try:
            for i in range(job.steps):
                for name in names if i % 2 == 0 else names[::-1]:
                    sync()
                    t0 = time.perf_counter()
                    last[name] = loops[name].step()
                    sync()
                    times[name].append((time.perf_counter() - t0) * 1e3)
        finally:
            gc.enable()
    except Exception as err:  # noqa: BLE001 - an OOM is a result; anything else propagates
        if not is_oom(err):
            raise
        return {"status": "oom", "error": f"{type(err).__name__}: {str(err)[:300]}"}
    for name, loop in loops.items():
        out[name].update(
            step_ms=times[name],
            final_loss=float(last[name]),
            skipped_steps=loop.steps_run - loop.steps_taken,
        )
    return out


def child_main(job_json: str, result_path: str) -> int:
    """Entry point of one configuration's process: run it, write its JSON result."""
    job = Job(**json.loads(job_json))
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    try:
        result = run_job(job)
    except Exception as err:  # noqa: BLE001 - reported to the parent
        result = {"status": "error", "error": f"{type(err).__name__}: {str(err)[-1500:]}"}
    Path(result_path).write_text(json.dumps(result))
    return 0


# -- the parent: every configuration in its own process ----------------------------------------


def run_isolated(job: Job, out_dir: Path, timeout: float) -> dict[str, Any]:
    """Run `job` in a fresh Python process and return its result."""
    path = out_dir / f".job-{os.getpid()}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, __file__, "--child", json.dumps(asdict(job)), str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no result after {timeout:.0f} s"}
    try:
        if path.exists():
            return json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
    tail = (proc.stderr or proc.stdout).strip()[-1500:]
    return {"status": "error", "error": f"exit code {proc.returncode}: {tail}"}


def summarize(row: dict[str, Any], dims: Dims, n_params: int) -> dict[str, Any]:
    """Medians, tokens/s, TFLOP/s, MFU and overhead for one finished row."""
    result = row["result"]
    if result["status"] != "ok":
        return {}
    ours = statistics.median(result["mixprec"]["step_ms"])
    raw = statistics.median(result["raw"]["step_ms"])
    flops = flops_per_step(dims, n_params)
    peak = PEAK_TFLOPS[next(v.peak for v in VARIANTS if v.name == row["variant"])]
    tflops = flops / (ours / 1e3) / 1e12
    return {
        "ms": ours,
        "raw_ms": raw,
        "tokens_per_s": dims.batch * dims.seq / (ours / 1e3),
        "tflops": tflops,
        "mfu": tflops / peak,
        "raw_mfu": flops / (raw / 1e3) / 1e12 / peak,
        "overhead": ours / raw - 1.0,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def markdown(report: dict[str, Any]) -> str:
    """The results table with the formulas, peaks and environment it rests on."""
    meta = report["metadata"]
    lines = [
        "# Transformer LM per precision: mixprec vs hand-written torch",
        "",
        f"{meta['model']}; {meta['device_name']}, torch {meta['torch']}, CUDA {meta['cuda']}; "
        f"{meta['steps']} timed steps after {meta['warmup']} warm-up, median.",
        "",
        f"Model FLOPs per step: {meta['flops_formula']} = {meta['flops_per_step']:.3e}. "
        "MFU against dense H100 SXM peaks: "
        + ", ".join(f"{k} {v:g} TFLOP/s" for k, v in PEAK_TFLOPS.items())
        + ".",
        "",
        "| precision | compile | tokens/s | ms/step | TFLOP/s | MFU | raw ms/step | raw MFU "
        "| mixprec overhead | peak MiB (mixprec / raw) | skipped steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in report["rows"]:
        result, s = row["result"], row["summary"]
        compiled = "yes" if row["compile"] else "no"
        if result["status"] != "ok":
            cells = [result["status"].upper()] + ["-"] * 8
            lines.append(f"| {row['variant']} | {compiled} | " + " | ".join(cells) + " |")
            continue
        ours, raw = result["mixprec"], result["raw"]
        lines.append(
            f"| {row['variant']} | {compiled} | {s['tokens_per_s']:,.0f} | {s['ms']:.1f} | "
            f"{s['tflops']:.1f} | {s['mfu']:.1%} | {s['raw_ms']:.1f} | {s['raw_mfu']:.1%} | "
            f"{s['overhead']:+.1%} | {_mib(ours['peak_memory'])} / {_mib(raw['peak_memory'])} "
            f"| {ours['skipped_steps']} |"
        )
    errors = [r for r in report["rows"] if r["result"]["status"] != "ok"]
    if errors:
        lines += ["", "Failed configurations:", ""]
        for r in errors:
            lines.append(f"- {r['variant']} (compile {r['compile']}): {r['result']['error']}")
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Tokens/s per precision, eager and compiled, mixprec and raw; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["rows"] if r["summary"]]
    if not rows:
        return False
    labels = [f"{r['variant']}\n{'compiled' if r['compile'] else 'eager'}" for r in rows]
    ours = [r["summary"]["tokens_per_s"] for r in rows]
    raw = [r["batch_tokens"] / (r["summary"]["raw_ms"] / 1e3) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.0))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], ours, width=0.4, label="mixprec Precision")
    ax.bar([x + 0.2 for x in xs], raw, width=0.4, label="hand-written torch")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.set_title(report["metadata"]["model"], fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(out: Path, report: dict[str, Any]) -> None:
    """results.json, results.md and transformer.png (when matplotlib is installed)."""
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report))
    plot(report, out / "transformer.png")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny model, 2 steps: a smoke test")
    p.add_argument("--batch-size", type=int, help=f"sequences per step (default {FULL.batch})")
    p.add_argument("--steps", type=int, help="timed steps per loop (default 10; --tiny 2)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 3; --tiny 0)")
    p.add_argument(
        "--precision",
        nargs="+",
        choices=[v.name for v in VARIANTS],
        default=[v.name for v in VARIANTS],
        metavar="NAME",
        help="rows to run: " + ", ".join(repr(v.name) for v in VARIANTS),
    )
    p.add_argument("--compile", choices=("both", "on", "off"), default="both")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    p.add_argument("--threads", type=int, help="torch CPU threads per process (default: torch's)")
    p.add_argument(
        "--allow-slow", action="store_true", help="run precisions far slower than float32 here"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here; use --device cpu --tiny for a smoke test", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:  # the child's torch.cuda.set_device
        device = torch.device("cuda", torch.cuda.current_device())  # needs an index
    base = TINY if args.tiny else FULL
    dims = Dims(**{**asdict(base), "batch": args.batch_size or base.batch})
    steps = args.steps if args.steps is not None else (2 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 3)
    compile_modes = {"both": [False, True], "on": [True], "off": [False]}[args.compile]
    args.out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        n_params = matmul_params(LM(dims))
        total = sum(p.numel() for p in LM(dims).parameters())
    report: dict[str, Any] = {
        "metadata": {
            "model": (
                f"decoder LM d={dims.dim}, {dims.layers} layers, {dims.heads} heads, "
                f"seq {dims.seq}, vocab {dims.vocab}, batch {dims.batch} "
                f"({total / 1e6:.1f}M parameters, {n_params / 1e6:.1f}M outside embeddings), "
                "fused AdamW"
            ),
            "dims": asdict(dims),
            "parameters": total,
            "matmul_parameters": n_params,
            "flops_per_step": flops_per_step(dims, n_params),
            "flops_formula": "6 * N * tokens + 12 * layers * d * seq * tokens",
            "peak_tflops": PEAK_TFLOPS,
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "steps": steps,
            "warmup": warmup,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
        },
        "rows": [],
    }
    for variant in (v for v in VARIANTS if v.name in args.precision):
        for compiled in compile_modes:
            job = Job(
                variant.name,
                compiled,
                str(device),
                asdict(dims),
                steps,
                warmup,
                args.allow_slow,
                args.threads,
            )
            t0 = time.perf_counter()
            result = run_isolated(job, args.out, args.timeout)
            row = {
                "variant": variant.name,
                "spec": variant.spec,
                "tf32": variant.tf32,
                "compile": compiled,
                "batch_tokens": dims.batch * dims.seq,
                "wall_s": round(time.perf_counter() - t0, 1),
                "result": result,
            }
            row["summary"] = summarize(row, dims, n_params)
            report["rows"].append(row)
            s = row["summary"]
            shown = (
                f"{s['tokens_per_s']:,.0f} tokens/s, MFU {s['mfu']:.1%}, "
                f"overhead {s['overhead']:+.1%}"
                if s
                else f"{result['status']}: {result.get('error', '')[:200]}"
            )
            print(f"{variant.name:24} compile={compiled!s:5} {shown} ({row['wall_s']} s)")
            write_outputs(args.out, report)
    failed = [r for r in report["rows"] if r["result"]["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    sys.exit(main())
