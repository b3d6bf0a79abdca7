"""Trainer(strategy="fsdp") on gloo with two real processes, and the combinations it refuses.

One group of two processes (started here, joined by the Trainer as a torchrun-launched one
would be) runs every distributed scenario, since processes are costly on a shared 2-core host;
one more test lets the Trainer spawn the processes itself."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from nets import BlockNet
from spawning import WORLD, run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import QUIET

from mixprec import PolicyMap, Precision
from mixprec.errors import PrecisionError
from mixprec.optim.scaling import DynamicLossScaler
from mixprec.trainer import Callback, Trainer, TrainingModule
from mixprec.trainer.strategy import FSDP, FSDPStrategy

# what a script run in a subprocess imports from: this folder (the test module) and the
# tests folder (the shared helpers)
SCRIPT_PATH = [str(Path(__file__).parent), str(Path(__file__).parents[1])]


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return TensorDataset(x, 0.1 * (x @ torch.tensor([[1.0], [-1.0], [0.5], [2.0]])))


class Overflowing(TrainingModule):
    """Rank 1 alone puts inf into its gradients on the second batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = BlockNet(tanh=True)

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def training_step(self, batch, batch_idx):
        out = self(batch[0])
        if batch_idx == 1 and self.trainer.strategy.global_rank == 1:
            out.register_hook(lambda g: g * float("inf"))
        return F.mse_loss(out, batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Seen(Callback):
    """What each rank's run looked like: parameter types and dtypes, skipped steps."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_fit_end(self, trainer, model):
        params = list(model.parameters())
        self.seen = {
            "param_types": {type(p).__name__ for p in params},
            "param_dtypes": {p.dtype for p in params},
            "local_numel": sum(getattr(p, "_local_tensor", p).numel() for p in params),
            "skipped": trainer.precision.scaler.stats().skipped_steps,
            "global_step": trainer.global_step,
        }


adamw = functools.partial(torch.optim.AdamW, lr=0.02)


def _fit(strategy: Any, precision: str, path: Path, **flags: Any) -> dict[str, Any]:
    """A 2-epoch fit; its weights exported to ``path``."""
    seen = Seen()
    trainer = Trainer(
        precision=precision,
        strategy=strategy,
        devices=WORLD,
        max_epochs=2,
        allow_slow_precision=True,
        callbacks=[seen],
        seed=0,
        **QUIET,
        **flags,
    )
    loader = DataLoader(data(), batch_size=8, shuffle=True)
    trainer.fit(BlockNet(tanh=True), loader, loss_fn=F.mse_loss, optimizer=adamw)
    trainer.save_full_state_dict(path)  # after the fit
    return {**seen.seen, "summary": trainer.summary()}


def _overflow() -> dict[str, Any]:
    seen = Seen()
    # a scale that overflows only where the inf is put (65536 overflows float16 here)
    precision = Precision("16-mixed", scaler=DynamicLossScaler(init_scale=256.0), allow_slow=True)
    trainer = Trainer(
        precision=precision, strategy="fsdp", devices=WORLD, max_steps=4, seed=0,
        allow_slow_precision=True, callbacks=[seen], **QUIET,
    )  # fmt: skip
    model = Overflowing()
    trainer.fit(model, DataLoader(data(), batch_size=8))
    # the model stays sharded in this process: validating reuses its units ...
    [metrics] = trainer.validate(model, DataLoader(data(), batch_size=8))
    # ... which another precision cannot
    other = Trainer(precision="32-true", strategy="fsdp", devices=WORLD, max_steps=1, **QUIET)
    try:
        other.fit(model, DataLoader(data(), batch_size=8))
        refusal = ""
    except PrecisionError as err:
        refusal = str(err)
    return {**seen.seen, "val_loss": metrics["val_loss"], "refusal": refusal}


class _Shifted(BlockNet):
    """BlockNet whose input layer's output is shifted by a float32 buffer (a position
    table), which a mixed policy keeps in float32."""

    def __init__(self) -> None:
        super().__init__(tanh=True)
        self.register_buffer("shift", torch.linspace(-1, 1, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x) + self.shift
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _island() -> dict[str, Any]:
    """A bf16-mixed fit with a float32 rule on the head and a float32 buffer: the head's
    largest error against its float64 product (float32's ~1e-7, bfloat16's ~1e-3), and
    the final weights' dtypes."""
    errors: list[float] = []

    def check(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        with torch.no_grad():
            exact = F.linear(args[0].double(), module.weight.double(), module.bias.double())
            errors.append(((out.double() - exact).abs().max() / exact.abs().max()).item())

    model = _Shifted()
    model.head.register_forward_hook(check)
    precision = PolicyMap("bf16-mixed", {"head": "32-true"})
    trainer = Trainer(
        precision=precision, strategy="fsdp", devices=WORLD, max_steps=2, seed=0,
        allow_slow_precision=True, **QUIET,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data(), batch_size=8), loss_fn=F.mse_loss, optimizer=adamw)
    return {"head_error": max(errors), "calls": len(errors)}


class _RaisesAfterFirstBatch(Callback):
    """Raises after the first micro-batch of the first accumulation window."""

    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        raise RuntimeError("callback error")


class _RaisesAtStart(Callback):
    """Raises before the first forward."""

    def on_train_start(self, trainer, model):
        raise RuntimeError("callback error")


def _refit(directory: Path) -> dict[str, Any]:
    """A fit (2 micro-batches a step) raising inside its first window, caught; then the same
    model fit again one batch a step (as is a fresh model, for comparison): FSDP2's gradient
    sync flags after the raise, and both fits' weights exported."""

    def trainer(k: int, **flags: Any) -> Trainer:
        return Trainer(
            precision="32-true", strategy="fsdp", devices=WORLD, max_steps=2, seed=0,
            accumulate_grad_batches=k, **QUIET, **flags,
        )  # fmt: skip

    def fit(t: Trainer, model: nn.Module) -> None:
        t.fit(model, DataLoader(data(), batch_size=8, shuffle=True), loss_fn=F.mse_loss,
              optimizer=adamw)  # fmt: skip

    model = BlockNet(tanh=True)
    try:
        fit(trainer(2, callbacks=[_RaisesAfterFirstBatch()]), model)
        raised = False
    except RuntimeError:
        raised = True
    flags = {
        (name, group.reduce_grads, group.reshard_after_backward)
        for name, m in model.named_modules()
        if (group := getattr(getattr(m, "_get_fsdp_state", lambda: None)(), "_fsdp_param_group",
                             None)) is not None
    }  # fmt: skip
    unrun = BlockNet(tanh=True)  # (a fit raising before its first forward: no FSDP root yet)
    try:
        fit(trainer(1, callbacks=[_RaisesAtStart()]), unrun)
    except RuntimeError:
        pass
    for name, net in (("refit", model), ("unrun", unrun), ("fresh", BlockNet(tanh=True))):
        t = trainer(1)
        fit(t, net)
        t.save_full_state_dict(directory / f"{name}.pt")
    return {"raised": raised, "flags": flags}


def _worker(rank: int, out: str) -> None:
    directory = Path(out)
    step = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    synced = FSDP(sync_micro_batches=True)
    results = {
        "fsdp": _fit("fsdp", "bf16-mixed", directory / "fsdp.pt", **step),
        "ddp": _fit("ddp", "bf16-mixed", directory / "ddp.pt", **step),
        "synced": _fit(synced, "bf16-mixed", directory / "synced.pt", **step),
        "checkpoint": _fit(
            "fsdp", "bf16-mixed", directory / "checkpoint.pt", activations="checkpoint", **step
        ),
        "overflow": _overflow(),
        "int8": _fit("fsdp", "int8_from_bf16-mixed", directory / "int8.pt"),
        "int8_ddp": _fit("ddp", "int8_from_bf16-mixed", directory / "int8_ddp.pt"),
        "island": _island(),
        "refit": _refit(directory),
    }
    torch.save(results, directory / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out: Path = tmp_path_factory.mktemp("fsdp")
    run_ranks(_worker, str(out), nprocs=WORLD)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.slow
def test_fsdp_bf16_mixed_shards_float32_masters_and_ends_near_ddp(runs):
    out, ranks = runs
    for r in ranks:
        seen = r["fsdp"]
        assert seen["param_types"] == {"DTensor"} and seen["param_dtypes"] == {torch.float32}
        assert seen["global_step"] == 4  # 2 epochs x 4 batches / 2 micro-batches per step
        assert "x 2 (fsdp)" in r["fsdp"]["summary"]["device"]
    n = sum(p.numel() for p in BlockNet(tanh=True).parameters())
    assert ranks[0]["fsdp"]["local_numel"] + ranks[1]["fsdp"]["local_numel"] == n
    assert ranks[0]["fsdp"]["local_numel"] < n  # each rank holds a shard only
    fsdp, ddp = _weights(out / "fsdp.pt"), _weights(out / "ddp.pt")
    start = BlockNet(tanh=True).state_dict()
    assert fsdp.keys() == ddp.keys() == start.keys()
    moved = max((fsdp[k] - start[k]).abs().max().item() for k in start)
    assert moved > 0.02  # it trained
    for k in start:
        assert fsdp[k].dtype == torch.float32
        torch.testing.assert_close(fsdp[k], ddp[k], atol=5e-3, rtol=5e-3)


@pytest.mark.slow
def test_a_float32_rule_computes_in_float32_under_the_trainers_fsdp(runs):
    """The Trainer runs a step under autocast, which computed a float32 unit (a rule's
    Linear, float32 attention) in bfloat16 over FSDP2's casts; each unit now runs in its
    own compute dtype under it, and a 16-bit unit adding a float32 buffer still casts."""
    for r in runs[1]:
        assert r["island"]["calls"] >= 2 and r["island"]["head_error"] < 1e-5


@pytest.mark.slow
def test_fsdp_recomputing_every_layer_trains_as_keeping_them_bit_for_bit(runs):
    """Trainer(strategy="fsdp", activations="checkpoint"): the model is recomputed in the
    backward inside FSDP's hooks, and the weights come out as the same fit keeping its
    activations."""
    out, ranks = runs
    plain, recomputed = _weights(out / "fsdp.pt"), _weights(out / "checkpoint.pt")
    for k, v in plain.items():
        assert torch.equal(recomputed[k], v), k
    assert all(r["checkpoint"]["global_step"] == 4 for r in ranks)


@pytest.mark.slow
def test_gradient_accumulation_with_and_without_resharding_agree(runs):
    out, _ = runs
    unsharded, synced = _weights(out / "fsdp.pt"), _weights(out / "synced.pt")
    for k, v in unsharded.items():
        torch.testing.assert_close(v, synced[k], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_inf_on_one_rank_makes_both_skip_through_the_trainer(runs):
    _, ranks = runs
    for r in ranks:
        assert r["overflow"]["skipped"] == 1
        assert r["overflow"]["global_step"] == 4


@pytest.mark.slow
def test_a_sharded_model_is_reused_by_the_same_settings_and_refused_by_others(runs):
    _, ranks = runs
    for r in ranks:
        assert 0 < r["overflow"]["val_loss"] < 10
        assert "already sharded" in r["overflow"]["refusal"]


@pytest.mark.slow
def test_spawned_fsdp_returns_the_weights_to_the_callers_model(runs, tmp_path):
    out, _ = runs
    model = BlockNet(tanh=True)
    trainer = Trainer(
        precision="bf16-mixed",
        strategy="fsdp",
        devices=WORLD,
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        allow_slow_precision=True,
        seed=0,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(data(), batch_size=8, shuffle=True), loss_fn=F.mse_loss,
                optimizer=adamw)  # fmt: skip
    assert trainer.global_step == 4 and trainer.current_epoch == 2
    assert "fsdp" in trainer.summary()["device"]
    same_run = _weights(out / "fsdp.pt")  # the same fit, in a joined group
    for k, v in model.state_dict().items():  # the caller's model: plain float32, trained
        assert type(v) is torch.Tensor and v.dtype == torch.float32
        assert torch.equal(v, same_run[k]), k
    exported = trainer.save_full_state_dict(tmp_path / "full.pt")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in _weights(exported).items())
    [checkpoint] = (tmp_path / "logs" / "version_0" / "checkpoints").iterdir()
    assert checkpoint.is_dir() and (checkpoint / ".metadata").is_file()  # sharded


@pytest.mark.slow
def test_a_refit_after_a_fit_raised_mid_window_trains_as_a_fresh_model(runs):
    """Found by a review: a fit raising inside an accumulation window left the sharded model
    with FSDP2's gradient sync off (`no_sync` set the flags and never restored them) and its
    unsharded accumulated gradients in place (zero_grad does not reach them): a refit of the
    model never reduced its gradients, so never trained, or added a stale micro-batch's.
    The flags are restored on leaving each micro-batch, and a reused model is reset."""
    out, ranks = runs
    for r in ranks:
        assert r["refit"]["raised"]
        assert r["refit"]["flags"] and all(reduce and reshard for _, reduce, reshard
                                           in r["refit"]["flags"])  # fmt: skip
    refit, fresh = _weights(out / "refit.pt"), _weights(out / "fresh.pt")
    start = BlockNet(tanh=True).state_dict()
    assert max((fresh[k] - start[k]).abs().max().item() for k in start) > 0.01  # it trained
    for k, v in fresh.items():
        assert torch.equal(refit[k], v), k
    # (and one whose fit raised before any forward: FSDP2 had set up no root to reset, and
    # resetting it failed the refit, found by a diff review)
    unrun = _weights(out / "unrun.pt")
    for k, v in fresh.items():
        assert torch.equal(unrun[k], v), k


@pytest.mark.slow
def test_fsdp_quantizes_an_int8_policy_and_ends_near_ddp(runs):
    """strategy="fsdp" used to shard an int8 run as plain float layers."""
    out, ranks = runs
    for r in ranks:
        seen = r["int8"]
        assert seen["param_types"] == {"DTensor"} and seen["param_dtypes"] == {torch.float32}
        assert seen["global_step"] == 8  # 2 epochs x 4 batches per rank
    fsdp, ddp = _weights(out / "int8.pt"), _weights(out / "int8_ddp.pt")
    assert fsdp.keys() == ddp.keys()
    assert {"blocks.0.fc.qweight", "head.qweight", "inp.weight"} <= fsdp.keys()
    assert "head.weight" not in fsdp  # quantized: 16 inputs; inp (4 inputs) stays float
    for k, v in fsdp.items():
        if v.dtype == torch.int8:
            assert torch.equal(v, ddp[k]), k  # the int8 weights never train
        else:
            torch.testing.assert_close(v, ddp[k], atol=5e-3, rtol=5e-3, msg=k)


@pytest.mark.slow
def test_spawned_fsdp_hands_an_int8_run_back_to_the_callers_model_quantized(runs):
    out, _ = runs
    model = BlockNet(tanh=True)
    trainer = Trainer(
        precision="int8_from_bf16-mixed", strategy="fsdp", devices=WORLD, max_epochs=2,
        allow_slow_precision=True, seed=0, **QUIET,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data(), batch_size=8, shuffle=True), loss_fn=F.mse_loss,
                optimizer=adamw)  # fmt: skip
    assert type(model.head).__name__ == "Int8Linear" and type(model.inp) is nn.Linear
    same_run = _weights(out / "int8.pt")  # the same fit, in a joined group
    assert model.state_dict().keys() == same_run.keys()
    for k, v in model.state_dict().items():
        assert type(v) is torch.Tensor and torch.equal(v, same_run[k]), k


# -- refusals (no processes needed) -----------------------------------------------------------


def test_an_optimizer_built_before_sharding_is_refused_before_launching():
    model = BlockNet(tanh=True)
    trainer = Trainer(strategy="fsdp", devices=2, **QUIET)
    with pytest.raises(ValueError, match="after sharding.*functools.partial"):
        trainer.fit(model, DataLoader(data(), batch_size=8), loss_fn=F.mse_loss,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip


def test_an_optimizer_of_other_parameters_is_refused():
    strategy = FSDPStrategy("cpu", [0, 1])
    stale = torch.optim.SGD(BlockNet(tanh=True).parameters(), lr=0.1)
    with pytest.raises(PrecisionError, match="built before sharding.*configure_optimizers"):
        strategy.check_optimizers(BlockNet(tanh=True), [stale])


@pytest.mark.parametrize(
    "precision",
    [
        Precision("16-true", allow_slow=True),
        Precision("bf16-true", allow_slow=True, master_weights=True),
        Precision("bf16-true", allow_slow=True, compensation="kahan"),
    ],
    ids=["16-true", "bf16-true-masters", "bf16-true-kahan"],
)
def test_masters_beside_16_bit_shards_are_refused(precision):
    with pytest.raises(PrecisionError, match="'\\*-mixed' policy"):
        FSDPStrategy("cpu", [0, 1]).shard(BlockNet(tanh=True), precision)


def test_bad_fsdp_settings_and_predict_are_refused():
    with pytest.raises(ValueError, match="sync_micro_batches"):
        FSDP(sync_micro_batches="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduce_dtype"):
        FSDP(reduce_dtype=torch.int8)
    # (said when the Trainer is built, not in each launched process with shard's advice)
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.float16.*precision='16-mixed'"):
        Trainer(precision="bf16-mixed", strategy=FSDP(reduce_dtype=torch.float16), devices=2,
                allow_slow_precision=True)  # fmt: skip
    Trainer(precision="16-mixed", strategy=FSDP(reduce_dtype=torch.float16), devices=2,
            allow_slow_precision=True)  # fmt: skip
    with pytest.raises(ValueError, match="FSDP\\(\\.\\.\\.\\)"):
        Trainer(strategy="fsdp2")
    trainer = Trainer(strategy=FSDP(), devices=2, **QUIET)
    assert trainer.strategy.name == "fsdp"
    with pytest.raises(ValueError, match="predict runs on one device"):
        trainer.predict(BlockNet(tanh=True), [torch.zeros(2, 4)])


def test_export_after_a_single_device_fit_takes_the_float32_masters(tmp_path):
    model = BlockNet(tanh=True)
    trainer = Trainer(precision="16-true", max_steps=2, allow_slow_precision=True, **QUIET)
    trainer.fit(model, DataLoader(data(), batch_size=8), loss_fn=F.mse_loss, optimizer=adamw)
    [opt] = trainer.optimizers
    masters = {n: opt.master_params[p] for n, p in model.named_parameters()}
    exported = _weights(trainer.save_full_state_dict(tmp_path / "full.pt"))
    assert all(v.dtype == torch.float32 for v in exported.values())
    for name, master in masters.items():
        assert torch.equal(exported[name], master), name
    # the float16 weights are the masters rounded: the export keeps what they lose
    assert any(not torch.equal(m, m.half().float()) for m in masters.values())


TORCHRUN_SCRIPT = """
import sys
from pathlib import Path
sys.path[:0] = {tests!r}
from test_trainer_fsdp import _fit
from mixprec.trainer.strategy import end_finished_process

if __name__ == "__main__":
    seen = _fit("fsdp", "bf16-mixed", Path({out!r}) / "torchrun.pt",
                accumulate_grad_batches=2, gradient_clip_val=0.5)
    assert seen["param_types"] == {{"DTensor"}} and seen["global_step"] == 4, seen
    # its work written: skip the interpreter's teardown, where torch's C++ destructors run
    # after the process group and about one exit in four aborts (as the spawned ranks do)
    end_finished_process()
"""


@pytest.mark.slow
def test_torchrun_launched_fsdp_trains_as_the_joined_group_does(runs, tmp_path):
    """`torchrun --standalone --nproc-per-node 2 train.py` with strategy="fsdp": the Trainer
    joins torchrun's processes, and the fit equals the same fit in `runs`' group bit for
    bit."""
    out, _ = runs
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=SCRIPT_PATH, out=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # as run_ranks' processes
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(
        [*command, "--nproc-per-node", str(WORLD), str(script)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    torchrun, joined = _weights(tmp_path / "torchrun.pt"), _weights(out / "fsdp.pt")
    assert torchrun.keys() == joined.keys()
    for k, v in torchrun.items():
        assert torch.equal(v, joined[k]), k
