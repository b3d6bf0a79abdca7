"""The Trainer's parts on their own: data helpers (devices, lengths, skipping, sharding),
metric buffering and the summary, device flags, the config, a configured Precision."""

from __future__ import annotations

import collections
import csv
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from devices import AVX2_CPU, H100, ZEN4
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from trainers import QUIET

import mixprec
from mixprec.optim.scaling import DynamicLossScaler
from mixprec.trainer import Trainer
from mixprec.trainer.checkpoint import CheckpointError
from mixprec.trainer.config import TrainerConfig
from mixprec.trainer.data import (
    batch_size_of,
    distributed,
    generators,
    iterate_from,
    num_batches,
    set_epoch,
    to_device,
)
from mixprec.trainer.metrics import MetricStore, StepLog, summary_rows
from mixprec.trainer.optimizers import _held_formats, _resume_advice
from mixprec.trainer.resume import check_world
from mixprec.trainer.strategy import resolve_devices

# -- data -------------------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "x y")


def test_to_device_keeps_the_batch_structure():
    batch = {"a": [torch.zeros(2), (torch.ones(1), "text")], "p": Pair(torch.zeros(3), 7)}
    moved = to_device(batch, torch.device("meta"))
    assert moved["a"][0].device.type == "meta" and moved["a"][1][0].device.type == "meta"
    assert moved["a"][1][1] == "text" and isinstance(moved["a"][1], tuple)
    assert isinstance(moved["p"], Pair) and moved["p"].x.device.type == "meta"
    assert moved["p"].y == 7


def test_batch_size_of_reads_the_first_tensor():
    assert batch_size_of((torch.zeros(5, 2), torch.zeros(3))) == 5
    assert batch_size_of({"x": torch.zeros(4)}) == 4
    assert batch_size_of(torch.tensor(1.0)) == 1
    assert batch_size_of("no tensor") == 1


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n, dtype=torch.float32))


def test_num_batches_applies_limits_and_refuses_a_fraction_without_length():
    loader = DataLoader(TensorDataset(torch.zeros(10)), batch_size=3)  # 4 batches
    assert num_batches(loader, None, "train") == 4
    assert num_batches(loader, 0.5, "train") == 2
    assert num_batches(loader, 0.01, "train") == 1  # a positive fraction keeps one batch
    assert num_batches(loader, 9, "train") == 4
    assert num_batches(loader, 0, "val") == 0
    stream = DataLoader(Stream(10), batch_size=3)
    assert num_batches(stream, None, "train") is None
    assert num_batches(stream, 2, "train") == 2
    with pytest.raises(ValueError, match="limit_train_batches=0.5 is a fraction.*no len"):
        num_batches(stream, 0.5, "train")


class Counting(Dataset):
    """Records which samples were loaded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded.append(i)
        return torch.tensor(float(i))


def test_iterate_from_skips_on_the_sampler_without_loading_skipped_samples():
    data = Counting(10)
    calls = []
    batches = list(iterate_from(DataLoader(data, batch_size=3), 2, lambda: calls.append(1)))
    assert [b.tolist() for b in batches] == [[6.0, 7.0, 8.0], [9.0]]
    assert data.loaded == [6, 7, 8, 9] and calls == [1]


def test_iterate_from_drops_batches_of_an_iterable_and_replays_a_shuffle():
    got = [b.tolist() for b in iterate_from(DataLoader(Stream(7), batch_size=3), 1)]
    assert got == [[3.0, 4.0, 5.0], [6.0]]
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(TensorDataset(torch.arange(12)), batch_size=4, shuffle=True, generator=g)
    [state] = [gen.get_state() for gen in generators(loader)]
    full = [b[0].tolist() for b in loader]
    g.set_state(state)
    assert [b[0].tolist() for b in iterate_from(loader, 1)] == full[1:]


def test_distributed_shards_by_rank_and_refuses_what_it_cannot_shard():
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    shards = [[b[0].tolist() for b in distributed(loader, r, 2, seed=0)] for r in range(2)]
    assert shards == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    ddp_loader = distributed(loader, 0, 2, seed=0)
    set_epoch(ddp_loader, 5)
    assert ddp_loader.batch_sampler.sampler.epoch == 5
    assert distributed(ddp_loader, 0, 2, seed=0) is ddp_loader  # already sharded
    with pytest.raises(TypeError, match="map-style dataset"):
        distributed(DataLoader(Stream(4), batch_size=2), 0, 2, seed=0)
    with pytest.raises(TypeError, match="needs a torch.utils.data.DataLoader"):
        distributed([torch.zeros(2)], 0, 2, seed=0)
    custom = DataLoader(TensorDataset(torch.arange(4)), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(TypeError, match="custom batch_sampler"):
        distributed(custom, 0, 2, seed=0)


def test_evaluation_data_the_sampler_pads_is_named_not_counted_twice_silently():
    """Sharding 9 validation samples over 2 processes repeats one (DistributedSampler pads
    to equal shards): its epoch metrics counted it twice, silently (a mean of 0..8 read 3.6,
    not 4.0). Rank 0 warns for evaluation data; training data pads as torch's does."""
    odd = DataLoader(TensorDataset(torch.arange(9)), batch_size=2)
    with pytest.warns(UserWarning, match="9 samples over 2 processes.*repeats 1 of them"):
        distributed(odd, 0, 2, seed=0, evaluation=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distributed(odd, 1, 2, seed=0, evaluation=True)  # (said once, by rank 0)
        distributed(odd, 0, 2, seed=0)  # training
        even = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
        distributed(even, 0, 2, seed=0, evaluation=True)
        dropping = DataLoader(TensorDataset(torch.arange(9)), batch_size=2, drop_last=True)
        distributed(dropping, 0, 2, seed=0, evaluation=True)


# -- metrics ----------------------------------------------------------------------------------


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def test_metric_store_means_per_step_and_weighted_per_epoch():
    store = MetricStore()
    store.log("a", torch.tensor(1.0))
    store.log("a", 3.0)
    store.log("b", torch.tensor([2.0]), on_step=True, on_epoch=True, prog_bar=True)
    step = store.take_step(identity)
    assert {k: float(v) for k, v in step.items()} == {"a": 2.0, "b_step": 2.0}
    assert store.take_step(identity) == {}
    assert store.prog_bar == {"b_step", "b_epoch"}
    store.log("t", 1.0)  # a micro-batch of a window whose step is not taken yet
    store.training = False  # validation: epoch means by default
    store.log("v", 1.0, batch_size=3)
    store.log("v", 5.0, batch_size=1)
    # evaluation takes its own values only (before: the training epoch's "b_epoch" too)
    assert store.take_step(identity) == {}
    assert store.take_epoch(identity) == {"v": 2.0}
    store.training = True
    assert {k: float(v) for k, v in store.take_step(identity).items()} == {"t": 1.0}
    with store.epoch_hook("on_train_epoch_end"):  # epoch values there, as in Lightning
        store.log("e", 4.0)
        with pytest.raises(ValueError, match="in on_train_epoch_end logs a value for the epoch"):
            store.log("e", 4.0, on_step=True)
    assert store.take_step(identity) == {}
    assert store.take_epoch(identity) == {"b_epoch": 2.0, "e": 4.0}
    with pytest.raises(ValueError, match=r"shape \(2,\).*\.mean\(\)"):
        store.log("x", torch.zeros(2))
    with pytest.raises(ValueError, match="both False"):
        store.log("x", 1.0, on_step=False, on_epoch=False)
    with pytest.raises(ValueError, match="needs a real number"):
        store.log("x", "1")


class Sink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, metrics))


class Where:
    def __init__(self, zero: bool) -> None:
        self.device = torch.device("cpu")
        self.world_size = 2
        self.is_global_zero = zero


def test_step_log_logs_every_nth_step_row_on_rank_zero_with_the_throughput():
    sink = Sink()
    steplog = StepLog([sink], Where(zero=True), every_n_steps=5)
    steplog.start_timing()
    for step in range(1, 5):
        steplog.samples += 10
        steplog.step_row(step, {"loss": torch.tensor(float(step))})
    assert sink.rows == [] and steplog.callback_metrics == {}  # nothing read yet
    steplog.samples += 10
    steplog.step_row(5, {"loss": torch.tensor(5.0)})
    assert [s for s, _ in sink.rows] == [5]  # rows 1-4 were only the latest values
    row = sink.rows[0][1]
    assert row["loss"] == 5.0 and row["samples_per_sec"] > 0 and row["peak_memory_mib"] > 0
    assert steplog.fit_samples == 50  # the throughput covers the 5 steps
    steplog.step_row(6, {"loss": torch.tensor(6.0)})
    assert steplog.callback_metrics["loss"] == 5.0  # as last read back
    assert steplog.read()["loss"] == 6.0 and len(sink.rows) == 1  # read, not logged
    steplog.step_row(7, {"loss": torch.tensor(7.0)}, force=True)  # a stop request's step
    assert [s for s, _ in sink.rows] == [5, 7]
    # rows given with add reach the loggers, every n-th or with the next flush
    for step in range(7, 11):
        steplog.add(step, {"counted": torch.tensor(float(step))})
    assert len(sink.rows) == 2
    steplog.add(11, {"counted": 11.0})
    assert [s for s, _ in sink.rows] == [5, 7, 7, 8, 9, 10, 11]
    assert steplog.logged_metrics == {
        "loss": 7.0,
        "counted": 11.0,
        "samples_per_sec": row["samples_per_sec"],
        "peak_memory_mib": row["peak_memory_mib"],
    }
    assert steplog.throughput() > 0

    other = Sink()
    not_zero = StepLog([other], Where(zero=False))
    not_zero.add(1, {"loss": 1.0}, flush=True)
    assert other.rows == [] and not_zero.callback_metrics == {"loss": 1.0}
    assert not_zero.throughput() is None


def test_summary_rows_leave_out_the_per_step_figures():
    class Stats:
        scale = 1024.0
        skipped_steps = 2

    rows = summary_rows(
        {"precision": "16-mixed"},
        Stats(),
        123.4,
        "56 MiB resident (the whole process)",
        {"val_loss": 0.5, "lr": 0.1, "samples_per_sec": 3.0},
        "best.ckpt",
    )
    assert rows == {
        "precision": "16-mixed",
        "loss scale": "1024 (2 skipped steps)",
        "throughput": "123.4 samples/s",
        "peak memory": "56 MiB resident (the whole process)",
        "val_loss": "0.5",
        "checkpoint": "best.ckpt",
    }


# -- flags --------------------------------------------------------------------------------------


def test_resolve_devices():
    assert resolve_devices("cpu", "auto") == [0]
    assert resolve_devices("cpu", 3) == [0, 1, 2]
    for bad, message in [
        (0, "at least 1"),
        (True, "positive int"),
        ("2", "positive int"),
        ([0, 1], "needs accelerator='cuda'"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_devices("cpu", bad)
    with pytest.raises(ValueError, match="MPS has one device"):
        resolve_devices("mps", 2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="asks for GPU 0, but 0 are visible"):
            resolve_devices("cuda", [0])


def test_config_is_frozen_and_defaults_to_1000_epochs():
    config = TrainerConfig()
    assert config.max_epochs == 1000 and config.max_steps is None
    assert TrainerConfig(max_steps=5).max_epochs is None
    with pytest.raises(AttributeError):
        config.max_epochs = 3  # type: ignore[misc]
    trainer = Trainer(max_steps=5, accumulate_grad_batches=2, **QUIET)
    assert (trainer.max_steps, trainer.accumulate_grad_batches) == (5, 2)
    assert trainer.max_epochs is None


@pytest.mark.parametrize("value", [0, None, -1, 1.5, True])
def test_accumulate_grad_batches_has_one_rule_and_one_message(value):
    with pytest.raises(ValueError, match=r"accumulate_grad_batches must be an int >= 1 \("):
        Trainer(accumulate_grad_batches=value, **QUIET)


def test_a_configured_precision_is_the_one_the_runs_use_each_from_its_configured_scaler():
    # before: the Trainer rebuilt the Precision for each run from what it could read of it,
    # so trainer.precision was a copy and the given object never saw a step
    given = mixprec.Precision(
        "16-mixed", scaler=DynamicLossScaler(init_scale=2**12), allow_slow=True
    )
    trainer = Trainer(precision=given, max_steps=2, **QUIET)  # allow_slow comes along
    assert trainer.policy == mixprec.PolicyMap("16-mixed")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 4), 0.01 * torch.randn(8, 1))
    for _ in range(2):  # each fit starts from the configured scale, not the last run's state
        trainer.fit(nn.Linear(4, 1), DataLoader(data, batch_size=4), loss_fn=F.mse_loss)
        assert trainer.precision is given
        stats = given.scaler.stats()
        assert stats.scale == 2**12 and stats.steps == 2 and stats.skipped_steps == 0
        assert len(given.optimizers) == 1  # this fit's optimizer only
    with pytest.raises(ValueError, match="built for device meta"):
        Trainer(precision=mixprec.Precision("32-true", device="meta"), **QUIET)


def test_a_configured_precision_that_contradicts_the_trainer_is_refused():
    # before: allow_slow_precision=True silently rebuilt the Precision with allow_slow=True,
    # and a described device (device_info=) was dropped for the Trainer's own
    with pytest.raises(ValueError, match=r"built with allow_slow=False.*allow_slow=True"):
        Trainer(precision=mixprec.Precision("16-mixed"), allow_slow_precision=True, **QUIET)
    with pytest.raises(ValueError, match=r"describes its device as cuda:0 \(H100.*runs on cpu"):
        Trainer(precision=mixprec.Precision("32-true", device_info=H100), **QUIET)


def test_a_configured_precision_is_judged_on_its_described_device():
    with mixprec.hardware.assume(AVX2_CPU):  # the host, as the Trainer would detect it
        trainer = Trainer(precision=mixprec.Precision("auto", device_info=ZEN4), **QUIET)
    assert trainer.policy == mixprec.PolicyMap("bf16-mixed")
    assert trainer.device_description.startswith("cpu (AMD Zen 4;")


def test_the_trainer_checks_the_device_once_when_built_not_again_in_each_run():
    # before: each run's Precision.setup checked the device again, so a run judged under
    # another described CPU than the Trainer's refused what the Trainer had accepted
    data = DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=4)
    with mixprec.hardware.assume(ZEN4):  # bfloat16 fast
        trainer = Trainer(precision="bf16-mixed", max_steps=1, **QUIET)
    assert trainer.support.status == "fast"
    with mixprec.hardware.assume(AVX2_CPU):  # bfloat16 far slower than float32
        trainer.fit(nn.Linear(4, 1), data, loss_fn=F.mse_loss)
        trainer.validate(dataloaders=data)
    assert trainer.precision.resolved_for == ZEN4


def test_an_inf_free_run_at_a_low_init_scale_logs_that_scale(tmp_path):
    given = mixprec.Precision(
        "16-mixed", scaler=DynamicLossScaler(init_scale=256.0), allow_slow=True
    )
    trainer = Trainer(
        precision=given,
        max_steps=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    data = TensorDataset(torch.randn(4, 4), torch.randn(4, 1))
    trainer.fit(nn.Linear(4, 1), DataLoader(data, batch_size=4), loss_fn=F.mse_loss)
    assert math.isclose(trainer.callback_metrics["loss_scale"], 256.0)


def test_each_logged_step_carries_the_loss_scale_it_ran_at(tmp_path):
    """A step's row holds the lr that step used but took the live loss scale, updated by
    the step: an overflowing step at 256 was logged at 128, and a step growing the scale
    at the one after. Each row now holds the scale its step ran at."""
    given = mixprec.Precision(
        "16-mixed",
        scaler=DynamicLossScaler(init_scale=256.0, growth_interval=2),
        allow_slow=True,
    )
    seen = []

    class Overflow(nn.Linear):
        def forward(self, x):
            step = len(seen)
            seen.append(float(given.scaler.loss_scale))
            out = super().forward(x)
            return out * math.inf if step == 1 else out

    trainer = Trainer(
        precision=given, max_steps=5, default_root_dir=tmp_path, log_every_n_steps=1,
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    data = TensorDataset(torch.randn(4, 4), torch.randn(4, 1))
    trainer.fit(Overflow(4, 1), DataLoader(data, batch_size=1), loss_fn=F.mse_loss)
    rows = list(csv.DictReader(open(trainer.run_dir / "metrics.csv")))
    logged = [float(r["loss_scale"]) for r in rows if r["loss"]]
    assert seen == [256.0, 256.0, 128.0, 128.0, 256.0]  # (skip, backoff; two clean: growth)
    assert logged == seen


def test_logged_bfloat16_values_are_averaged_in_float64():
    """A bf16 loss logged over many batches: summed in bf16 the mean would be off by up to
    ~1% (a sum near 100 has bf16 steps of 0.5); the epoch mean is exact in float64."""
    from mixprec.trainer.metrics import MetricStore

    store = MetricStore()
    store.training = False
    values = torch.linspace(2.3, 2.8, 40).to(torch.bfloat16)
    for v in values:
        store.log("val_loss", v, batch_size=32)
    exact = values.double().mean().item()
    assert store.take_epoch(lambda t: t)["val_loss"] == pytest.approx(exact, rel=1e-12)
    naive = values[0].clone() * 32
    for v in values[1:]:
        naive = naive + v * 32
    assert abs(naive.item() / (32 * 40) - exact) > 1e-3  # what bf16 sums would have given


# -- optimizers -------------------------------------------------------------------------------


def test_closure_optimizers_are_found_and_fsdp_is_refused_for_them():
    from mixprec.trainer.optimizers import check_closure_fit, needs_closure

    model = nn.Linear(2, 1)
    lbfgs = torch.optim.LBFGS(model.parameters())
    assert needs_closure(lbfgs) and not needs_closure(torch.optim.SGD(model.parameters(), lr=1))
    _, wrapped = mixprec.Precision("32-true").setup(model, lbfgs)
    assert check_closure_fit([wrapped], False, 1, "ddp")
    with pytest.raises(ValueError, match="LBFGS works on whole gradients.*strategy='ddp'"):
        check_closure_fit([wrapped], False, 1, "fsdp")


def test_a_checkpoint_from_inside_an_epoch_needs_its_process_count_its_last_batch_too():
    """A checkpoint on an epoch's last batch was refused as 'saved mid-epoch' where the docs
    said an epoch boundary resumes with any count: the message and docs now say it needs the
    same count (its epoch's end runs again on resume from what each process accumulated)."""
    with pytest.raises(CheckpointError, match=r"after its batch 6\) with 2 .* also from its last"):
        check_world(Path("run.ckpt"), 2, 1, {"batch": 6})
    check_world(Path("run.ckpt"), 2, 1, {"batch": 0})  # saved at an epoch's end
    check_world(Path("run.ckpt"), 2, 2, {"batch": 6})


def test_a_low_bit_resume_refusal_names_the_formats_and_advises_by_kind():
    """A block cut to a smaller parameter (int8/block=8192 under 16384) is its group's kind:
    one optimizer_states resumes it (the first fix advised states rules there); a map's
    rules setting int8 on some parameters of a float32 group need those rules."""

    def saved(group: str, formats: list[str]) -> dict:
        state = {i: {"format": f} for i, f in enumerate(formats)}
        return {"param_groups": [{"states": group}], "state": state}

    cut = saved("int8/block=16384", ["float32", "int8/block=8192"])
    assert _held_formats(cut) == (
        "int8/block=16384 (per parameter: 1 in float32, 1 in int8/block=8192)"
    )
    assert _resume_advice(cut) == "resume with optimizer_states='int8/block=16384'"
    small = saved("int8", ["float32", "float32"])
    assert _held_formats(small) == "int8 (per parameter: 2 in float32)"
    assert _resume_advice(small) == "resume with optimizer_states='int8'"
    ruled = saved("float32", ["float32", "int8"])
    assert "states rules it was trained with" in _resume_advice(ruled)
    assert _held_formats(saved("int8", ["int8"])) == "int8"
