"""Float8 layers in training: under `torch.compile`, inside `Precision("bf16-mixed")`, across
a checkpoint and resume, under DDP (two gloo processes), and on a real GPU (real
`torch._scaled_mm` against the emulation; skipped without a CUDA device of SM 8.9+)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from spawning import WORLD, run_ranks
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from mixprec.precision import Precision
from mixprec.quantize.float8 import (
    DELAYED_BUFFERS,
    E4M3,
    E5M2,
    Float8Linear,
    amax_to_scale,
    convert_to_float8,
    delayed_layers,
    sync_amax_histories,
)
from mixprec.trainer import Trainer


def mlp(recipe: str = "tensorwise", second: str | None = None, seed: int = 0) -> nn.Module:
    """Linear-GELU-Linear on 32 features, converted to float8 (second layer may differ)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    convert_to_float8(model, recipe=recipe, amax_history_length=4, skip_small=False)
    if second is not None:
        model[2] = Float8Linear.from_float(model[2].to_float(), second, 4)
    return model


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data, forward=None) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss((forward or model)(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("recipe", "backend"), [("tensorwise", "inductor"), ("delayed", "aot_eager")]
)
def test_compiled_training_matches_eager_without_graph_breaks(recipe, backend):
    torch._dynamo.reset()
    counters.clear()
    eager = mlp(recipe)
    compiled = copy.deepcopy(eager)
    data = batches(3)
    eager_losses = train(eager, torch.optim.SGD(eager.parameters(), lr=0.1), data)
    step = torch.compile(compiled, backend=backend, fullgraph=True)
    compiled_losses = train(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), data, step)
    assert dict(counters["graph_break"]) == {}
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    for (name, a), b in zip(state(eager).items(), state(compiled).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    if recipe == "delayed":  # the buffers moved, in the compiled graph's backward too
        assert (compiled[0].grad_output_amax_history[:3] > 0).all()


def test_inside_precision_bf16_mixed_equals_plain_autocast():
    model = mlp("rowwise", second="tensorwise")
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    precision = Precision("bf16-mixed", allow_slow=True)
    model, wrapped = precision.setup(model, opt)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for x, y in batches(3):
        with precision.forward_context():
            out = model(x)
            loss = F.mse_loss(out, y)
        precision.backward(loss)
        precision.step(wrapped)
        wrapped.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain_loss = F.mse_loss(plain(x).float(), y)
        plain_loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        assert out.dtype == torch.bfloat16 and torch.equal(loss, plain_loss)  # as autocast made it
    assert seen == [torch.bfloat16] * 3
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for (name, a), b in zip(state(model).items(), state(plain).values(), strict=True):
        assert torch.equal(a, b), name


def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    data = batches(6)
    straight = mlp("delayed", second="tensorwise")
    opt = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    train(straight, opt, data)

    first = mlp("delayed", second="tensorwise")
    opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    train(first, opt, data[:3])
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")

    resumed = mlp("delayed", second="tensorwise", seed=123)  # other weights, fresh buffers
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert {f"0.{n}" for n in DELAYED_BUFFERS} <= set(ckpt["model"])
    train(resumed, opt, data[3:])
    for (name, a), b in zip(state(straight).items(), state(resumed).values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed[0].input_amax_history[:4].min() > 0  # four steps recorded, in order


def _ddp_worker(rank: int, out_dir: str) -> None:
    model = mlp("tensorwise", second="delayed")
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = [(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]) for x, y in batches(3)]
    train(ddp, opt, data)
    torch.save(state(model), f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_ddp_keeps_replicas_identical_and_averages_float8_gradients(tmp_path):
    """DDP broadcasts rank 0's buffers before each forward, so every rank quantizes with
    rank 0's delayed scales; each then records its own amaxes until the next broadcast."""
    run_ranks(_ddp_worker, str(tmp_path), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name in ranks[0]:
        if name.endswith(("input_amax_history", "grad_output_amax_history")):
            # rank 0's broadcast, then the last step's own amax (the two halves differ)
            assert torch.equal(ranks[0][name][1:], ranks[1][name][1:]), name
            assert not torch.equal(ranks[0][name][:1], ranks[1][name][:1]), name
        elif not name.endswith(("input_scale", "grad_output_scale")):
            assert torch.equal(ranks[0][name], ranks[1][name]), name
    # One process doing what DDP does: each half's float8 gradients, averaged, one step.
    model = mlp("tensorwise", second="delayed")
    replica = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(3):
        replica.load_state_dict(model.state_dict())  # DDP broadcasts rank 0's buffers
        grads = []
        for rank, net in enumerate((model, replica)):
            net.zero_grad()
            F.mse_loss(net(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
            grads.append([p.grad for p in net.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / WORLD
        opt.step()
    for name, value in state(model).items():
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-6, atol=1e-7, msg=name)


def _synced_ddp_worker(rank: int, out_dir: str) -> None:
    model = mlp("delayed", second="delayed")
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in batches(3, seed=2):
        opt.zero_grad()
        half = slice(rank * 4, rank * 4 + 4)
        F.mse_loss(ddp(x[half] * (1 + 3 * rank)), y[half]).backward()  # rank 1's run larger
        assert sync_amax_histories(model) == 2
        opt.step()
    torch.save(state(model), f"{out_dir}/rank{rank}.pt")


def _max_of_replicas(a: nn.Module, b: nn.Module) -> None:
    """What `sync_amax_histories` should do, written out for two replicas in one process."""
    for la, lb in zip(delayed_layers(a), delayed_layers(b), strict=True):
        for name, fp8 in (("input", E4M3), ("weight", E4M3), ("grad_output", E5M2)):
            ha, hb = (getattr(layer, f"{name}_amax_history") for layer in (la, lb))
            top = torch.maximum(ha, hb)
            for layer in (la, lb):
                getattr(layer, f"{name}_amax_history").copy_(top)
                getattr(layer, f"{name}_scale").copy_(amax_to_scale(top.max(), fp8))


@pytest.mark.slow
def test_synced_amax_histories_are_the_max_over_ranks_as_one_process_would_compute(tmp_path):
    run_ranks(_synced_ddp_worker, str(tmp_path), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name in ranks[0]:  # the ranks agree on everything, scales and histories included
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    model = mlp("delayed", second="delayed")
    replica = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(3, seed=2):
        replica.load_state_dict(model.state_dict())
        grads = []
        for rank, net in enumerate((model, replica)):
            net.zero_grad()
            half = slice(rank * 4, rank * 4 + 4)
            F.mse_loss(net(x[half] * (1 + 3 * rank)), y[half]).backward()
            grads.append([p.grad for p in net.parameters()])
        _max_of_replicas(model, replica)
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / WORLD
        opt.step()
    for name, value in state(model).items():
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-6, atol=1e-7, msg=name)
    # the first layer's newest input amax is rank 1's (its inputs are 4x larger), on both
    x, _ = batches(3, seed=2)[-1]
    assert ranks[0]["0.input_amax_history"][0] == (x[4:8] * 4).abs().max()


def _trainer_worker(rank: int, out_dir: str) -> None:
    model = mlp("delayed", second="delayed")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 32, generator=g) * torch.linspace(0.5, 4, 32)[:, None]
    trainer = Trainer(
        precision="32-true", strategy="ddp", devices=WORLD, max_steps=3, seed=0, logger=False,
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    loader = DataLoader(TensorDataset(x, torch.randn(32, 16, generator=g)), batch_size=4)
    trainer.fit(model, loader, loss_fn=F.mse_loss, optimizer=partial(torch.optim.SGD, lr=0.1))
    torch.save(state(model), f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_the_trainer_syncs_amax_histories_across_ranks(tmp_path):
    run_ranks(_trainer_worker, str(tmp_path), nprocs=WORLD)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    for name in r0:
        assert torch.equal(r0[name], r1[name]), name
    assert (r0["2.grad_output_amax_history"][:3] > 0).all()  # three steps recorded


class SharedTwice(nn.Module):
    """A delayed float8 layer applied twice per step, each call its own checkpoint region
    when `regions` is given (its backward for the second call runs before the first call's
    recompute)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        convert_to_float8(self, recipe="delayed", amax_history_length=4, skip_small=False)
        self.regions: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        for _ in range(2):
            if self.regions is None:
                h = F.gelu(self.shared(h))
            else:
                h = checkpoint(lambda t: F.gelu(self.shared(t)), h, use_reentrant=self.regions)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("shared", [False, True], ids=["whole-model", "shared-layer"])
def test_activation_checkpointing_records_once_and_recomputes_the_same_values(reentrant, shared):
    """A non-reentrant recompute pushed every input and weight amax a second time and
    quantized with the scales the first forward had just updated; now histories, scales,
    gradients and weights equal those of the run without checkpointing, bit for bit."""
    plain = SharedTwice() if shared else mlp("delayed")
    checkpointed = copy.deepcopy(plain)
    if shared:
        checkpointed.regions = reentrant
        forward = checkpointed
    else:

        def forward(x: torch.Tensor) -> torch.Tensor:
            return checkpoint(checkpointed, x, use_reentrant=reentrant)

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, checkpointed)]
    for step, (x, y) in enumerate(batches(4)):
        grads = []
        for model, opt, run in zip((plain, checkpointed), opts, (plain, forward), strict=True):
            opt.zero_grad()
            xi = (x * (1 + step)).requires_grad_()  # growing amaxes: stale scales show
            F.mse_loss(run(xi), y).backward()
            opt.step()
            grads.append([xi.grad, *(p.grad for p in model.parameters())])
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b), step
        for (name, a), b in zip(state(plain).items(), state(checkpointed).values(), strict=True):
            assert torch.equal(a, b), (step, name)
    first = plain.inp if shared else plain[0]
    amaxes = [(x * (1 + step)).abs().max().item() for step, (x, _) in enumerate(batches(4))]
    assert first.input_amax_history.tolist() == amaxes[::-1]  # each pushed once, in order


def test_sync_is_a_no_op_in_one_process():
    model = mlp("delayed")
    before = state(model)
    assert sync_amax_histories(model) == 0 and sync_amax_histories(nn.Linear(2, 2)) == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _sm89() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.cuda
@pytest.mark.skipif(not _sm89(), reason="needs a CUDA GPU of compute capability 8.9+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"])
def test_real_scaled_mm_matches_the_emulation_on_gpu(recipe):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, device="cuda")
    real = Float8Linear.from_float(copy.deepcopy(linear), recipe)
    emulated = Float8Linear.from_float(copy.deepcopy(linear), recipe, emulate=True)
    x = torch.randn(40, 64, device="cuda")
    g = torch.randn(40, 48, device="cuda")
    results = []
    for module in (real, emulated):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(xi)
        y.backward(g.to(y.dtype))
        results.append((y.float(), xi.grad, module.weight.grad))
    # same float8 operands; the kernel applies the scales after a float32 accumulation
    for name, a, b in zip(("y", "grad_x", "grad_w"), *results, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3 * b.abs().max().item(), msg=name)
