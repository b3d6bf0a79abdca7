"""`mixprec.sharding.shard` on FSDP2: real 2-process gloo runs on CPU, and the refusals.

One spawn runs every distributed scenario (processes are costly on a shared 2-core host) and
saves what each rank saw; the tests below read those results."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from devices import AVX2_CPU
from nets import BlockNet, Residual
from spawning import WORLD, run_ranks
from torch import nn

from mixprec import hardware
from mixprec.activations import install, wrapped
from mixprec.convert import sharded_units
from mixprec.errors import PolicySpecError, PrecisionError, SlowPrecisionError
from mixprec.hardware import ALLOW_SLOW_ENV
from mixprec.optim import LossScaleOptimizer
from mixprec.optim.scaling import DynamicLossScaler
from mixprec.policy import Policy
from mixprec.policy.map import PolicyMap, island_policy
from mixprec.precision import Precision
from mixprec.sharding import mixed_precision_policy, shard, units

STEPS = 4
LR = 0.05


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def _reference(model: BlockNet) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Full-batch float32 SGD in one process: what data-parallel training must match."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state: sharded parameters gathered, replicated buffers (int8 weights) as
    they are."""
    return {
        k: v.full_tensor().float() if hasattr(v, "full_tensor") else v
        for k, v in model.state_dict().items()
    }


def _bf16_mixed(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = BlockNet(8)
    ref_losses, ref_state = _reference(copy.deepcopy(model))
    seen: dict[str, torch.dtype] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            weight = getattr(module, "weight", None)
            seen[f"{name}.in"] = args[0].dtype
            seen[f"{name}.out"] = out.dtype
            if weight is not None:
                seen[f"{name}.weight"] = weight.dtype

        return hook

    for name in ("blocks.0.norm", "blocks.0.fc", "head"):
        model.get_submodule(name).register_forward_hook(record(name))
    model, opt = shard(
        model,
        "bf16-mixed",
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
        allow_slow=True,
    )
    x, y = _data()
    mine = slice(rank * 8, rank * 8 + 8)
    losses = []
    for _ in range(STEPS):
        out = model(x[mine])
        loss = F.mse_loss(out, y[mine])
        full = loss.detach().clone()
        dist.all_reduce(full)
        losses.append(full.item() / WORLD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "state": _full(model),
        "ref_state": ref_state,
        "seen": seen,
        "out_dtype": out.dtype,
        "param_dtypes": {p.dtype for p in model.parameters()},
    }


def _fp16_inf(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    model, opt = shard(
        BlockNet(8),
        "16-mixed",
        scaler=scaler,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
        allow_slow=True,
    )
    opt = LossScaleOptimizer(opt, scaler)
    x, y = _data()
    taken = []
    for step in range(3):
        opt.backward(F.mse_loss(model(x + rank), y))
        if step == 1 and rank == 1:
            model.inp.weight.grad.to_local()[0, 0] = math.inf  # rows 4-7 live on rank 1
        before = _full(model)
        taken.append(opt.step())
        moved = any(not torch.equal(before[k], v) for k, v in _full(model).items())
        assert moved == taken[-1]
        opt.zero_grad()
    return {"taken": taken, "scale": opt.loss_scale}


def _bf16_true(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, opt = shard(
        BlockNet(8),
        "bf16-true",
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
        allow_slow=True,
    )
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        out = model(x)
        loss = F.mse_loss(out.float(), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {
        "losses": losses,
        "out_dtype": out.dtype,
        "param_dtypes": {p.dtype for p in model.parameters()},
    }


def _int8(rank: int) -> dict[str, Any]:
    """int8 layers under FSDP on two ranks against one process training the same int8 model
    on the whole batch (Precision.setup, the apply path)."""
    torch.manual_seed(0)
    model = BlockNet(16)  # blocks.*.fc and head have 16 inputs: quantized; inp (4) is not
    start = model.head.bias.detach().clone()
    reference = copy.deepcopy(model)
    Precision("int8_from_float32").setup(reference)
    _, ref_state = _reference(reference)
    model, opt = shard(
        model, "int8_from_float32", optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR)
    )
    x, y = _data()
    mine = slice(rank * 8, rank * 8 + 8)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    params = dict(model.named_parameters())
    return {
        "types": {name: type(m).__name__ for name, m in model.named_modules()},
        "sharded": {type(p).__name__ for p in params.values()},
        "local_numel": sum(p.to_local().numel() for p in params.values()),
        "numel": sum(p.numel() for p in params.values()),
        "state": _full(model),
        "ref_state": {k: v.float() for k, v in ref_state.items()},
        "start_bias": start,
    }


def _activations(rank: int) -> dict[str, Any]:
    """Each activation option under shard on two ranks, against the same run keeping
    everything: what is on the model, and the weights after the steps."""

    def run(activations: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        torch.manual_seed(0)
        policy = PolicyMap("bf16-mixed", activations=activations)
        model, opt = shard(
            BlockNet(32),
            policy,
            optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR),
            allow_slow=True,  # (bf16 on a CPU without bf16 instructions: its numerics here)
        )
        x, y = _data()
        mine = slice(rank * 8, rank * 8 + 8)  # 8 rows of 32: whole fp8 blocks
        for _ in range(STEPS):
            opt.zero_grad()
            F.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
        Precision(policy, allow_slow=True).setup(model, convert=False)  # (carries the options)
        return _full(model), wrapped(model)

    options: list[Any] = [None, "checkpoint", {r"blocks\.\d+": "selective"}]
    options += [{r"blocks\.\d+": "fp8"}]
    return {str(option): run(option) for option in options}


def _outcome(attempt: Any) -> str:
    """What `attempt()` did: "ok", or the exception it raised (kept, not raised: one rank's
    failure here must not stop the other scenarios)."""
    try:
        attempt()
    except Exception as err:  # noqa: BLE001 - the test reads which exception, and its words
        return f"{type(err).__name__}: {err}"
    return "ok"


def _fp16_true(rank: int) -> dict[str, Any]:
    """'16-true' sharded and stepped through the documented LossScaleOptimizer (float32
    masters for float16 weights), then the offered way: no masters."""
    x, y = _data()
    mine = slice(rank * 8, rank * 8 + 8)

    def documented() -> None:
        scaler = DynamicLossScaler(init_scale=2.0**4)
        model = shard(BlockNet(8), "16-true", scaler=scaler, allow_slow=True)
        opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=LR), scaler)
        opt.backward(F.mse_loss(model(x[mine]).float(), y[mine]))
        assert opt.step()  # a taken step: it copies the masters into the shards

    def wrapped() -> None:  # sharded without the check, then wrapped with masters
        scaler = DynamicLossScaler()
        model = shard(BlockNet(8), "16-true", scaler=scaler, master_weights=False, allow_slow=True)
        LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=LR), scaler)

    trained: dict[str, Any] = {}

    def offered() -> None:  # without masters: the 16-bit shards are stepped themselves
        torch.manual_seed(0)
        model = BlockNet(8)
        trained["ref_losses"], _ = _reference(copy.deepcopy(model))
        scaler = DynamicLossScaler(init_scale=2.0**4)
        model = shard(model, "16-true", scaler=scaler, master_weights=False, allow_slow=True)
        opt = LossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR), scaler, master_weights=False
        )
        losses, taken = [], []
        for _ in range(STEPS):
            loss = F.mse_loss(model(x[mine]).float(), y[mine])
            full = loss.detach().clone()
            dist.all_reduce(full)
            losses.append(full.item() / WORLD)
            opt.backward(loss)
            taken.append(opt.step())
            opt.zero_grad()
        trained.update(
            losses=losses,
            taken=taken,
            param_dtypes={p.dtype for p in model.parameters()},
            state=_full(model),
        )

    return {
        "documented": _outcome(documented),
        "wrapped": _outcome(wrapped),
        "offered": _outcome(offered),
        **trained,
    }


class _Tied(nn.Module):
    """An embedding whose table the head shares (``tied``), or whose forward reads it as
    its output projection (not tied: the parent reads its child's weight)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(32, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False) if tied else None
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, t):
        h = torch.tanh(self.fc(self.emb(t)))
        return self.head(h) if self.head is not None else F.linear(h, self.emb.weight)


def _refused(rank: int) -> dict[str, Any]:
    """What shard refuses before the model changes (each outcome, and whether the model
    was left unsharded)."""
    from torch.distributed.device_mesh import DeviceMesh

    out: dict[str, Any] = {}
    cases = {
        "tied": (lambda: _Tied(True), {"head": "32-true"}, None),
        "reads": (lambda: _Tied(False), {"emb": "32-true"}, None),
        "out_proj": (
            lambda: nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True)),
            {"0.out_proj": "32-true"},
            None,
        ),
        "mesh": (lambda: _Tied(False), {}, lambda: DeviceMesh("cpu", [0])),
    }
    for name, (make, rules, mesh) in cases.items():
        model = make()
        given = mesh() if mesh is not None else None
        pmap = PolicyMap("bf16-mixed", rules)
        out[name] = _outcome(lambda m=model, p=pmap, g=given: shard(m, p, mesh=g))
        out[f"{name}_untouched"] = not sharded_units(model)
    return out


class _Attends(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


def _attention(rank: int) -> dict[str, Any]:
    """The dtype scaled_dot_product_attention's query arrives in, under a bf16-mixed map
    asking attention in float32."""
    from torch.overrides import TorchFunctionMode

    seen: list[torch.dtype] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = shard(_Attends(), PolicyMap("bf16-mixed", float32_attention=True))
    with Record():
        model(torch.randn(2, 6, 16))
    return {"query": seen}


def _batchnorm(rank: int) -> dict[str, Any]:
    """A BatchNorm under bf16-mixed, sharded: one forward and backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    model = shard(model, "bf16-mixed")
    out = model(torch.randn(4, 8))
    out.float().sum().backward()
    return {"out": out.dtype, "finite": bool(torch.isfinite(out).all())}


def _f64(rank: int) -> dict[str, Any]:
    """One backward of a "64-true" model sharded with the default reduce dtype, each rank on
    its half of the batch: the largest error of its gradients against one process's on the
    whole batch, relative to the gradient."""
    torch.manual_seed(0)
    model = BlockNet(8).double()
    reference = copy.deepcopy(model)
    x, y = (t.double() for t in _data())
    half = slice(rank * 8, rank * 8 + 8)
    sharded = shard(model, "64-true")
    F.mse_loss(sharded(x[half]), y[half]).backward()
    (0.5 * (F.mse_loss(reference(x[:8]), y[:8]) + F.mse_loss(reference(x[8:]), y[8:]))).backward()
    errors = {}
    for (name, p), ref in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        grad = p.grad.full_tensor()
        errors[name] = (grad.dtype, ((grad - ref.grad).abs().max() / ref.grad.abs().max()).item())
    return {"errors": errors}


def _worker(rank: int, out_dir: str) -> None:
    # the ranks study 16-bit numerics on tiny tensors, on any CPU (a CPU without bf16
    # instructions refuses bf16 as slow: tested in this process with described hardware)
    os.environ[ALLOW_SLOW_ENV] = "1"
    scenarios = (
        _bf16_mixed, _fp16_inf, _bf16_true, _int8, _fp16_true, _activations, _refused, _attention,
        _batchnorm, _f64,
    )  # fmt: skip
    results = {f.__name__: f(rank) for f in scenarios}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("sharding")
    run_ranks(_worker, str(out), nprocs=WORLD)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.slow
def test_bf16_mixed_trains_like_full_batch_float32(ranks):
    for r in ranks:
        got = r["_bf16_mixed"]
        assert got["param_dtypes"] == {torch.float32}  # sharded float32 masters
        assert got["losses"][-1] < got["losses"][0]
        assert got["losses"] == pytest.approx(got["ref_losses"], rel=3e-2)
        for key, ref in got["ref_state"].items():
            torch.testing.assert_close(got["state"][key], ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ranks[0]["_bf16_mixed"]["state"], ranks[1]["_bf16_mixed"]["state"])


@pytest.mark.slow
def test_layernorm_is_a_float32_island_and_inner_units_keep_their_dtype(ranks):
    seen = ranks[0]["_bf16_mixed"]["seen"]
    assert seen["blocks.0.norm.in"] == seen["blocks.0.norm.weight"] == torch.float32
    assert seen["blocks.0.norm.out"] == torch.float32  # computed in float32 ...
    # ... and handed back to its block in the dtype the block computes in
    assert seen["blocks.0.fc.in"] == seen["blocks.0.fc.weight"] == torch.bfloat16
    # an inner unit casts no output: the last block hands bf16 to the root's head
    assert seen["head.in"] == seen["head.weight"] == torch.bfloat16
    assert ranks[0]["_bf16_mixed"]["out_dtype"] == torch.float32  # the root's output dtype


@pytest.mark.slow
def test_inf_on_one_rank_skips_on_both_under_16_mixed(ranks):
    for r in ranks:
        assert r["_fp16_inf"]["taken"] == [True, False, True]
        assert r["_fp16_inf"]["scale"] == 2.0**9


@pytest.mark.slow
def test_bf16_true_casts_storage_before_sharding(ranks):
    for r in ranks:
        got = r["_bf16_true"]
        assert got["param_dtypes"] == {torch.bfloat16}
        assert got["out_dtype"] == torch.bfloat16
        assert all(math.isfinite(v) for v in got["losses"])
        assert got["losses"][-1] < got["losses"][0]


@pytest.mark.slow
def test_int8_layers_train_sharded_on_two_ranks_as_one_process_does(ranks):
    for r in ranks:
        got = r["_int8"]
        assert got["types"]["blocks.0.fc"] == got["types"]["head"] == "Int8Linear"
        assert got["types"]["inp"] == "Linear"  # 4 inputs: left float
        assert got["sharded"] == {"DTensor"} and got["local_numel"] < got["numel"]
        assert got["state"].keys() == got["ref_state"].keys()
        for key, ref in got["ref_state"].items():
            if key.endswith(("qweight", "weight_scale")):
                assert torch.equal(got["state"][key], ref), key  # never trained
            else:  # the two ranks' mean gradient is the full batch's, up to rounding
                torch.testing.assert_close(got["state"][key], ref, atol=1e-6, rtol=1e-5)
        assert (got["state"]["head.bias"] - got["start_bias"]).abs().max() > 1e-3
    torch.testing.assert_close(ranks[0]["_int8"]["state"], ranks[1]["_int8"]["state"])


@pytest.mark.slow
def test_16_true_with_float32_masters_is_refused_at_set_up_not_at_the_first_step(ranks):
    """It was accepted, and the first taken step raised NotImplementedError from inside
    torch (`_foreach_copy_` has no DTensor sharding strategy) while copying the masters."""
    for r in ranks:
        got = r["_fp16_true"]
        assert got["documented"].startswith(
            "PrecisionError: shard(model, '16-true') with master_weights=None, "
            "compensation=None would keep float32 master weights beside float16 parameters "
            "sharded by FSDP2"
        ), got["documented"]
        assert got["wrapped"].startswith(
            "PrecisionError: LossScaleOptimizer(SGD) with master_weights=None, "
            "compensation=None would keep float32 master weights beside float16"
        ), got["wrapped"]
        for said in (got["documented"], got["wrapped"]):
            assert "'16-mixed' rather than '16-true'" in said and "master_weights=False" in said


@pytest.mark.slow
def test_activation_options_go_on_before_sharding_and_recompute_bit_for_bit(ranks):
    """shard puts a map's activation options on the model as apply does; inside FSDP2's
    hooks a recomputed block is gathered again, so its weights end as keeping's, bit for
    bit; fp8 storage moves them a little."""
    for r in ranks:
        got = r["_activations"]
        kept, _ = got["None"]
        assert got["checkpoint"][1] == {"": "checkpoint"}
        assert got[str({r"blocks\.\d+": "selective"})][1] == {
            "blocks.0": "selective",
            "blocks.1": "selective",
        }
        for option in ("checkpoint", str({r"blocks\.\d+": "selective"})):
            for key, value in kept.items():
                assert torch.equal(got[option][0][key], value), (option, key)
        fp8, on = got[str({r"blocks\.\d+": "fp8"})]
        assert on == {"blocks.0": "fp8", "blocks.1": "fp8"}
        assert any(not torch.equal(fp8[k], v) for k, v in kept.items())
        for key, value in kept.items():
            torch.testing.assert_close(fp8[key], value, atol=2e-2, rtol=2e-2)


class _TwoIslands(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)
        self.norm2, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        x = x + self.fc(self.norm(x))
        return x + self.fc2(self.norm2(x))


def test_selective_over_two_units_is_refused_before_sharding(one_rank):
    """Found by a review: `selective` on a block holding two float32 islands (or on the
    root, holding the blocks) failed at the first backward inside torch's selective
    checkpoint ("invocation index ... not found in storage"); a block with one island
    recomputes exactly (the two-rank test above)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ModuleList([_TwoIslands(), _TwoIslands()]))
    for option in ({r"1\.\d+": "selective"}, "selective"):
        policy = PolicyMap("bf16-mixed", activations=option)
        with pytest.raises(PolicySpecError, match=r"would recompute \d+ FSDP2 units inside it"):
            shard(model, policy, allow_slow=True)
        assert not sharded_units(model)


class _ReadsItsNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(F.layer_norm(x, (8,), self.norm.weight, self.norm.bias))


def test_a_parent_reading_an_islands_weight_is_told_how_to_keep_the_island_in(one_rank):
    """Found by a review: the refusal said "give it its parent's rule" where the user gave
    no rule (the LayerNorm is a float32 island by default)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ModuleList([_ReadsItsNorm()]))
    with pytest.raises(PolicySpecError, match=r"reads its weight.*float32_islands=False"):
        shard(model, "bf16-mixed", allow_slow=True)
    shard(model, PolicyMap("bf16-mixed", float32_islands=False), allow_slow=True)


class _Scales(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.plist = nn.ParameterList([nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))])

    def forward(self, x):
        for p in self.plist:
            x = x * p
        return self.fc(x)


def test_a_storage_rule_on_a_parameter_list_is_refused_before_sharding(one_rank):
    """Found by a review: shard cast the list's parameters to bfloat16 and FSDP2 failed at
    the first forward ("FSDP expects uniform original parameter dtype"): a ParameterList has
    no forward to shard as a unit of its own."""
    model = _Scales()
    with pytest.raises(PolicySpecError, match=r"rule on 'plist' \(ParameterList\).*parent"):
        shard(model, PolicyMap("32-true", {"plist": "bf16-true"}), allow_slow=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not sharded_units(model)


def test_an_activation_option_a_module_cannot_take_is_refused_before_sharding(one_rank):
    """As apply refuses it: checkpoint on a block holding a BatchNorm that tracks running
    statistics, before anything is sharded; and setup(convert=False) refuses a model that
    does not carry its precision's options."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    with pytest.raises(PolicySpecError, match="BatchNorm1d"):
        shard(model, PolicyMap("32-true", activations={"": "checkpoint"}))
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())
    plain = shard(BlockNet(8), "32-true")
    with pytest.raises(ValueError, match="it carries none: shard it with mixprec.shard"):
        Precision("32-true", activations="fp8").setup(plain, convert=False)
    # a model carrying options of its own is refused, not wrapped a second time
    wrapped_first = BlockNet(8)
    install(
        wrapped_first,
        PolicyMap("32-true", activations="checkpoint").activation_choices(wrapped_first),
    )
    with pytest.raises(PolicySpecError, match=r"carries activation options already \(\{'': "):
        shard(wrapped_first, PolicyMap("32-true", activations="checkpoint"))
    assert wrapped(wrapped_first) == {"": "checkpoint"}


@pytest.mark.slow
def test_16_true_without_masters_trains_sharded_as_offered(ranks):
    for r in ranks:
        got = r["_fp16_true"]
        assert got["offered"] == "ok"
        assert got["param_dtypes"] == {torch.float16} and got["taken"] == [True] * STEPS
        assert got["losses"][-1] < got["losses"][0]
        assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-2)
    torch.testing.assert_close(ranks[0]["_fp16_true"]["state"], ranks[1]["_fp16_true"]["state"])


def test_units_are_blocks_and_islands_innermost_first_root_last():
    plan = units(BlockNet(8), "bf16-mixed")
    assert list(plan) == ["blocks.0.norm", "blocks.1.norm", "blocks.0", "blocks.1", ""]
    assert plan["blocks.0.norm"].compute_dtype == torch.float32
    assert plan["blocks.0"].compute_dtype == torch.bfloat16
    custom = units(
        BlockNet(8), PolicyMap("bf16-mixed", float32_islands=False), wrap=lambda n, m: False
    )
    assert list(custom) == [""]


def test_only_the_root_and_islands_cast_outputs():
    mixed = Policy("bf16-mixed")
    island = island_policy(mixed)
    root = mixed_precision_policy(mixed, enclosing=None)
    inner = mixed_precision_policy(mixed, enclosing=mixed)
    norm = mixed_precision_policy(island, enclosing=mixed)
    assert (root.param_dtype, root.output_dtype) == (torch.bfloat16, torch.float32)
    assert (inner.param_dtype, inner.output_dtype) == (torch.bfloat16, None)
    assert (norm.param_dtype, norm.output_dtype) == (torch.float32, torch.bfloat16)
    for p in (root, inner, norm):  # (inputs: cast by `shard`'s hook, masks kept finite)
        assert p.reduce_dtype == torch.float32 and not p.cast_forward_inputs


def test_float64_parameters_reduce_their_gradients_in_float64_by_default():
    """Found by a review: gradients were reduce-scattered in float32 whatever the policy, so
    "64-true" rounded its float64 gradients (relative error ~5e-8, DDP's none). The default
    is float32, or the parameters' dtype where wider; a reduce dtype given is kept."""
    f64, mixed = Policy("64-true"), Policy("bf16-mixed")
    assert mixed_precision_policy(f64, enclosing=None).reduce_dtype == torch.float64
    assert mixed_precision_policy(f64, enclosing=f64).reduce_dtype == torch.float64
    assert mixed_precision_policy(mixed, enclosing=None).reduce_dtype == torch.float32
    chosen = mixed_precision_policy(f64, enclosing=None, reduce_dtype=torch.float32)
    assert chosen.reduce_dtype == torch.float32


@pytest.mark.slow
def test_64_true_sharded_gradients_are_float64_exact(ranks):
    """Found by a review: a "64-true" model sharded with the default reduce dtype had its
    gradients summed in float32 (relative error ~5e-8 against one process)."""
    for r in ranks:
        for name, (dtype, error) in r["_f64"]["errors"].items():
            assert dtype == torch.float64 and error < 1e-14, (name, error)


def test_refuses_an_optimizer_built_before_sharding():
    model = BlockNet(8)
    before = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(PrecisionError, match="optimizer_factory"):
        shard(model, "32-true", optimizer=before)
    assert all(type(p) is nn.Parameter for p in model.parameters())  # left untouched


def test_refuses_float16_without_an_all_reducing_scaler():
    with pytest.raises(PrecisionError, match="DynamicLossScaler"):
        shard(BlockNet(8), "16-mixed", allow_slow=True)


def test_refuses_16_true_whose_optimizer_would_keep_float32_masters():
    """Checked before the process group: it was accepted, and failed at the first step."""
    with pytest.raises(PrecisionError, match="'16-mixed' rather than '16-true'"):
        shard(BlockNet(8), "16-true", scaler=DynamicLossScaler(), allow_slow=True)
    bf16_masters = "master_weights=True, compensation=None would keep float32 master weights"
    with pytest.raises(PrecisionError, match=f"'bf16-true'\\) with {bf16_masters}"):
        shard(BlockNet(8), "bf16-true", master_weights=True, allow_slow=True)
    with pytest.raises(PrecisionError, match="init_process_group"):  # what comes next
        shard(BlockNet(8), "16-true", scaler=DynamicLossScaler(), master_weights=False)
    with pytest.raises(TypeError, match="master_weights must be None, True or False"):
        shard(BlockNet(8), "32-true", master_weights="yes")  # type: ignore[arg-type]


def test_refuses_without_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(PrecisionError, match="init_process_group"):
        shard(BlockNet(8), "32-true")


def test_refuses_a_slow_policy_unless_allowed(monkeypatch, tmp_path):
    monkeypatch.delenv("MIXPREC_ALLOW_SLOW", raising=False)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        with hardware.assume(AVX2_CPU), pytest.raises(SlowPrecisionError, match="allow_slow"):
            shard(BlockNet(8), "bf16-mixed")
    finally:
        dist.destroy_process_group()


def test_the_uncompensated_warning_names_the_fsdp_fix_for_sharded_16_bit_weights(tmp_path):
    """Sharded bf16 weights can't take compensation or masters: the warning says what works."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        with pytest.warns(UserWarning, match="Sharded with FSDP, train a \\*-mixed policy"):
            precision = Precision("bf16-true", allow_slow=True)
            precision.setup(model, optimizer, convert=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("dtype", "wrap", "refused"),
    [
        (torch.float16, {}, "master_weights=None, compensation=None would keep float32 "
         "master weights beside float16"),
        (torch.bfloat16, {"master_weights": True}, "master_weights=True, compensation=None "
         "would keep float32 master weights beside bfloat16"),
        (torch.bfloat16, {"compensation": "kahan"}, "master_weights=None, "
         "compensation='kahan' would keep compensation buffers beside bfloat16"),
    ],
    ids=["float16-masters", "bfloat16-masters", "kahan"],
)  # fmt: skip
def test_loss_scale_optimizer_refuses_masters_beside_sharded_16_bit_weights(
    one_rank, dtype, wrap, refused
):
    """It wrapped them, and the first taken step failed inside torch on the DTensors
    (`_foreach_copy_` of the masters, a `view` in the compensated step)."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Sequential(nn.Linear(4, 8)).to(dtype))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PrecisionError, match=f"^LossScaleOptimizer\\(SGD\\) with {refused}"):
        LossScaleOptimizer(sgd, 4.0, **wrap)
    assert all(p.dtype == dtype for g in sgd.param_groups for p in g["params"])  # untouched
    # the offered way: no masters, no compensation (one warning: small updates round away)
    with pytest.warns(UserWarning, match="Sharded with FSDP, train a \\*-mixed policy"):
        opt = LossScaleOptimizer(sgd, 4.0, master_weights=False)
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(torch.ones(2, 4, dtype=dtype)).float().sum())
    assert opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_a_sharded_16_bit_group_added_to_a_wrapper_that_keeps_masters_is_refused(one_rank):
    from torch.distributed.fsdp import fully_shard

    opt = LossScaleOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), 4.0)
    sharded = fully_shard(nn.Linear(4, 8).half())
    with pytest.raises(PrecisionError, match="beside float16 parameters sharded by FSDP2"):
        opt.add_param_group({"params": sharded.parameters()})
    assert len(opt.param_groups) == 1 and not opt.master_params


class TokenNet(nn.Module):
    """An embedding, two LayerNorm blocks and a head: every layer quantizable."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(Residual(32) for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group: FSDP2 shards over a world of one."""
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("spec", "kinds"),
    [
        ("int8_from_float32", {"Int8Embedding", "Int8Linear"}),
        ("int4/16_from_float32", {"Int4Embedding", "Int4Linear"}),
        ("float8/rowwise_from_float32", {"Float8Linear"}),
        ("int8_from_bf16-mixed", {"Int8Embedding", "Int8Linear"}),
        ("int4/16_from_bf16-mixed", {"Int4Embedding", "Int4Linear"}),
        ("float8/rowwise_from_bf16-mixed", {"Float8Linear"}),
    ],
)
def test_quantized_policies_quantize_before_sharding_and_train(one_rank, spec, kinds):
    """They were ignored: the model was sharded as plain float layers. Now it is quantized
    as under apply, trains sharded, and computes what the apply path computes (the same
    losses under a float32 source; within bfloat16 rounding under bf16-mixed, where FSDP2
    casts parameters instead of autocast casting ops)."""
    torch.manual_seed(0)
    model = TokenNet()
    reference = copy.deepcopy(model)
    precision = Precision(spec, allow_slow=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference, ref_opt = precision.setup(reference, ref_opt)
    model, opt = shard(
        model, spec, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.5), allow_slow=True
    )
    found = {type(m).__name__.removeprefix("FSDP") for m in model.modules()}
    assert kinds <= found and "Linear" not in found  # every Linear was swapped
    assert {type(p).__name__ for p in model.parameters()} == {"DTensor"}
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    losses, ref_losses = [], []
    for _ in range(3):
        loss = F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        with precision.forward_context():
            ref_out = reference(ids)
        ref_loss = F.cross_entropy(ref_out.float().flatten(0, 1), ids.flatten())
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        precision.backward(ref_loss)
        precision.step(ref_opt)
        ref_opt.zero_grad()
    assert losses[-1] < losses[0]
    if spec.endswith("float32"):
        assert losses == ref_losses
    else:
        assert losses == pytest.approx(ref_losses, rel=5e-3)


def test_a_quantized_embedding_is_a_unit_that_hands_back_the_compute_dtype(one_rank):
    """Its rows come out in its scales' dtype (float32 under bf16-mixed): without a unit of
    its own a bfloat16 layer of the same unit would get them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 8))
    policy = PolicyMap("int8_from_bf16-mixed", {"1": "bf16-mixed"})  # a float Linear
    shard(model, policy, wrap=lambda name, m: False, allow_slow=True)
    assert type(model[0]).__name__ == "FSDPInt8Embedding" and type(model[1]) is nn.Linear
    plan = units(model, policy, wrap=lambda name, m: False)
    assert list(plan) == ["0", ""] and plan["0"].compute_dtype == torch.float32
    seen = {}
    model[1].register_forward_pre_hook(lambda m, args: seen.update(x=args[0].dtype))
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.float32  # the root's output dtype
    assert seen["x"] == torch.bfloat16


def test_float8_delayed_scales_stay_float32_when_a_true_policy_casts_the_storage(one_rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 1040, bias=False))  # 1040 > 1024 outputs: converted
    shard(model, "float8/delayed:4_from_bf16-true", allow_slow=True)
    layer = model[0]
    assert type(layer).__name__ == "FSDPFloat8Linear" and layer.weight.dtype == torch.bfloat16
    for _ in range(2):
        out = model((torch.randn(8, 32) * 1e-3).bfloat16())
        out.float().sum().backward()
    assert {b.dtype for b in layer.buffers()} == {torch.float32}
    assert layer.input_scale.item() > 0 and out.abs().max() > 0


def test_a_rule_naming_a_container_shards_its_children(one_rank):
    """A rule on a ModuleList made the list a unit of its own (its compute dtype differs
    from its parent's), which fully_shard refuses ("containers that do not implement
    forward") after the blocks inside were sharded already; the same map ran unsharded."""
    policy = PolicyMap("32-true", {"blocks": "bf16-mixed"})
    plan = units(BlockNet(8), policy)
    assert "blocks" not in plan and {"blocks.0", "blocks.1"} <= set(plan)
    assert plan["blocks.1"].compute_dtype == torch.bfloat16
    x = torch.randn(5, 4)
    reference = Precision(policy, allow_slow=True).setup(BlockNet(8))
    sharded = shard(BlockNet(8), policy, allow_slow=True)
    out = sharded(x)
    assert out.dtype == torch.float32  # (the head computes in float32 on bf16 blocks' output)
    torch.testing.assert_close(out, reference(x), rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_what_fsdp2_cannot_shard_apart_is_refused_before_the_model_changes(ranks):
    """Tied weights ruled into two units, a layer sharded apart from the parent reading its
    weight, a rule on out_proj alone: each failed at the first forward, after sharding, on
    torch's words; a mesh without this rank failed on a bare IndexError."""
    for rank, r in enumerate(ranks):
        assert r["_refused"]["tied"].startswith("PolicySpecError: 'emb.weight' and 'head.weight'")
        assert "reads its weight in its own forward" in r["_refused"]["reads"]
        assert "give the rule to '0' itself" in r["_refused"]["out_proj"]
        assert all(r["_refused"][f"{k}_untouched"] for k in ("tied", "reads", "out_proj"))
        mesh = r["_refused"]["mesh"]
        assert mesh == "ok" if rank == 0 else mesh.startswith("PrecisionError: rank 1 is not in")


@pytest.mark.slow
def test_float32_attention_is_carried_to_the_sharded_model(ranks):
    """shard resolved the map without its attention islands: float32_attention=True (and a
    CPU's own float32 attention) ran attention in bfloat16 under FSDP2."""
    for r in ranks:
        assert r["_attention"]["query"] == [torch.float32]


@pytest.mark.slow
def test_a_batchnorm_under_a_mixed_policy_is_a_float32_unit_and_runs(ranks):
    """FSDP2 gathered its weight in bfloat16 beside its float32 statistics, which the kernel
    refuses ("expected scalar type BFloat16 but found Float") at the first forward."""
    for r in ranks:
        assert r["_batchnorm"] == {"out": torch.float32, "finite": True}
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    plan = units(model, "bf16-mixed")
    assert plan["1"].compute_dtype == torch.float32 and plan[""].compute_dtype == torch.bfloat16


def _lora_worker(rank: int) -> None:
    import mixprec
    from mixprec.quantize import dequantize, enable_lora, merge_lora

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    mixprec.quantize(model, "int8")
    late = copy.deepcopy(model)
    enable_lora(model, 4)
    shard(model, "float32")
    for call in (merge_lora, dequantize):
        with pytest.raises(
            ValueError, match="on a model FSDP2 has sharded: its adapters are shards"
        ):
            call(model)
    shard(late, "float32")
    with pytest.raises(ValueError, match="enable LoRA before sharding"):
        enable_lora(late, 4)


def test_lora_on_a_sharded_model_is_refused_where_it_would_go_wrong():
    """Adapters added after sharding were plain tensors each rank trained apart (replicas
    0.08 apart after 3 steps, no warning); merging or dequantizing sharded adapters failed
    in torch's mixed Tensor/DTensor arithmetic. Both refused, saying what works."""
    run_ranks(_lora_worker, nprocs=WORLD)


def test_int8_scales_cast_to_float16_by_a_true_policy_are_rounded_to_keep_their_rows(one_rank):
    """A row of weights below 2^-14: its float32 scale, rounded to the nearest float16, fell
    below what its codes need or to 0 (the row came back zero after sharding under 16-true).
    The storage cast requantizes as ``.half()`` does."""
    from mixprec.optim.scaling import DynamicLossScaler
    from mixprec.quantize import quantize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight[0] = torch.randn(32) * 1e-6
    quantize(model, "int8")
    expected = copy.deepcopy(model[0]).half()
    shard(model, "16-true", scaler=DynamicLossScaler(), master_weights=False, allow_slow=True)
    assert model[0].weight_scale.dtype == torch.float16
    got = model[0].dequantized_weight()[0]
    assert torch.equal(got, expected.dequantized_weight()[0])
    assert got.abs().max() > 1e-6


class _TiedAcrossBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.blocks[0].weight


def test_a_tie_split_by_the_units_not_the_rules_is_told_so():
    """A weight tied between a default unit (a block) and a root-level layer, under one
    policy, was refused as "their rules differ", with advice (the same rule) that fixes
    nothing."""
    from mixprec.sharding import _check_units_apart, units

    model = _TiedAcrossBlocks()
    with pytest.raises(PolicySpecError, match=r"of one policy: the units chosen.*Give `wrap=`"):
        _check_units_apart(model, units(model, "32-true"))
    ruled = PolicyMap("32-true", {"out": "bf16-true"})
    with pytest.raises(PolicySpecError, match="their rules differ"):
        _check_units_apart(model, units(model, ruled, wrap=lambda name, m: False))
    _check_units_apart(model, units(model, "32-true", wrap=lambda name, m: False))


class _Masked(nn.Module):
    """A layer adding an additive mask kept at float32's lowest value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        mask = torch.zeros(4)
        mask[2:] = torch.finfo(torch.float32).min
        self.register_buffer("mask", mask)

    def forward(self, x):
        return self.lin(x) + self.mask


def test_a_full_checkpoint_loaded_after_shard_keeps_a_lowest_value_mask_finite(one_rank):
    """Found by a diff review: a float32 checkpoint loaded into a sharded bf16-true model
    (``set_model_state_dict(full_state_dict=True)``, FSDP2's usual order: shard, then
    load) turned a mask at float32's lowest value into -inf, as a load after `apply` did
    before its hook: shard registers the same cast on loads."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(_Masked(), _Masked())
    saved = copy.deepcopy(model.state_dict())
    model = shard(model, "bf16-true", allow_slow=True)
    set_model_state_dict(model, saved, options=StateDictOptions(full_state_dict=True))
    lowest = torch.finfo(torch.bfloat16).min
    assert model[0].mask.dtype == torch.bfloat16 and model[0].mask.min().item() == lowest
