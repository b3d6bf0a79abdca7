"""Sharded checkpoints of Trainer(strategy="fsdp"): resuming on 2 ranks is bit-identical to
not stopping (mid-epoch, dropout, a step schedule), an interrupted save leaves the last
complete checkpoint loadable, and a 2-rank checkpoint resumes in one process (resharded).

One group of two processes runs the distributed part (joined by the Trainer as a
torchrun-launched one would be); the one-process resumes run here."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawning import WORLD, run_ranks
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from trainers import SILENT

from mixprec import PolicyMap, Precision
from mixprec.trainer import Callback, CheckpointError, ModelCheckpoint, Trainer, TrainingModule
from mixprec.trainer import checkpoint as ckpt_io
from mixprec.trainer.strategy import free_port

# what a script run in a subprocess imports from: this folder (the test module) and the
# tests folder (the shared helpers)
SCRIPT_PATH = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

# the runs here save checkpoints: no logger and no bar, but checkpointing left on
RUN = dict(SILENT, allow_slow_precision=True, seed=0)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (64,), generator=g))


def loader() -> DataLoader:
    return DataLoader(data(), batch_size=8, shuffle=True)  # 4 batches per rank and epoch


def one_rank_loader() -> DataLoader:
    """Ordered as one FSDP process orders `loader` (with the DistributedSampler the Trainer
    puts in), also in a single-device run: a mid-epoch checkpoint of the one resumes in the
    other."""
    sampler = DistributedSampler(data(), num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data(), batch_size=8, sampler=sampler)


class ShardedDropoutNet(TrainingModule):
    """Dropout (draws random numbers every step), a LayerNorm island, a step schedule."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(6, width), nn.LayerNorm(width), nn.GELU(), nn.Dropout(0.2)),
            nn.Linear(width, 3),
        )

    def forward(self, x):
        return self.blocks(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ExportAtEpochEnd(Callback):
    """Every rank calls the export (a collective under FSDP); rank 0 writes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, model):
        trainer.save_full_state_dict(self.path)


class Pooled(ShardedDropoutNet):
    """`ShardedDropoutNet` with a layer its forward never uses (as a Hugging Face model's
    pooler under a language-model loss): its parameters require a gradient, never get one."""

    def __init__(self) -> None:
        super().__init__()
        self.pooler = nn.Linear(3, 3)


class HeldStates(Callback):
    """Rank 0 saves to ``path`` the names of the parameters with optimizer state as the fit
    starts (a resume's loaded) and as it ends."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def held(trainer: Trainer, model: nn.Module) -> list[str]:
        names = {id(p): n for n, p in model.named_parameters()}
        return sorted(names[id(p)] for opt in trainer.optimizers for p in opt.optimizer.state)

    def on_fit_start(self, trainer, model):
        self.start = self.held(trainer, model)

    def on_fit_end(self, trainer, model):
        if trainer.is_global_zero:
            torch.save({"start": self.start, "end": self.held(trainer, model)}, self.path)


def _fit(
    max_steps: int, callbacks: list[Callback], out: Path, net: nn.Module | None = None,
    precision: str = "bf16-mixed", **fit: Any,
) -> Trainer:  # fmt: skip
    trainer = Trainer(
        precision=precision, strategy="fsdp", devices=WORLD, max_steps=max_steps,
        callbacks=callbacks, **RUN,
    )  # fmt: skip
    trainer.fit(net if net is not None else ShardedDropoutNet(), loader(), **fit)
    trainer.save_full_state_dict(out)
    return trainer


def _interrupted_save(directory: Path, like: Path) -> Path:
    """What a save killed before its rename leaves: a temporary directory (of a process that
    no longer runs) with some shards and no metadata."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = directory / f".last.ckpt.{ckpt_io._HOST}.{gone.pid}.0badc0de.tmp"
    tmp.mkdir()
    shutil.copy2(like / "__0_0.distcp", tmp / "__0_0.distcp")
    return tmp


def _worker(rank: int, out: str) -> None:
    d = Path(out)
    straight = ModelCheckpoint(dirpath=d / "straight", save_top_k=-1, save_last=True)
    _fit(6, [straight, ExportAtEpochEnd(d / "step4.pt")], d / "straight.pt")

    def every_3() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=d / "half", every_n_train_steps=3, save_top_k=-1, save_last=True
        )

    _fit(3, [every_3()], d / "half.pt")  # saved mid-epoch 0, after batch 3 of 4
    if rank == 0:
        _interrupted_save(d / "half", d / "half" / "last.ckpt")
    dist.barrier()
    _fit(6, [every_3()], d / "resumed.pt", ckpt_path=d / "half" / "epoch=0-step=3.ckpt")

    def every_2(name: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=d / name, every_n_train_steps=2, save_top_k=-1)

    # a layer that never gets a gradient has no optimizer state when saved
    ends = ModelCheckpoint(dirpath=d / "pooled-ends", save_top_k=-1)  # (for one device)
    pooled = [every_2("pooled"), ends, HeldStates(d / "pooled-straight-states.pt")]
    _fit(6, pooled, d / "pooled-straight.pt", Pooled())
    again = [every_2("pooled-again"), HeldStates(d / "pooled-resumed-states.pt")]
    mid = d / "pooled" / "epoch=0-step=2.ckpt"
    _fit(6, again, d / "pooled-resumed.pt", Pooled(), ckpt_path=mid)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = tmp_path_factory.mktemp("fsdp_ckpt")
    run_ranks(_worker, str(out), nprocs=WORLD)
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _run_state(checkpoint: Path, rank: int = 0) -> dict[str, Any]:
    return torch.load(checkpoint / f"trainer-rank{rank}.pt", weights_only=True)


@pytest.mark.slow
def test_resume_on_two_ranks_is_bit_identical_to_not_stopping(saved):
    straight, resumed = _weights(saved / "straight.pt"), _weights(saved / "resumed.pt")
    start = ShardedDropoutNet().state_dict()
    assert straight.keys() == resumed.keys() == start.keys()
    assert any(not torch.equal(straight[k], start[k]) for k in start)  # it trained
    for k, v in straight.items():
        assert v.dtype == torch.float32
        assert torch.equal(v, resumed[k]), k


@pytest.mark.slow
def test_every_rank_writes_its_shards_and_its_own_run_state(saved):
    checkpoint = saved / "half" / "epoch=0-step=3.ckpt"
    names = sorted(p.name for p in checkpoint.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"] + [
        f"trainer-rank{r}.pt" for r in range(WORLD)
    ]
    r0, r1 = _run_state(checkpoint, 0), _run_state(checkpoint, 1)
    assert r0["loop"]["global_step"] == r1["loop"]["global_step"] == 3
    assert r0["loop"]["batch"] == 3  # the data position, mid-epoch
    assert r0["world_size"] == WORLD
    # the generators are each rank's own (the loaders' shuffles are drawn per rank)
    assert "torch" in r0["rng"] and "torch" in r1["rng"]


@pytest.mark.slow
def test_an_interrupted_save_leaves_the_last_checkpoint_and_is_cleaned_up(saved):
    half = saved / "half"
    # the resume above loaded epoch=0-step=3 with the interrupted temporary directory beside
    # it; the next save (step 6) removed that directory and replaced last.ckpt atomically
    assert not list(half.glob(".*"))
    assert sorted(p.name for p in half.iterdir()) == [
        "epoch=0-step=3.ckpt",
        "epoch=1-step=6.ckpt",
        "last.ckpt",
    ]
    assert _run_state(half / "last.ckpt")["loop"]["global_step"] == 6
    # the straight fit stopped at step 6 inside epoch 1: it saved that step too (every rank)
    straight = saved / "straight"
    assert sorted(p.name for p in straight.iterdir()) == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=6.ckpt",
        "last.ckpt",
    ]
    assert _run_state(straight / "last.ckpt", rank=1)["loop"]["global_step"] == 6


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_in_one_process_resharded(saved, caplog):
    checkpoint = saved / "straight" / "epoch=0-step=4.ckpt"  # at an epoch's end
    model = ShardedDropoutNet()
    trainer = Trainer(precision="bf16-mixed", max_steps=4, enable_checkpointing=False, **RUN)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        trainer.fit(model, loader(), ckpt_path=checkpoint)
    assert "resharded" in caplog.text and "saved by 2 processes, onto 1" in caplog.text
    assert trainer.global_step == 4 and trainer.current_epoch == 1
    for k, v in _weights(saved / "step4.pt").items():  # gathered by the 2-rank run at step 4
        assert torch.equal(model.state_dict()[k], v), k
    [opt] = trainer.optimizers
    assert all(s["step"].item() == 4 for s in opt.optimizer.state.values())
    assert len(opt.optimizer.state) == len(list(model.parameters()))
    assert trainer.lr_schedulers[0].last_epoch == 4

    model = ShardedDropoutNet()
    Trainer(precision="bf16-mixed", **RUN).validate(model, loader(), ckpt_path=checkpoint)
    step4 = _weights(saved / "step4.pt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in step4.items())


@pytest.mark.slow
def test_sharded_checkpoints_that_do_not_fit_are_refused(saved):
    mid_epoch = saved / "half" / "epoch=0-step=3.ckpt"
    end = saved / "straight" / "epoch=0-step=4.ckpt"
    one = Trainer(precision="bf16-mixed", max_steps=8, enable_checkpointing=False, **RUN)
    with pytest.raises(CheckpointError, match="inside an epoch .* with 2 processes"):
        one.fit(ShardedDropoutNet(), loader(), ckpt_path=mid_epoch)
    other = Trainer(precision="32-true", max_steps=8, enable_checkpointing=False, **RUN)
    with pytest.raises(CheckpointError, match="bf16-mixed.*save_full_state_dict"):
        other.fit(ShardedDropoutNet(), loader(), ckpt_path=end)
    model = ShardedDropoutNet(width=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="shapes differ.*Nothing was loaded"):
        one.fit(model, loader(), ckpt_path=end)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.slow
def test_parameters_without_optimizer_state_resume_without_it(saved):
    """Found by a review: a sharded checkpoint of a model with a trainable parameter that
    had no optimizer state yet (an unused pooler, an expert no batch reached) could not be
    resumed at all, on 2 ranks or one device: torch's get_state_dict makes the fresh
    optimizer a state for every parameter, and DCP's load then asked the checkpoint for keys
    it never saved (a CheckpointException, "Missing key ... optim.state.pooler.weight.step").
    They now resume without state, as saved: bit for bit the run that never stopped."""
    straight = _weights(saved / "pooled-straight.pt")
    resumed = _weights(saved / "pooled-resumed.pt")
    start = Pooled().state_dict()
    for k, v in straight.items():
        assert torch.equal(v, resumed[k]), k
    assert torch.equal(straight["pooler.weight"], start["pooler.weight"])  # (never stepped)
    trained = sorted(n for n in start if not n.startswith("pooler."))
    straight_held, resumed_held = (
        torch.load(saved / f"pooled-{n}-states.pt") for n in ("straight", "resumed")
    )
    assert straight_held["end"] == resumed_held["start"] == resumed_held["end"] == trained

    checkpoint = saved / "pooled-ends" / "epoch=0-step=4.ckpt"  # (an epoch's end: any world)
    model = Pooled()
    trainer = Trainer(precision="bf16-mixed", max_steps=6, enable_checkpointing=False, **RUN)
    trainer.fit(model, loader(), ckpt_path=checkpoint)
    assert trainer.global_step == 6
    assert HeldStates.held(trainer, model) == trained
    assert torch.equal(model.pooler.weight, start["pooler.weight"])


KILLED_SAVE_SCRIPT = """
import os, signal, sys
sys.path[:0] = {tests!r}
from pathlib import Path
from test_fsdp_checkpoint import RUN, ShardedDropoutNet, one_rank_loader
from mixprec.trainer import ModelCheckpoint, Trainer

replace = os.replace


def replace_then_die(src, dst):
    replace(src, dst)
    if str(dst).endswith(".old"):  # the old last.ckpt is aside, the new one not yet in
        os.kill(os.getpid(), signal.SIGKILL)


os.replace = replace_then_die
every_2 = ModelCheckpoint(dirpath={out!r}, every_n_train_steps=2, save_top_k=-1, save_last=True)
Trainer(precision="bf16-mixed", strategy="fsdp", devices=1, max_steps=4, callbacks=[every_2],
        **RUN).fit(ShardedDropoutNet(), one_rank_loader())
"""


def test_a_save_killed_between_its_renames_loses_nothing(tmp_path, caplog):
    """A real SIGKILL at the worst moment of a sharded save: the old last.ckpt renamed aside,
    the new one still under its temporary name. The next resume puts the old one back (and
    says so), and the next save clears what the killed one left."""
    out = tmp_path / "ckpts"
    script = tmp_path / "train.py"
    script.write_text(KILLED_SAVE_SCRIPT.format(tests=SCRIPT_PATH, out=str(out)))
    one_rank = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    port = str(free_port())
    env = dict(os.environ, **one_rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    left = sorted(p.name for p in out.iterdir())
    assert "last.ckpt" not in left and "epoch=0-step=4.ckpt" in left
    assert [n for n in left if n.endswith(".old")] and [n for n in left if n.endswith(".tmp")]

    every_2 = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last=True)
    start = StartStep()
    trainer = Trainer(precision="bf16-mixed", max_steps=6, callbacks=[every_2, start], **RUN)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        trainer.fit(ShardedDropoutNet(), one_rank_loader(), ckpt_path=out / "last.ckpt")
    assert "restored the checkpoint" in caplog.text
    assert start.step == 2  # resumed from the checkpoint put back, not from scratch
    assert trainer.global_step == 6
    assert not list(out.glob(".*"))  # the killed save's leftovers are gone
    # one process writes file checkpoints: last.ckpt went from a directory to a file
    assert (out / "last.ckpt").is_file()
    assert ckpt_io.load(out / "last.ckpt")["loop"]["global_step"] == 6


class StartStep(Callback):
    def on_fit_start(self, trainer, model):
        self.step = trainer.global_step


def test_install_replaces_across_kinds_and_an_aside_is_put_back_only_where_missing(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    name = f"{ckpt_io._HOST}.{gone.pid}"
    last = tmp_path / "last.ckpt"
    last.write_bytes(b"a file")
    sharded_tmp = tmp_path / f".last.ckpt.{name}.0a.tmp"
    sharded_tmp.mkdir()
    (sharded_tmp / ".metadata").write_bytes(b"dcp")
    ckpt_io.install(sharded_tmp, last)  # a directory where a file was
    assert (last / ".metadata").read_bytes() == b"dcp" and not list(tmp_path.glob(".*"))
    file_tmp = tmp_path / f".last.ckpt.{name}.0b.tmp"
    file_tmp.write_bytes(b"a file again")
    ckpt_io.install(file_tmp, last)  # and a file where a directory was
    assert last.read_bytes() == b"a file again" and not list(tmp_path.glob(".*"))

    aside = tmp_path / f".last.ckpt.{name}.0c.old"  # what a kill between the renames leaves
    aside.write_bytes(b"the old one")
    assert not ckpt_io.recover_aside(last)  # last.ckpt is there: the aside is outdated ...
    assert ckpt_io.clean_stale_tmp(tmp_path) == [aside]  # ... and goes with the leftovers
    last.rename(aside)  # now last.ckpt is missing: it comes back
    assert ckpt_io.recover_aside(last) and last.read_bytes() == b"a file again"
    live = tmp_path / f".other.ckpt.{ckpt_io._HOST}.{os.getppid()}.0d.old"  # a running save's
    live.write_bytes(b"in use")
    assert not ckpt_io.recover_aside(tmp_path / "other.ckpt") and live.exists()


def _saved_by_one_fsdp_process(tmp_path: Path, states: str, width: int = 32) -> None:
    """A one-process FSDP fit of 2 steps in ``states``, saving ``tmp_path / "last.ckpt"``."""
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    first = Trainer(
        precision="32-true", strategy="fsdp", devices=1, max_steps=2, callbacks=[every_2],
        optimizer_states=states, **RUN,
    )  # fmt: skip
    first.fit(ShardedDropoutNet(width), one_rank_loader())


def _resuming_fsdp_process(states: str) -> Trainer:
    """A one-process FSDP Trainer in ``states`` that resumes to step 4."""
    return Trainer(
        precision="32-true", strategy="fsdp", devices=1, max_steps=4, optimizer_states=states,
        enable_checkpointing=False, **RUN,
    )  # fmt: skip


def test_a_sharded_resume_in_other_optimizer_state_formats_is_refused_naming_them(tmp_path):
    """An unsharded checkpoint converts its optimizer states to another optimizer_states; a
    sharded one holds them in DCP shards of their saved layout, so another format is refused
    before anything is loaded, naming both."""
    _saved_by_one_fsdp_process(tmp_path, "int8")
    model = ShardedDropoutNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    again = Trainer(
        precision="32-true", strategy="fsdp", devices=1, max_steps=4, optimizer_states="int4",
        enable_checkpointing=False, **RUN,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match=r"\[\['int8'\]\].*\[\['int4'\]\].*optimizer_states"):
        again.fit(model, one_rank_loader(), ckpt_path=tmp_path / "last.ckpt")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_sharded_checkpoint_recording_fp8_states_resumes_as_float8(tmp_path):
    """Checkpoints written before the states' float8 format was spelled "float8" recorded
    "fp8": the same format, so the resume goes on."""
    _saved_by_one_fsdp_process(tmp_path, "float8")
    rank_file = (tmp_path / "last.ckpt").resolve() / "trainer-rank0.pt"
    state = torch.load(rank_file, weights_only=False)
    assert state["optimizer_state_formats"] == [["float8"]]
    state["optimizer_state_formats"] = [["fp8"]]  # as an older version wrote it
    torch.save(state, rank_file)
    again = _resuming_fsdp_process("float8")
    again.fit(ShardedDropoutNet(), one_rank_loader(), ckpt_path=tmp_path / "last.ckpt")
    assert again.global_step == 4


def test_low_bit_states_saved_in_another_layout_are_refused_before_anything_loads(tmp_path):
    """FSDP cuts each rank's shard of a moment into blocks of its own: a 2-process
    checkpoint's int8 codes, read by one process (or by DDP) as one parameter's, often have
    the right length and silently misplaced blocks. The run state records the layout (here
    rewritten as a 2-process save writes it) and a resume in another one is refused."""
    _saved_by_one_fsdp_process(tmp_path, "int8", width=1024)  # (an int8 state)
    rank_file = (tmp_path / "last.ckpt").resolve() / "trainer-rank0.pt"
    state = torch.load(rank_file, weights_only=False)
    assert state["optimizer_state_shards"] == [1]
    state["optimizer_state_shards"] = [2]
    torch.save(state, rank_file)
    model = ShardedDropoutNet(width=1024)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    again = _resuming_fsdp_process("int8")
    with pytest.raises(CheckpointError, match=r"each of \[2\] shards.*\[1\].*Nothing was loaded"):
        again.fit(model, one_rank_loader(), ckpt_path=tmp_path / "last.ckpt")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_file_checkpoint_loads_into_fsdp_for_evaluation_and_refuses_to_resume_a_fit(tmp_path):
    """A one-device run's file checkpoint given to an FSDP run failed inside torch's
    load_state_dict ("got mixed torch.Tensor and DTensor"). Its weights now load into the
    sharded model for validate/test; resuming a fit from it, whose optimizer state is laid
    out for the unsharded model, is refused before anything loads, saying what works."""
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    first = Trainer(precision="32-true", max_steps=2, callbacks=[every_2], **RUN)
    trained = ShardedDropoutNet()
    first.fit(trained, one_rank_loader())
    assert (tmp_path / "last.ckpt").is_file()
    sharded = Trainer(precision="32-true", strategy="fsdp", devices=1, max_steps=4, **RUN)
    model = ShardedDropoutNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"file checkpoint.*strategy='ddp'.*Nothing"):
        sharded.fit(model, one_rank_loader(), ckpt_path=tmp_path / "last.ckpt")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    evaluated = ShardedDropoutNet()
    Trainer(precision="32-true", strategy="fsdp", devices=1, **RUN).validate(
        evaluated, one_rank_loader(), ckpt_path=tmp_path / "last.ckpt"
    )
    for k, v in trained.state_dict().items():
        assert torch.equal(evaluated.state_dict()[k], v), k


def test_predict_runs_in_an_fsdp_process_of_one_and_more_are_told_what_to_change(tmp_path):
    """Found by a review: the docs said a file checkpoint loads into an FSDP run for
    predict, but predict refused every DDP/FSDP Trainer, strategy="fsdp", devices=1 too,
    saying "use a Trainer with devices=1". A process group of one now predicts (in order,
    as one device does); more processes are refused naming the strategy to use instead."""
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    Trainer(precision="32-true", max_steps=2, callbacks=[every_2], **RUN).fit(
        ShardedDropoutNet(), one_rank_loader()
    )
    batches = [x for x, _ in one_rank_loader()][:2]
    last = tmp_path / "last.ckpt"
    one = Trainer(precision="32-true", **RUN).predict(ShardedDropoutNet(), batches, ckpt_path=last)
    sharded = Trainer(precision="32-true", strategy="fsdp", devices=1, **RUN)
    outputs = sharded.predict(ShardedDropoutNet(), batches, ckpt_path=last)
    assert len(outputs) == len(one) == 2
    for got, expected in zip(outputs, one, strict=True):
        assert torch.equal(got, expected)
    more = Trainer(strategy="fsdp", devices=2, **RUN)
    with pytest.raises(ValueError, match=r"2 processes \(strategy='fsdp'\).*'auto', devices=1"):
        more.predict(ShardedDropoutNet(), batches)


def test_a_sharded_checkpoint_saved_before_layouts_were_recorded_resumes(tmp_path):
    """Low-bit state dicts now record each state's layout ("shards") and parameter shape
    ("shape"); DCP's strict load refused a checkpoint written before (a missing key), even
    on the process count that saved it. Its states load as they are, the run state's world
    size standing for the layout."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    _saved_by_one_fsdp_process(tmp_path, "int8", width=1024)  # (an int8 state)
    saved = (tmp_path / "last.ckpt").resolve()
    # the checkpoint as it was written before: no layouts in the shards nor the run state
    dcp_to_torch_save(saved, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    layouts = [entry.pop("shards", None) for entry in whole["optim"]["state"].values()]
    assert 1 in layouts  # (the int8 states': the float32 ones record none)
    shapes = [entry.pop("shape", None) for entry in whole["optim"]["state"].values()]
    assert [1024, 6] in shapes  # (the int8 weight's)
    older = tmp_path / "older.ckpt"
    torch.save(whole, tmp_path / "older.pt")
    torch_save_to_dcp(tmp_path / "older.pt", older)
    state = torch.load(saved / "trainer-rank0.pt", weights_only=False)
    del state["optimizer_state_shards"]
    torch.save(state, older / "trainer-rank0.pt")
    again = _resuming_fsdp_process("int8")
    again.fit(ShardedDropoutNet(width=1024), one_rank_loader(), ckpt_path=older)
    assert again.global_step == 4


def _unstepped_fit(out: Path, name: str, steps: int, callbacks=(), **kwargs: Any) -> None:
    """16-mixed at an initial scale that overflows float16: the first steps are skipped."""
    import functools

    from mixprec import Precision
    from mixprec.optim.scaling import DynamicLossScaler

    precision = Precision("16-mixed", scaler=DynamicLossScaler(init_scale=2.0**19), allow_slow=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = TensorDataset(x, x @ torch.tensor([[1.0], [-1.0], [0.5], [2.0]]))
    trainer = Trainer(
        precision=precision, strategy="fsdp", devices=WORLD, max_steps=steps,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks), seed=0, allow_slow_precision=True, **SILENT,
    )  # fmt: skip
    trainer.fit(
        model, DataLoader(data, batch_size=8), loss_fn=F.mse_loss,
        optimizer=functools.partial(torch.optim.AdamW, lr=0.01), **kwargs,
    )  # fmt: skip
    assert precision.scaler.stats().skipped_steps >= 3
    trainer.save_full_state_dict(out / name)


def _unstepped_worker(rank: int, out: str) -> None:
    out_dir = Path(out)
    saving = ModelCheckpoint(dirpath=out_dir / "ckpts", save_top_k=-1, every_n_train_steps=3)
    _unstepped_fit(out_dir, "plain.pt", 6)
    _unstepped_fit(out_dir, "saving.pt", 6, [saving])
    _unstepped_fit(out_dir, "resumed.pt", 6, ckpt_path=out_dir / "ckpts" / "epoch=0-step=3.ckpt")


def test_a_checkpoint_before_the_first_real_step_changes_nothing_and_resumes_bit_for_bit(
    tmp_path,
):
    """torch's get_state_dict gives an optimizer without state one by a step at learning
    rate 0: saving before the first real step (every step so far skipped for an overflow)
    left AdamW a step ahead (its bias correction off for the rest of the run: 0.0147 apart
    from a run that never saved), and a resume from that checkpoint as far off."""
    run_ranks(_unstepped_worker, str(tmp_path), nprocs=WORLD)
    plain, saving, resumed = (
        torch.load(tmp_path / n) for n in ("plain.pt", "saving.pt", "resumed.pt")
    )
    for name, weight in plain.items():
        assert torch.equal(weight, saving[name]) and torch.equal(weight, resumed[name]), name


class Headed(ShardedDropoutNet):
    """`ShardedDropoutNet` with one more layer."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


class Grouped(ShardedDropoutNet):
    """Two parameter groups of three parameters: the weights and the biases, or (``split``)
    the first three parameters and the last three."""

    def __init__(self, split: bool) -> None:
        super().__init__()
        self.split = split

    def configure_optimizers(self):
        named = list(self.named_parameters())
        if self.split:
            first, rest = [p for _, p in named[:3]], [p for _, p in named[3:]]
        else:
            first = [p for n, p in named if n.endswith("weight")]
            rest = [p for n, p in named if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": first}, {"params": rest, "lr": 0.0}], lr=0.01)


def _saved_and_refused(tmp_path: Path, saved: TrainingModule, resumed: TrainingModule,
                       sharded: bool, match: str) -> None:  # fmt: skip
    """Fit ``saved`` 2 steps (sharded: one FSDP process), then resume ``resumed`` from its
    checkpoint: refused with ``match``, ``resumed``'s weights untouched."""
    strategy = dict(strategy="fsdp", devices=1) if sharded else {}
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    Trainer(precision="32-true", max_steps=2, callbacks=[every_2], **strategy, **RUN).fit(
        saved, one_rank_loader()
    )
    before = {k: v.clone() for k, v in resumed.state_dict().items()}
    again = Trainer(precision="32-true", max_steps=4, enable_checkpointing=False, **strategy, **RUN)
    with pytest.raises(CheckpointError, match=match):
        again.fit(resumed, one_rank_loader(), ckpt_path=tmp_path / "last.ckpt")
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in before.items())


def test_a_sharded_checkpoint_of_a_larger_model_is_refused(tmp_path):
    """Only the model's own keys were looked for in the shards: a checkpoint with a layer
    this model lacks resumed silently (the file checkpoint's check refused it)."""
    _saved_and_refused(
        tmp_path, Headed(), ShardedDropoutNet(), True,
        r"not in this model: head\.weight, head\.bias.*Nothing was loaded",
    )  # fmt: skip


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "file"])
def test_a_resume_with_other_parameter_groups_is_refused_before_loading(tmp_path, sharded):
    """Groups of the same sizes holding other parameters: the sharded resume gave a group
    the other's settings (and then a bare KeyError at the step); the file resume loaded the
    weights and then failed on a moment's shape, a ValueError, the model overwritten."""
    _saved_and_refused(
        tmp_path, Grouped(split=False), Grouped(split=True), sharded,
        r"optimizer 0's parameter groups were \[3: blocks\.0\.0\.weight.*Nothing was loaded",
    )  # fmt: skip


class LoggedLoss(ShardedDropoutNet):
    """Logs its training loss each step (what a second ModelCheckpoint can rank by)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_two_model_checkpoints_in_one_directory_keep_their_sharded_files_on_resume(tmp_path):
    """As with files: the second callback's checkpoint of the resumed step was written after
    last.ckpt, which holds its record from before that save; read from rank 0's run state
    inside the directory, it is that callback's own save, kept and recorded."""

    def fit(steps: int, resume: bool = False) -> ModelCheckpoint:
        latest = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
        ranked = ModelCheckpoint(
            dirpath=tmp_path, every_n_train_steps=2, filename="ranked-{step}", save_top_k=-1,
            monitor="train_loss",
        )  # fmt: skip
        Trainer(
            precision="32-true",
            strategy="fsdp",
            devices=1,
            max_steps=steps,
            callbacks=[latest, ranked],
            **RUN,
        ).fit(  # fmt: skip
            LoggedLoss(32),
            one_rank_loader(),
            ckpt_path=tmp_path / "last.ckpt" if resume else None,
        )
        return ranked

    fit(2)
    assert (tmp_path / "ranked-2.ckpt").is_dir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing to remove)
        ranked = fit(4, resume=True)
    assert sorted(Path(p).name for p in ranked.best_k_models) == ["ranked-2.ckpt", "ranked-4.ckpt"]
    assert (tmp_path / "ranked-2.ckpt").is_dir() and (tmp_path / "ranked-4.ckpt").is_dir()


def test_a_sharded_checkpoint_resumed_with_another_kind_of_scaler_starts_it_fresh(tmp_path):
    """As a file checkpoint's resume does; the sharded one raised a bare ValueError after
    loading the model and the optimizers."""
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    Trainer(
        precision="16-mixed", strategy="fsdp", devices=1, max_steps=2, callbacks=[every_2],
        **RUN,
    ).fit(ShardedDropoutNet(), one_rank_loader())  # fmt: skip
    static = Precision("16-mixed", scaler=1024.0, allow_slow=True)
    again = Trainer(
        precision=static, strategy="fsdp", devices=1, max_steps=4, enable_checkpointing=False,
        **RUN,
    )  # fmt: skip
    again.fit(ShardedDropoutNet(), one_rank_loader(), ckpt_path=tmp_path / "last.ckpt")
    assert again.global_step == 4 and static.scaler.loss_scale == 1024.0


def test_a_sharded_checkpoint_of_a_map_with_states_rules_names_them_when_refused(tmp_path):
    """Two maps of one name: the refusal said 'trained in 32-true, this run uses 32-true'."""
    ruled = PolicyMap("32-true", states={r"blocks\.0": "int8"})
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    Trainer(
        precision=ruled, strategy="fsdp", devices=1, max_steps=2, callbacks=[every_2], **RUN
    ).fit(ShardedDropoutNet(), one_rank_loader())
    plain = Trainer(precision="32-true", strategy="fsdp", devices=1, max_steps=4, **RUN)
    with pytest.raises(CheckpointError, match=r"states=\{'blocks\\\\\.0': 'int8'\}\), this run"):
        plain.fit(ShardedDropoutNet(), one_rank_loader(), ckpt_path=tmp_path / "last.ckpt")


class Momentum(ShardedDropoutNet):
    """SGD with momentum: float16 weights without masters stay finite under it (AdamW's eps
    is 0 in float16, and its first zero moment makes a NaN)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class StartState(Callback):
    """The model's weights and the optimizer's state by parameter name as the fit starts (a
    resume's loaded), and each master beside its weight."""

    def on_fit_start(self, trainer, model):
        [opt] = trainer.optimizers
        self.weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.states, self.masters = {}, {}
        for name, p in model.named_parameters():
            master = opt.master_params.get(p, p) if hasattr(opt, "master_params") else p
            self.masters[name] = master.detach().clone()
            self.states[name] = {k: v.clone() for k, v in opt.optimizer.state[master].items()}


@pytest.mark.parametrize(
    ("saved_as", "resumed_as"),
    [
        (Precision("bf16-true", allow_slow=True),
         Precision("bf16-true", master_weights=True, allow_slow=True)),
        (Precision("16-true", master_weights=False, allow_slow=True),
         Precision("16-true", allow_slow=True)),
    ],
    ids=["bf16-true", "16-true"],
)  # fmt: skip
def test_a_sharded_checkpoint_resumes_on_one_device_keeping_float32_masters(
    tmp_path, saved_as, resumed_as
):
    """Found by a review: an FSDP checkpoint of a 16-bit "true" run (FSDP keeps no masters
    beside 16-bit shards) resumed by a one-device run keeping float32 masters failed with a
    bare KeyError from torch's get_state_dict (the optimizer holds the masters, which are
    not the model's parameters). It loads as a file checkpoint saved without masters does:
    the masters start from the loaded weights, the states as saved (widened)."""
    every_2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)
    Trainer(
        precision=saved_as, strategy="fsdp", devices=1, max_steps=2, callbacks=[every_2],
        **RUN,
    ).fit(Momentum(), one_rank_loader())  # fmt: skip
    starts = []
    for precision in (saved_as, resumed_as):  # (the first as saved: no masters)
        start = StartState()
        trainer = Trainer(
            precision=precision, max_steps=3, callbacks=[start], enable_checkpointing=False,
            **RUN,
        )  # fmt: skip
        trainer.fit(Momentum(), one_rank_loader(), ckpt_path=tmp_path / "last.ckpt")
        assert trainer.global_step == 3
        starts.append(start)
    plain, masters = starts
    assert masters.weights.keys() == plain.weights.keys() and plain.states
    assert all(torch.isfinite(w).all() for w in plain.weights.values())
    for name, weight in plain.weights.items():
        assert torch.equal(masters.weights[name], weight), name
        assert masters.masters[name].dtype == torch.float32
        assert torch.equal(masters.masters[name], weight.float()), name
        assert plain.states[name].keys() == masters.states[name].keys(), name
        for key, value in plain.states[name].items():
            assert masters.states[name][key].dtype == (
                torch.float32 if key != "step" else value.dtype
            ), (name, key)
            assert torch.equal(masters.states[name][key].to(value.dtype), value), (name, key)
