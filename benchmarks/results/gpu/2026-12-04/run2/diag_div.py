import torch
import torch._inductor.config as c

en = getattr(c, "eager_numerics", None)
print(
    "torch",
    torch.__version__,
    "eager_numerics:",
    en is not None,
    "division_rounding:",
    getattr(en, "division_rounding", "missing"),
)
x = torch.randn(1 << 20, device="cuda") * 1000
y = torch.rand(1 << 20, device="cuda") + 0.5
for opts in ({}, {"emulate_precision_casts": True, "eager_numerics.division_rounding": True}):
    try:
        f = torch.compile(lambda a, b: a / b, options=opts, dynamic=True)
        g = torch.compile(lambda a: a / 448.0, options=opts, dynamic=True)
        h = torch.compile(lambda a: a.abs().amax() / 448.0, options=opts, dynamic=True)
        print(
            opts,
            "x/y:",
            int((f(x, y) != x / y).sum()),
            "x/448:",
            int((g(x) != x / 448.0).sum()),
            "amax/448 equal:",
            bool(h(x) == x.abs().amax() / 448.0),
        )
    except Exception as e:
        print(opts, "error", type(e).__name__, str(e)[:300])
