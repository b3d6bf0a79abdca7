"""`shard` refuses, before touching the model, what FSDP2 would shard wrongly or crash on
deep inside: a second sharding, a wrapped or converted model, bad arguments, ranks that
disagree on the policy; and says when a rule names no module, as `apply` does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from nets import BlockNet
from spawning import run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec import PolicyMap, PrecisionError
from mixprec.sharding import shard


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group: FSDP2 shards over a world of one."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def _unchanged(model: nn.Module) -> bool:
    return all(p.dtype == torch.float32 and type(p) is nn.Parameter for p in model.parameters())


def test_a_model_sharded_once_is_not_sharded_again(one_rank):
    model = BlockNet()
    shard(model, "32-true")
    with pytest.raises(PrecisionError, match=r"already sharded by FSDP2 \(<root>, blocks.0"):
        shard(model, "bf16-mixed")
    partly = BlockNet()
    torch.distributed.fsdp.fully_shard(partly.blocks[0])
    with pytest.raises(PrecisionError, match=r"already sharded by FSDP2 \(blocks.0\)"):
        shard(partly, "bf16-mixed")


def test_apply_refuses_a_sharded_model(one_rank):
    model = BlockNet()
    shard(model, "bf16-mixed", allow_slow=True)
    with pytest.raises(TypeError, match="sharded by FSDP2 .*give the policy to"):
        mixprec.apply(model, "32-true")


def test_a_wrapped_model_is_refused_naming_the_plain_one(one_rank):
    model = BlockNet()
    wrapped = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(PrecisionError, match=r"DistributedDataParallel wrapper.*model.module"):
        shard(wrapped, PolicyMap("bf16-mixed", {"head": "32-true"}))
    with pytest.raises(PrecisionError, match="OptimizedModule wrapper"):
        shard(torch.compile(BlockNet()), "bf16-mixed")
    assert _unchanged(model)


def test_the_trainer_refuses_a_ddp_wrapped_model(one_rank):
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    trainer = mixprec.Trainer(
        max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False
    )
    with pytest.raises(TypeError, match=r"wrapped in DistributedDataParallel.*model.module"):
        trainer.fit(
            nn.parallel.DistributedDataParallel(BlockNet()), data, loss_fn=nn.functional.mse_loss
        )


def test_a_model_converted_by_apply_is_refused(one_rank):
    model = BlockNet()
    mixprec.apply(model, "32-true")
    with pytest.raises(PrecisionError, match=r"converted by mixprec.apply \(<root>\)"):
        shard(model, "bf16-mixed")
    mixprec.remove(model)
    shard(model, "bf16-mixed", allow_slow=True)  # the plain model shards


def test_bad_mesh_and_reduce_dtype_are_refused_before_sharding(one_rank):
    model = BlockNet()
    with pytest.raises(TypeError, match="mesh must be None .* or a torch DeviceMesh, got str"):
        shard(model, "bf16-mixed", mesh="cpu")
    with pytest.raises(TypeError, match=r"reduce_dtype must be None .* or a floating torch.dtype"):
        shard(model, "bf16-mixed", reduce_dtype=torch.int8)
    # (found by a review: accepted, float16 sums flushed 46 of 144 small gradients to zero)
    with pytest.raises(PrecisionError, match=r"reduce_dtype=torch.float16 .*DynamicLossScaler"):
        shard(model, "bf16-mixed", reduce_dtype=torch.float16, allow_slow=True)
    assert _unchanged(model)
    scaler = mixprec.optim.scaling.DynamicLossScaler()
    shard(model, "bf16-mixed", reduce_dtype=torch.float16, scaler=scaler, allow_slow=True)


def test_a_rule_naming_no_module_warns_as_apply_does(one_rank):
    with pytest.warns(UserWarning, match=r"'blocks.9.fc' matches no module .*closest paths"):
        shard(BlockNet(), PolicyMap("bf16-mixed", {"blocks.9.fc": "32-true"}), allow_slow=True)


def _disagreeing(rank: int) -> None:
    with pytest.raises(PrecisionError, match="the ranks shard under different policies"):
        shard(BlockNet(), "bf16-mixed" if rank == 0 else "32-true", allow_slow=True)


@pytest.mark.slow
def test_ranks_sharding_under_different_policies_are_refused_on_every_rank():
    # before: gloo aborted the processes ("Received data size doesn't match expected size")
    run_ranks(_disagreeing)


class _Masked(nn.Module):
    """Attention scores with an additive float32 mask, its padded row at float32's lowest."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2) + mask
        return self.layers[0](torch.softmax(scores, -1) @ x)


@pytest.mark.parametrize("spec", ["bf16-true", "bf16-mixed"])
def test_a_masks_lowest_value_stays_finite_when_a_unit_casts_its_inputs(one_rank, spec):
    """FSDP2 cast each unit's inputs with a plain cast: a float32 mask's lowest value became
    -inf in bfloat16, and a fully masked (padded) row's softmax NaN, where `apply` keeps it
    at bfloat16's lowest. The units' inputs are cast as `apply` casts them."""
    x = torch.randn(1, 3, 8)
    mask = torch.zeros(1, 3, 3)
    mask[0, 0, :] = torch.finfo(torch.float32).min
    torch.manual_seed(0)
    sharded = shard(_Masked(), spec, allow_slow=True)
    out = sharded(x, mask=mask)
    assert not out.isnan().any()
    torch.manual_seed(0)
    applied = mixprec.apply(_Masked(), spec)
    assert torch.equal(out, applied(x, mask))


@pytest.mark.parametrize(
    "rules", [("bf16-true", {"head": "bf16-mixed"}), ("bf16-mixed", {r"blocks\.0": "bf16-true"})]
)
def test_a_rule_changing_only_the_storage_dtype_is_a_unit_of_its_own(one_rank, rules):
    """A rule storing its module's weights in another dtype than its parent's, at the same
    compute dtype, left it inside its parent's unit, and FSDP2 failed at the first forward
    ("expects uniform original parameter dtype"), after `shard` had cast and sharded the
    model. It is a unit of its own and trains."""
    default, rule = rules
    model = shard(BlockNet(), PolicyMap(default, rule), allow_slow=True)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    nn.functional.mse_loss(model(x).float(), y).backward()
    assert all(p.grad is not None for p in model.parameters())
