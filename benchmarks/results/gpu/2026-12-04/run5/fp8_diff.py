"""Why the compiled fp8 activation codec differs from its eager form on a GPU (run 5: the
compile gate's check found 39,755 differing elements on the first saved tensor and sent
every later call to the eager codec, 4 s a step): the codec's stages compiled and eager on
the same inputs (the block scales, the quotients, the e4m3 cast), how far apart differing
codes are; then the fp8 step against keep's with the check off (the compiled codec's time).

    PYTHONPATH=src python benchmarks/results/gpu/2026-12-04/run5/fp8_diff.py OUT
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3].parent / "gpu"))

from mixprec.activations import codecs  # noqa: E402
from mixprec.optim import engine  # noqa: E402
from mixprec.optim.states import codecs as state_codecs  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
report: dict = {}


def save():
    (OUT / "fp8_diff.json").write_text(json.dumps(report, indent=1, default=str))


def order(codes):
    """e4m3 codes as integers in the order of their values (sign-magnitude to two's)."""
    b = codes.view(torch.uint8).to(torch.int32)
    return torch.where(b >= 128, -(b - 128), b)


def bits_differ(a, b):
    a, b = a.contiguous(), b.contiguous()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.view(width) != b.view(width)).sum())


g = torch.Generator(device=dev).manual_seed(0)
n = 1 << 22
for dtype in (torch.float32, torch.bfloat16):
    x = (torch.randn(n, device=dev, generator=g) * 3).to(dtype).view(-1, 256)
    eager = codecs._KERNELS["encode_blocks"](x)
    comp = codecs._compiled("encode_blocks")(x)
    r = {
        "codes_differ": bits_differ(comp[0], eager[0]),
        "scales_differ": bits_differ(comp[1], eager[1]),
    }
    d = (order(comp[0]) - order(eager[0])).abs()
    r["max_code_distance"] = int(d.max())
    # stages: the quotient (eager `_over`), then the cast of the same quotients
    xf = x.float()
    largest = xf.abs().amax(dim=1)
    scales = largest / largest.new_full((), state_codecs.FP8_MAX)
    y_eager = state_codecs._over(xf, scales)
    y_comp = torch.compile(
        state_codecs._over,
        dynamic=True,
        options={"emulate_precision_casts": True, "eager_numerics.division_rounding": True},
    )(xf, scales)
    r["quotients_differ"] = bits_differ(y_comp, y_eager)
    r["scale_stage_differ"] = bits_differ(scales, eager[1])
    cast_comp = torch.compile(lambda y: y.to(torch.float8_e4m3fn), dynamic=True)(y_eager)
    r["cast_differ"] = bits_differ(cast_comp, y_eager.to(torch.float8_e4m3fn))
    wrong = (comp[0].view(-1) != eager[0].view(-1)).nonzero()[:5].flatten()
    r["examples"] = [
        {
            "y": float(y_eager.view(-1)[i]),
            "compiled": float(comp[0].view(-1)[i].float()),
            "eager": float(eager[0].view(-1)[i].float()),
        }
        for i in wrong.tolist()
    ]
    report[str(dtype)] = r
    save()
    print(dtype, r, flush=True)

# the fp8 step with the check off: the compiled codec's own time
import activations as A  # noqa: E402

engine.TRUSTED = ("cpu", "cuda")
dims = A.FULL if dev.type == "cuda" else A.TINY
batch = 32 if dev.type == "cuda" else 2
steps = {o: A.build(o, dims, dev, True) for o in ("keep", "fp8")}
for s in steps.values():
    for _ in range(3):
        s(batch)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


# the saved tensors the gate's check found apart: the step's first encodes, compiled and
# eager, outside and inside autocast (the forward runs under it)
captured = []
orig_run = codecs._run


def capture(name, first, *args):
    if name.startswith("encode") and len(captured) < 4:
        captured.append((name, first.detach().clone(), torch.is_autocast_enabled(dev.type)))
    return orig_run(name, first, *args)


codecs._run = capture
steps["fp8"](batch)
codecs._run = orig_run
report["captured"] = []
for name, first, autocast in captured:
    r = {
        "name": name,
        "dtype": str(first.dtype),
        "shape": list(first.shape),
        "autocast_at_save": autocast,
    }
    for label, ctx in (
        ("plain", torch.autocast(dev.type, enabled=False)),
        ("autocast", torch.autocast(dev.type, dtype=torch.bfloat16)),
    ):
        with ctx, torch.no_grad():
            comp = codecs._compiled(name)(first)
            eager = codecs._KERNELS[name](first)
        d = (order(comp[0]) - order(eager[0])).abs()
        r[label] = {
            "codes_differ": bits_differ(comp[0], eager[0]),
            "scales_differ": bits_differ(comp[1], eager[1]),
            "max_code_distance": int(d.max()),
            "nonfinite_inputs": int((~first.float().isfinite()).sum()),
        }
        i = (comp[0].view(-1) != eager[0].view(-1)).nonzero()[:3].flatten().tolist()
        r[label]["examples"] = [
            (
                float(first.view(-1)[j]),
                float(comp[0].view(-1)[j].float()),
                float(eager[0].view(-1)[j].float()),
                float(eager[1][j // 256]),
            )
            for j in i
        ]
    report["captured"].append(r)
    save()
    print("captured", r, flush=True)

times = {"keep": [], "fp8": []}
for r in range(8):
    for o in ("keep", "fp8") if r % 2 else ("fp8", "keep"):
        sync()
        t = time.perf_counter()
        steps[o](batch)
        sync()
        times[o].append((time.perf_counter() - t) * 1e3)
report["step_ms"] = {o: statistics.median(v) for o, v in times.items()}
pairs = zip(times["fp8"], times["keep"], strict=True)
report["fp8_vs_keep"] = statistics.median(f / k for f, k in pairs)
save()
print("steps", report["step_ms"], report["fp8_vs_keep"], flush=True)
calls = {}
orig = codecs._run


def run(name, first, *args):
    t = time.perf_counter()
    out = orig(name, first, *args)
    k = f"{name} {first.dtype} ran={out[1]}"
    c = calls.setdefault(k, [0, 0.0])
    c[0] += 1
    c[1] += (time.perf_counter() - t) * 1e3
    return out


codecs._run = run
sync()
t = time.perf_counter()
steps["fp8"](batch)
report["host_ms_before_sync"] = (time.perf_counter() - t) * 1e3
sync()
report["step_ms_counted"] = (time.perf_counter() - t) * 1e3
report["codec_calls"] = calls
save()
print("codec", calls, report["host_ms_before_sync"], report["step_ms_counted"], flush=True)
