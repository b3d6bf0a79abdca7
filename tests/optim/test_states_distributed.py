"""Low-bit optimizer states across processes, on 2 gloo ranks: under DDP every rank holds
the same states; under FSDP2 each rank quantizes its own shard, its states are DTensors
sharded like the parameters, and a `torch.distributed.checkpoint` save and load resumes
the run bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawning import WORLD, run_ranks
from torch import nn

from mixprec.optim.states import LowBitAdamW


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 300), nn.ReLU(), nn.Linear(300, 33))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(100 * i + rank)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 33, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _same_on_every_rank(t: torch.Tensor) -> bool:
    t = t.detach().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.detach()
    t = t.float()
    gathered = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(gathered, t)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def _ddp_worker(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model())
    opt = LowBitAdamW(model.parameters(), lr=1e-2, states="int4", min_size=1000, compile=False)
    _train(model, opt, range(4), rank)
    tensors = [p for p in model.parameters()]
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    assert {s["format"] for s in opt.state.values()} == {"int4", "float32"}
    assert all(_same_on_every_rank(t) for t in tensors)


def test_ddp_ranks_hold_identical_low_bit_states():
    run_ranks(_ddp_worker, nprocs=WORLD)


def _fsdp(states: str) -> tuple[nn.Module, LowBitAdamW]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, LowBitAdamW(model.parameters(), lr=1e-2, states=states, min_size=0, compile=False)


def _local_bits(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().view(torch.uint8) if local.dtype == torch.float8_e4m3fn else local


def _fsdp_worker(rank: int, path: str, states: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    straight, opt = _fsdp(states)
    _train(straight, opt, range(6), rank)
    weight = straight[0].weight
    codes = opt.state[weight]["exp_avg_codes"]
    assert isinstance(weight, DTensor) and isinstance(codes, DTensor)
    # the local shard (150 rows of 32) quantized in its own blocks, every rank's codes padded
    # to the same number of blocks
    fmt_block = {"int8": 256, "fp8": 256, "int4": 128}[states]
    local_blocks = -(-150 * 32 // fmt_block)
    assert opt.state[weight]["exp_avg_scales"].to_local().shape == (local_blocks,)
    assert codes.shape[0] == WORLD * codes.to_local().shape[0]

    first, opt_a = _fsdp(states)
    _train(first, opt_a, range(3), rank)
    model_state, optim_state = get_state_dict(first, opt_a)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)

    resumed, opt_b = _fsdp(states)
    model_state, optim_state = get_state_dict(resumed, opt_b)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(
        resumed, opt_b, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    _train(resumed, opt_b, range(3, 6), rank)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(_local_bits(a), _local_bits(b))
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        for name, value in opt.state[p].items():
            if torch.is_tensor(value):
                assert torch.equal(_local_bits(value), _local_bits(opt_b.state[q][name])), name


def test_fsdp2_states_are_sharded_and_resume_bit_identically_through_dcp(tmp_path):
    for states in ("int8", "int4"):
        run_ranks(_fsdp_worker, str(tmp_path / states), states, nprocs=WORLD)
    _one_process_refuses(str(tmp_path / "int8"))


def _one_process_refuses(path: str) -> None:
    """Codes cut in blocks within each rank's shard, loaded as one parameter's: the first
    weight's (150 + 150 rows of 32, 19 blocks each) have the length of the whole weight's 38
    blocks, so they loaded silently with every block after the first rank's misplaced."""
    import pytest
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    model = _model()
    opt = LowBitAdamW(model.parameters(), lr=1e-2, states="int8", min_size=0, compile=False)
    _train(model, opt, range(1), 0)
    model_state, optim_state = get_state_dict(model, opt)
    assert optim_state["state"]["0.weight"]["shards"] == 1
    # (the first weight alone: the others' codes differ in length, which DCP refuses itself)
    optim_state["state"] = {"0.weight": optim_state["state"]["0.weight"]}
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    assert loaded["optim"]["state"]["0.weight"]["shards"] == WORLD
    before = {k: v.clone() for k, v in opt.state[model[0].weight].items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match=f"cut into blocks within each of {WORLD} shards"):
        set_state_dict(
            model,
            opt,
            model_state_dict=loaded["model"],
            optim_state_dict=loaded["optim"],
            options=StateDictOptions(strict=False),
        )
    after = opt.state[model[0].weight]
    assert all(torch.equal(after[k], v) for k, v in before.items())


def _hsdp_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    # HSDP: replicated over the first mesh dimension, cut over the second (of size 1 here)
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    model, plain = _model(), _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    opt = LowBitAdamW(model.parameters(), lr=1e-2, states="int8", min_size=0, compile=False)
    plain_opt = LowBitAdamW(plain.parameters(), lr=1e-2, states="int8", min_size=0, compile=False)
    _train(model, opt, range(3), rank=0)  # (the same batches on both replicas)
    _train(plain, plain_opt, range(3), rank=0)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.detach())  # the whole parameter, stepped as one
        assert opt.state[p]["exp_avg_codes"].placements[1] == Shard(0)
    # a parameter cut on another dim than 0: refused before any state is made, naming why
    cut = nn.Linear(16, 512, bias=False)
    fully_shard(cut, shard_placement_fn=lambda p: Shard(1))
    refused = LowBitAdamW(cut.parameters(), lr=1e-2, states="int8", min_size=0, compile=False)
    cut(torch.randn(2, 16)).sum().backward()
    try:
        refused.step()
    except ValueError as err:
        assert "placed (Shard(dim=1),)" in str(err) and "shard it on dim 0" in str(err)
    else:
        raise AssertionError("a dim-1 cut was stepped")


def test_hsdp_states_cover_each_replicas_shard_and_other_cuts_are_refused():
    """On a 2-D mesh (HSDP) the states were laid out as if the parameter were cut over every
    process: each rank's codes covered half its local part, and the step failed on a bare
    'Expected cond to be True'; a parameter cut on dim 1 failed the same way."""
    run_ranks(_hsdp_worker, nprocs=WORLD)


def _whole_and_sharded(
    rows: int, features: int, dtype: torch.dtype, steps: int, **kwargs
) -> tuple[nn.Linear, nn.Linear, list[LowBitAdamW]]:
    """A Linear and its FSDP2-sharded twin, each stepped ``steps`` times by a `LowBitAdamW`
    of ``kwargs`` on the same gradients; the sharded one must equal the whole bit for bit."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    whole = nn.Linear(features, rows, bias=False).to(dtype)
    sharded = nn.Linear(features, rows, bias=False).to(dtype)
    sharded.load_state_dict(whole.state_dict())
    fully_shard(sharded)
    opts = [LowBitAdamW(m.parameters(), compile=False, **kwargs) for m in (whole, sharded)]
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        grad = torch.randn(rows, features, generator=g).to(dtype)
        whole.weight.grad = grad
        sharded.weight.grad = torch.distributed.tensor.distribute_tensor(
            grad, sharded.weight.device_mesh, sharded.weight.placements
        )
        for opt in opts:
            opt.step()
    assert torch.equal(sharded.weight.full_tensor(), whole.weight.detach())
    return whole, sharded, opts


def _stochastic_worker(rank: int) -> None:
    # 5 rows: 3 and 2 per rank
    kwargs = dict(lr=1e-3, states="float32", compensation="stochastic")
    _whole_and_sharded(5, 300, torch.bfloat16, 3, **kwargs)


def test_a_sharded_stochastic_step_draws_each_elements_bits_from_its_place_in_the_whole():
    """Each rank's shard drew its random bits from offset 0: element j of every shard took
    the same noise (identical rows stayed identical on every rank, where one process rounds
    them apart). Each shard now starts at its place in the whole parameter, so FSDP2's step
    is one process's, bit for bit."""
    run_ranks(_stochastic_worker, nprocs=WORLD)


def _whole_blocks_worker(rank: int) -> None:
    # rows of whole blocks: 17 and 16 per rank
    whole, sharded, opts = _whole_and_sharded(33, 256, torch.float32, 2, lr=1e-2, states="int8")
    # a whole torch state (the parameter's global shape) is refused before anything changes
    reference = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    whole.weight.grad = torch.ones(33, 256)
    reference.step()
    before = {
        k: v.clone() if torch.is_tensor(v) else v for k, v in opts[1].state[sharded.weight].items()
    }
    try:
        opts[1].load_state_dict(reference.state_dict())
    except ValueError as error:
        assert "whole tensor, where this optimizer's parameter is sharded by FSDP2" in str(error)
    else:
        raise AssertionError("a whole state loaded into a sharded optimizer")
    after = opts[1].state[sharded.weight]
    assert sorted(after) == sorted(before)
    assert all(
        torch.equal(local(after[k]), local(v)) for k, v in before.items() if torch.is_tensor(v)
    )


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def test_a_shard_of_whole_blocks_smaller_than_the_largest_steps_as_one_process():
    """Each rank's codes are padded to the largest shard's blocks; a shard of whole blocks
    stepped in one piece met them unsliced and failed on a bare "Expected cond to be True"
    on that rank alone (the other hung in its next collective): `Linear(256, 33)` at the
    default min_size. And a whole torch state loaded into the sharded optimizer passed the
    checks, then failed halfway, its states replaced."""
    run_ranks(_whole_blocks_worker, nprocs=WORLD)
