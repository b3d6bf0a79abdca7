"""Why the compiled low-bit Kahan write-back differed from eager on CUDA (run 3): the
inductor's treatment of a narrowing-widening cast pair, and the low-bit Kahan step compiled
on CUDA against the CPU's eager one, with the rounded weight from `engine.nearest_value`
(now) and from the cast pair (before), for bfloat16 and float16 weights.

    PYTHONPATH=src python benchmarks/results/gpu/2026-12-04/run4/diag3.py OUTDIR
"""

import inspect
import os
import sys

import torch
import torch._dynamo
from torch import nn
from torch._inductor.utils import run_and_get_code

from mixprec.optim import engine
from mixprec.optim.states import LowBitAdamW

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
print("torch", torch.__version__, "cuda", torch.version.cuda, flush=True)
try:
    from torch._inductor.fx_passes import joint_graph

    print(inspect.getsource(joint_graph.pointless_convert))
except Exception as e:  # noqa: BLE001
    print("pointless_convert:", e)
import torch._inductor.codegen.triton as triton_codegen  # noqa: E402
import torch._inductor.config as cfg  # noqa: E402

lines = [ln.strip() for ln in inspect.getsource(triton_codegen).splitlines() if "fp_fusion" in ln]
print("triton codegen fp_fusion lines:", lines)
print("emulate_precision_casts:", getattr(cfg, "emulate_precision_casts", "absent"))


def pair(x):
    return x.to(torch.bfloat16).to(torch.float32) - x


x = torch.randn(1 << 16)
expected = int((pair(x) != 0).sum())
for dev in ("cpu", "cuda"):
    for opts in ({}, {"emulate_precision_casts": True}):
        torch._dynamo.reset()
        got = torch.compile(pair, fullgraph=True, options=opts)(x.to(dev)).cpu()
        print(
            f"cast pair {dev} {opts}: rounding kept in {int((got != 0).sum())} of "
            f"{expected} (eager)",
            flush=True,
        )


def params(device, dtype):
    g = torch.Generator().manual_seed(0)
    return [
        nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device))
        for s in [(512, 256), (65541,), (33, 70), (96,)]
    ]


def run(device, compile, dtype, code_file=None):
    ps = params(device, dtype)
    opt = LowBitAdamW(
        ps, lr=1e-3, states="int8", min_size=0, compensation="kahan", compile=compile, seed=7
    )

    def steps():
        for i in range(4):
            g = torch.Generator().manual_seed(1000 + i)
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype).to(p.device)
            opt.step()

    if code_file:
        _, codes = run_and_get_code(steps)
        with open(code_file, "w") as f:
            f.write("\n\n# ----\n\n".join(codes))
    else:
        steps()
    return [(p.detach().float().cpu(), opt.state[p]["compensation"].float().cpu()) for p in ps]


def compare(label, got, ref):
    for j, ((w, c), (w0, c0)) in enumerate(zip(got, ref, strict=True)):
        print(
            f"{label} param {j}: weights equal {float((w == w0).float().mean()):.5f}, "
            f"max |dw| {float((w - w0).abs().max()):.3g}, buffers equal "
            f"{float((c == c0).float().mean()):.5f}, max |d carried| "
            f"{float(((w + c) - (w0 + c0)).abs().max()):.3g}",
            flush=True,
        )


engine.KAHAN_COMPILES = ("cpu", "cuda")
new_value = engine.nearest_value
for dtype in (torch.bfloat16, torch.float16):
    ref = run("cpu", False, dtype)
    compare(f"{dtype} cuda eager", run("cuda", False, dtype), ref)
    for label, value in (
        ("nearest_value", new_value),
        ("cast pair", lambda x, d: x.to(d).to(torch.float32)),
    ):
        engine.nearest_value = value
        torch._dynamo.reset()
        tag = "new" if value is new_value else "old"
        code = os.path.join(OUT, f"kahan_{tag}_{str(dtype)[6:]}.py")
        try:
            compare(f"{dtype} cuda compiled, {label}", run("cuda", True, dtype, code), ref)
            compare(f"{dtype} cpu compiled, {label}", run("cpu", True, dtype), ref)
        except Exception as e:  # noqa: BLE001
            print(f"{dtype} {label}: {type(e).__name__}: {e}", flush=True)
    engine.nearest_value = new_value
