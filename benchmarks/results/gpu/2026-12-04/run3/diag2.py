import torch
from torch import nn

from mixprec.activations import codecs
from mixprec.activations.codecs import ToFp8
from mixprec.optim.states import LowBitAdamW
from mixprec.optim.states.formats import quantize


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


torch.manual_seed(0)
base = torch.randn(64, 96) * torch.logspace(-3, 3, 96)
base[:8] = 0.0
for dtype in (torch.float32, torch.bfloat16):
    x = base.to(dtype)
    ref_c, ref_s = quantize(x, "fp8", signed=True)
    out = {"cpu-eager": (ref_c, ref_s)}
    xc = x.cuda()
    out["cuda-eager-quantize"] = quantize(xc, "fp8", signed=True)
    for flag in (False, True):
        codecs.GATE.compile = flag
        p = ToFp8().encode(xc)
        out[f"cuda-codec-compile={flag}"] = (p.codes, p.scales)
    for k, (c, s) in out.items():
        c, s = c.cpu(), s.cpu()
        dc = (bits(c) != bits(ref_c)).nonzero()
        ds = (bits(s) != bits(ref_s)).nonzero()
        print(dtype, k, "codes differ:", len(dc), "scales differ:", len(ds))
        for i in ds[:3].flatten().tolist():
            print("   scale", i, s[i].item(), ref_s[i].item())
        for i in dc[:3].flatten().tolist():
            print(
                "   code",
                i,
                "x",
                x.flatten()[i].item(),
                c[i].float().item(),
                ref_c[i].float().item(),
            )


def params(device):
    g = torch.Generator().manual_seed(0)
    return [
        nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16).to(device))
        for s in [(512, 256), (65541,), (33, 70), (96,)]
    ]


res = {}
for name, device, compile in (
    ("cpu-eager", "cpu", False),
    ("cuda-eager", "cuda", False),
    ("cuda-compiled", "cuda", None),
):
    ps = params(device)
    opt = LowBitAdamW(
        ps, lr=1e-3, states="int8", min_size=0, compensation="kahan", compile=compile, seed=7
    )
    for i in range(4):
        g = torch.Generator().manual_seed(1000 + i)
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype).to(p.device)
        opt.step()
    print(name, "state keys", sorted(opt.state[ps[0]].keys()))
    res[name] = [
        (
            p.detach().float().cpu(),
            opt.state[p]["compensation"].float().cpu() if "compensation" in opt.state[p] else None,
            opt.state[p],
        )
        for p in ps
    ]
for k in ("cuda-eager", "cuda-compiled"):
    for j, ((w, c, st), (w0, c0, st0)) in enumerate(zip(res[k], res["cpu-eager"], strict=True)):
        eqw = float((w == w0).float().mean())
        carried = (w + c) if c is not None else w
        carried0 = (w0 + c0) if c0 is not None else w0
        codes = {
            n: float((v.cpu() != st0[n].cpu()).float().mean())
            for n, v in st.items()
            if torch.is_tensor(v)
            and v.numel() > 1
            and n in st0
            and v.shape == st0[n].shape
            and n != "compensation"
        }
        print(
            k,
            j,
            "weights equal",
            round(eqw, 5),
            "max |dw|",
            float((w - w0).abs().max()),
            "max |d carried|",
            float((carried - carried0).abs().max()),
            "state differs",
            codes,
        )
