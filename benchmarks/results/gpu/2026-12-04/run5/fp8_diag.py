"""Where the fp8 activation step's time goes on a GPU (run 2: 2.30x keep's step with its
kernels only 1.30x keep's): keep and fp8 steps taking turns, then for fp8 the codec's calls
(count, host time), synchronizing calls (torch's sync debug mode), the allocator's device
allocations and frees, variants (codec eager; guards skipped), and one profiled step's ops.

    PYTHONPATH=src python benchmarks/results/gpu/2026-12-04/run5/fp8_diag.py OUT [BATCH]
"""

import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3].parent / "gpu"))
import activations as A  # noqa: E402

from mixprec.activations import codecs  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dims = A.FULL if dev.type == "cuda" else A.TINY
batch = int(sys.argv[2]) if len(sys.argv) > 2 else (32 if dev.type == "cuda" else 2)
report: dict = {"batch": batch}


def save():
    (OUT / "fp8_diag.json").write_text(json.dumps(report, indent=1, default=str))


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


steps = {o: A.build(o, dims, dev, True) for o in ("keep", "fp8")}
for s in steps.values():
    for _ in range(3):
        s(batch)
sync()


def timed(option, n=6):
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        steps[option](batch)
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


report["ms"] = {o: [timed(o, 3) for _ in range(3)] for o in ("keep", "fp8", "keep", "fp8")}
save()
print("ms", report["ms"], flush=True)

# codec calls: count and host time (no sync inside)
calls, host = {}, {}
orig = codecs._run


def run(name, first, *args):
    t = time.perf_counter()
    out = orig(name, first, *args)
    key = f"{name} {first.dtype} ran={out[1]}"
    calls[key] = calls.get(key, 0) + 1
    host[key] = host.get(key, 0.0) + (time.perf_counter() - t) * 1e3
    return out


codecs._run = run
sync()
t0 = time.perf_counter()
steps["fp8"](batch)
host_wall = (time.perf_counter() - t0) * 1e3
sync()
report["codec"] = {
    "calls": calls,
    "host_ms": host,
    "step_host_ms_before_sync": host_wall,
    "step_ms": (time.perf_counter() - t0) * 1e3,
}
codecs._run = orig
save()
print("codec", report["codec"], flush=True)

# synchronizing calls and device allocations in one fp8 step
if dev.type == "cuda":
    before = torch.cuda.memory_stats()
    torch.cuda.set_sync_debug_mode(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        steps["fp8"](batch)
        sync()
    torch.cuda.set_sync_debug_mode(0)
    after = torch.cuda.memory_stats()
    report["syncs"] = [str(w.message)[:300] for w in seen][:20]
    report["sync_count"] = len(seen)
    report["allocator"] = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in (
            "num_alloc_retries",
            "num_device_alloc",
            "num_device_free",
            "num_sync_all_streams",
        )
    }
    save()
    print("syncs", report["sync_count"], report["syncs"][:3], report["allocator"], flush=True)

# variants: the codec eager; guards skipped
codecs.GATE.compile = False
report["ms_codec_eager"] = [timed("fp8", 3), timed("keep", 3)]
codecs.GATE.compile = None
save()
print("eager codec", report["ms_codec_eager"], flush=True)
try:
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        report["ms_skip_guards"] = [timed("fp8", 3), timed("keep", 3)]
except RuntimeError as e:
    report["ms_skip_guards"] = str(e)[:200]
save()
print("skip guards", report["ms_skip_guards"], flush=True)

# one profiled fp8 step: ops by host time and by device time, with counts
from torch.profiler import ProfilerActivity, profile  # noqa: E402

acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
for option in ("fp8", "keep"):
    sync()
    with profile(activities=acts) as prof:
        steps[option](batch)
        sync()
    ka = prof.key_averages()
    report[f"profile_{option}"] = {
        "by_self_host": [
            (e.key, e.count, round(e.self_cpu_time_total / 1e3, 2))
            for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:25]
        ],
        "by_device": [
            (e.key, e.count, round(e.self_device_time_total / 1e3, 2))
            for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:15]
        ],
    }
    save()
print("done", flush=True)
