"""DDP on gloo with two real processes: spawned by the Trainer, forked, and under torchrun.
Every rank ends with the same parameters, equal to one process training on the global batch."""

from __future__ import annotations

import contextlib
import csv
import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec.trainer import Callback, Trainer, TrainingModule

# what a script run in a subprocess imports from: this folder (the test module) and the
# tests folder (the shared helpers)
SCRIPT_PATH = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

pytestmark = pytest.mark.slow


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return TensorDataset(x, 0.1 * (x @ torch.tensor([[1.0], [-1.0], [0.5], [2.0]])))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


class DumpParams(Callback):
    """Each rank saves its final parameters (and loss-scaler stats) to ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_fit_end(self, trainer, model):
        stats = trainer.precision.scaler.stats()
        torch.save(
            {
                "params": model.state_dict(),
                "skipped": stats.skipped_steps,
                "world": trainer.world_size,
            },
            self.directory / f"rank{trainer.strategy.global_rank}.pt",
        )


def ranks(directory: Path) -> list[dict]:
    return [torch.load(directory / f"rank{r}.pt") for r in range(2)]


def test_spawned_ddp_ranks_agree_and_match_one_process_on_the_global_batch(tmp_path):
    """2 ranks x batch 8, 2 micro-batches per step, clipped: the same updates as one process
    with batch 16 (DistributedSampler without shuffling gives rank r the samples r, r+2, ...)."""
    sgd = functools.partial(torch.optim.SGD, lr=0.2)
    ddp_model = model()
    trainer = Trainer(
        devices=2,
        strategy="ddp",
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        callbacks=[DumpParams(tmp_path)],
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
    )
    trainer.fit(ddp_model, DataLoader(data(), batch_size=8), loss_fn=F.mse_loss, optimizer=sgd)
    r0, r1 = ranks(tmp_path)
    assert r0["world"] == r1["world"] == 2
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
        assert torch.equal(p, ddp_model.state_dict()[name])  # landed in the caller's model
    assert trainer.global_step == 4 and trainer.current_epoch == 2

    single = model()
    one = Trainer(
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    one.fit(single, DataLoader(data(), batch_size=16), loss_fn=F.mse_loss, optimizer=sgd)
    for name, p in single.state_dict().items():
        assert torch.allclose(p, r0["params"][name], atol=1e-6), name

    # only rank 0 wrote logs and checkpoints
    runs = list((tmp_path / "logs").iterdir())
    assert [r.name for r in runs] == ["version_0"]
    rows = list(csv.DictReader(open(runs[0] / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r["loss"]] == [1, 2, 3, 4]
    assert [p.name for p in (runs[0] / "checkpoints").iterdir()] == ["epoch=1-step=4.ckpt"]


class Overflowing(TrainingModule):
    """Rank 1 alone puts inf into its gradients on the second batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        out = self(batch[0])
        if batch_idx == 1 and self.trainer.strategy.global_rank == 1:
            out.register_hook(lambda g: g * float("inf"))
        return F.mse_loss(out, batch[1])


def test_forked_ddp_skips_the_same_steps_on_every_rank_under_float16(tmp_path):
    trainer = Trainer(
        precision="16-mixed",
        devices=2,
        strategy="ddp_fork",
        max_steps=4,
        callbacks=[DumpParams(tmp_path)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        allow_slow_precision=True,
    )
    trainer.fit(Overflowing(), DataLoader(data(), batch_size=8, shuffle=True))
    r0, r1 = ranks(tmp_path)
    assert r0["skipped"] == r1["skipped"] == 1
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
        assert torch.isfinite(p).all()


def test_lbfgs_under_ddp_keeps_the_ranks_together_and_matches_one_process(tmp_path):
    """Each loss evaluation in LBFGS's closure all-reduces the gradients, and the closure
    returns the loss averaged over the ranks: every rank takes the same decisions and steps
    as one process on the global batch."""
    lbfgs = functools.partial(torch.optim.LBFGS, lr=0.5, max_iter=5, history_size=4)
    common = dict(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer = Trainer(devices=2, strategy="ddp_fork", callbacks=[DumpParams(tmp_path)], **common)
    trainer.fit(model(), DataLoader(data(), batch_size=8), loss_fn=F.mse_loss, optimizer=lbfgs)
    r0, r1 = ranks(tmp_path)
    assert all(torch.equal(p, r1["params"][n]) for n, p in r0["params"].items())
    assert trainer.global_step == 8

    single = model()
    one = Trainer(**common)
    one.fit(single, DataLoader(data(), batch_size=16), loss_fn=F.mse_loss, optimizer=lbfgs)
    for name, p in single.state_dict().items():
        assert torch.allclose(p, r0["params"][name], atol=1e-5), name


class Pooled(TrainingModule):
    """A pooler the loss never uses: its parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()
        self.pooler = nn.Linear(1, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_parameters_without_gradients_train_under_ddp_find_unused_parameters(tmp_path):
    """Found by a review: a parameter that gets no gradient failed DDP at the second step
    with torch's advice to pass find_unused_parameters=True to DistributedDataParallel,
    which the Trainer builds: a Trainer user could not. ``DDP(find_unused_parameters=True)``
    passes it, and without it the error says so."""
    from mixprec.trainer import DDP

    common = dict(devices=2, max_steps=3, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, seed=0)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"strategy=DDP\(find_unused_parameters=True\)"):
        Trainer(strategy="ddp_fork", **common).fit(Pooled(), DataLoader(data(), batch_size=8))
    settings = DDP(find_unused_parameters=True, start_method="fork")
    trainer = Trainer(strategy=settings, callbacks=[DumpParams(tmp_path)], **common)
    trainer.fit(Pooled(), DataLoader(data(), batch_size=8))
    assert trainer.global_step == 3 and trainer.summary()["device"].endswith("(ddp)")
    r0, r1 = ranks(tmp_path)
    start = Pooled().state_dict()
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    assert torch.equal(r0["params"]["pooler.weight"], start["pooler.weight"])  # unused
    assert not torch.equal(r0["params"]["net.0.weight"], start["net.0.weight"])  # trained


TORCHRUN_SCRIPT = """
import sys
import torch.nn.functional as F
from torch.utils.data import DataLoader
sys.path[:0] = {tests!r}
from test_trainer_ddp import DumpParams, data, model
from mixprec.trainer import Trainer
from pathlib import Path

if __name__ == "__main__":
    out = Path({out!r})
    trainer = Trainer(precision="bf16-mixed", strategy="ddp", devices=2, max_epochs=2,
                      allow_slow_precision=True, callbacks=[DumpParams(out)],
                      default_root_dir=out, enable_progress_bar=False)
    trainer.fit(model(), DataLoader(data(), batch_size=8, shuffle=True), loss_fn=F.mse_loss)
"""


def test_torchrun_launched_ddp(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            TORCHRUN_SCRIPT.format(
                tests=SCRIPT_PATH,
                out=str(tmp_path),
            )
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = ranks(tmp_path)
    assert r0["world"] == r1["world"] == 2
    assert all(torch.equal(p, r1["params"][n]) for n, p in r0["params"].items())
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["version_0"]


class DumpMasters(Callback):
    """Rank 0 saves the float32 masters its optimizer kept, by parameter name."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer, model):
        if trainer.strategy.global_rank == 0:
            names = {p: n for n, p in model.named_parameters()}
            masters = trainer.optimizers[0].master_params
            torch.save({names[p]: m.detach().cpu() for p, m in masters.items()}, self.path)


def test_a_spawned_16_true_fit_exports_its_float32_masters(tmp_path):
    """The launched processes sent back only the float16 parameters: the export after the
    fit held them cast to float32, 11 bits short of the masters the run kept (as one
    process's export holds); so did it after a validate, whose processes have none."""
    trainer = Trainer(
        precision="16-true",
        allow_slow_precision=True,
        devices=2,
        strategy="ddp",
        max_epochs=1,
        callbacks=[DumpMasters(tmp_path / "masters.pt")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    sgd = functools.partial(torch.optim.SGD, lr=0.2)
    trainer.fit(model(), DataLoader(data(), batch_size=8), loss_fn=F.mse_loss, optimizer=sgd)
    exported = torch.load(trainer.save_full_state_dict(tmp_path / "full.pt"), weights_only=True)
    masters = torch.load(tmp_path / "masters.pt")
    assert set(masters) == set(exported) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, master in masters.items():
        assert master.dtype == torch.float32 and torch.equal(exported[name], master), name
    assert not all(torch.equal(m, m.half().float()) for m in masters.values())
    # a validation's processes send back no masters: the export is still the fit's
    trainer.validate(dataloaders=DataLoader(data(), batch_size=8))
    again = torch.load(trainer.save_full_state_dict(tmp_path / "full.pt"), weights_only=True)
    assert all(torch.equal(again[name], master) for name, master in masters.items())


class PerRankLoss(TrainingModule):
    """Logs its loss without sync_dist: each rank's own value."""

    def __init__(self, interval: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.interval = interval
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.2)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        monitor = "train_loss_step" if self.interval == "step" else "train_loss_epoch"
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": plateau, "interval": self.interval, "monitor": monitor},
        }


def quiet_ddp(max_epochs: int, callbacks: list) -> Trainer:
    """Two spawned DDP ranks, nothing written but what `callbacks` save."""
    return Trainer(
        devices=2,
        strategy="ddp",
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks),
        enable_progress_bar=False,
        seed=0,
        callbacks=callbacks,
    )


def test_ranks_take_monitored_decisions_on_one_value(tmp_path):
    """Found by a review: a plateau scheduler stepped on each rank's own train_loss gave
    the ranks other learning rates, and their weights drifted apart; an EarlyStopping on it,
    checked at an epoch's end, stopped one rank and left the other waiting. Monitored values
    are now averaged over the ranks, and a stop decided at an epoch's end is agreed."""
    from mixprec.trainer import EarlyStopping

    for interval in ("step", "epoch"):
        stop = EarlyStopping("train_loss_epoch", patience=1, min_delta=0.5)
        trainer = quiet_ddp(4, [DumpParams(tmp_path), stop])
        trainer.fit(PerRankLoss(interval), DataLoader(data(), batch_size=4, shuffle=True))
        r0, r1 = ranks(tmp_path)
        assert all(torch.equal(p, r1["params"][k]) for k, p in r0["params"].items()), interval


class NamesApart(TrainingModule):
    """Each rank logs a validation value of its own name (per-class metrics of the classes
    in its batches), and one more name on rank 1; both log a shared one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        rank = self.trainer.strategy.global_rank
        self.log("acc_cat" if rank == 0 else "acc_dog", float(1 - rank))
        if rank == 1:
            self.log("acc_eel", 0.25)
        self.log("shared", 5.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SaveMetrics(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_validation_end(self, trainer, model):
        torch.save(
            dict(trainer.callback_metrics),
            self.directory / f"metrics{trainer.strategy.global_rank}.pt",
        )


def test_epoch_means_of_names_the_ranks_logged_apart(tmp_path):
    """Found by a review: the epoch's values were reduced across ranks by position in each
    rank's own sorted names, so rank 0's acc_cat was averaged with rank 1's acc_dog (both
    read 0.5); with as many names on each rank in a different count, a process died. The
    names are agreed first: each value is the mean over the ranks that logged it."""
    trainer = quiet_ddp(1, [SaveMetrics(tmp_path)])
    val = DataLoader(data(), batch_size=8)
    trainer.fit(NamesApart(), DataLoader(data(), batch_size=8), val)
    for rank in range(2):
        metrics = torch.load(tmp_path / f"metrics{rank}.pt")
        picked = {k: metrics[k] for k in ("acc_cat", "acc_dog", "acc_eel", "shared")}
        assert picked == {"acc_cat": 1.0, "acc_dog": 0.0, "acc_eel": 0.25, "shared": 5.0}


class OnRankZero(TrainingModule):
    """Logs a value on rank 0 only (a metric logged under a condition)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch[0]), batch[1])
        if self.trainer.strategy.global_rank == 0:
            self.log("only0", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        config = {"scheduler": plateau, "monitor": "only0", "strict": False}
        return {"optimizer": opt, "lr_scheduler": config}


def test_a_value_only_some_ranks_logged_is_agreed_on_not_waited_for(tmp_path):
    """Found by a review of the agreement above: a monitored value logged on rank 0 only had
    rank 1 skip the decision while rank 0 waited for it in the average: the fit hung. The
    ranks first agree on whether any logged it; the mean is over those that did."""
    from mixprec.trainer import ModelCheckpoint

    saves = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="only0", every_n_train_steps=2)
    trainer = quiet_ddp(2, [DumpParams(tmp_path), saves])
    trainer.fit(OnRankZero(), DataLoader(data(), batch_size=8))
    r0, r1 = ranks(tmp_path)
    assert all(torch.equal(p, r1["params"][k]) for k, p in r0["params"].items())
    assert list((tmp_path / "ck").glob("*.ckpt"))


class DumpCheckpointRecords(Callback):
    """Each rank saves what its ModelCheckpoint recorded (its best and its files)."""

    def __init__(self, directory: Path, saves) -> None:
        self.directory, self.saves = directory, saves

    def on_fit_end(self, trainer, model):
        records = {
            "best": self.saves.best_model_path,
            "best_k": dict(self.saves.best_k_models),
            "last": self.saves.last_model_path,
        }
        torch.save(records, self.directory / f"records{trainer.strategy.global_rank}.pt")


def test_checkpoint_names_filled_with_per_rank_values_are_rank_zeros_on_every_rank(tmp_path):
    """Found by a review: a file-name template filled with a value each rank logged for
    itself (``train_loss`` without sync_dist) named the checkpoint differently on each rank.
    Rank 0 wrote its name while the others recorded files that were never written, so
    ``best_model_path`` (what ``ckpt_path="best"`` loads on every rank) named a missing file
    on rank 1, and a sharded save, which every rank writes, would have split its shards
    over two directories. The name is rank 0's on every rank."""
    from mixprec.trainer import ModelCheckpoint

    saves = ModelCheckpoint(
        dirpath=tmp_path / "ck",
        filename="{epoch}-{train_loss_step:.6f}",
        monitor="train_loss_epoch",
        save_top_k=2,
        save_last=True,
    )
    trainer = quiet_ddp(3, [saves, DumpCheckpointRecords(tmp_path, saves)])
    trainer.fit(PerRankLoss("epoch"), DataLoader(data(), batch_size=4, shuffle=True))
    r0, r1 = (torch.load(tmp_path / f"records{r}.pt") for r in range(2))
    assert r0 == r1
    written = sorted(str(p) for p in (tmp_path / "ck").glob("*.ckpt") if p.name != "last.ckpt")
    assert written == sorted(r0["best_k"]) and len(written) == 2
    assert Path(r0["best"]).exists() and Path(r0["last"]).exists()


class ScoredByEpoch(NamesApart):
    """Logs a given score per epoch at validation, the same on both ranks."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def validation_step(self, batch, batch_idx):
        self.log("v", self.scores[self.current_epoch])


def test_a_launched_fits_callbacks_start_the_next_fit_afresh(tmp_path):
    """The states a spawned fit's callbacks ended with were handed back as states to resume
    from: the Trainer's next fit kept the first fit's best score and patience, so early
    stopping ended an improving fit after two epochs (as a fit in one process no longer
    does), and the first fit's file stayed the best checkpoint."""
    from mixprec.trainer import EarlyStopping, ModelCheckpoint

    stopping = EarlyStopping("v", patience=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="v", save_top_k=1)
    trainer = quiet_ddp(4, [stopping, checkpoint])
    loader = DataLoader(data(), batch_size=16)
    trainer.fit(ScoredByEpoch([0.5, 0.1, 0.2, 0.3]), loader, loader)
    first = checkpoint.best_model_path
    assert first.endswith("epoch=1-step=4.ckpt") and stopping.best_score == pytest.approx(0.1)
    trainer.fit(ScoredByEpoch([0.9, 0.8, 0.7, 0.6]), loader, loader)
    assert trainer.current_epoch == 4
    assert checkpoint.best_model_score == pytest.approx(0.6) and checkpoint.best_model_path != first


class DumpLaunch(Callback):
    """Each rank writes what it sees of its start: a variable of its environment, its
    parent's process id, and the launcher's."""

    def __init__(self, directory: Path, variable: str) -> None:
        self.directory, self.variable = directory, variable

    def on_fit_start(self, trainer, model):
        import multiprocessing

        seen = {
            "value": os.environ.get(self.variable),
            "parent": os.getppid(),
            "launcher": multiprocessing.parent_process().pid,
        }
        torch.save(seen, self.directory / f"launch{trainer.strategy.global_rank}.pt")


def _one_epoch(strategy: str, net: nn.Module, callback: Callback, limit_s: float = 120.0) -> None:
    """A one-epoch fit of `net` on two ranks launched by `strategy`, with `callback`; ranks
    still running after `limit_s` are killed (a hung rank fails the test, not the suite)."""
    trainer = Trainer(
        devices=2, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, callbacks=[callback],
    )  # fmt: skip
    with _ranks_killed_after(limit_s):
        trainer.fit(net, DataLoader(data(), batch_size=16), loss_fn=F.mse_loss)


def _launched(tmp_path: Path, variable: str) -> list[dict]:
    _one_epoch("ddp", model(), DumpLaunch(tmp_path, variable))
    return [torch.load(tmp_path / f"launch{r}.pt") for r in range(2)]


def test_fresh_ranks_fork_from_a_server_and_take_the_launchers_environment(tmp_path, monkeypatch):
    """strategy='ddp' forks its ranks from multiprocessing's fork server (torch and mixprec
    imported once: a launch costs a fork, not an interpreter importing torch), each with the
    launcher's environment of the launch, not the server's; an environment changed since the
    server started (what an import reads may differ) spawns them instead."""
    from mixprec.trainer import strategy

    if strategy.fresh_start_method() != "forkserver":
        pytest.skip("the fork server here is not mixprec's, or this platform has none")
    first = _launched(tmp_path, "CUBLAS_WORKSPACE_CONFIG")
    assert all(r["parent"] != r["launcher"] == os.getpid() for r in first)  # (the server's)
    # variables read when used, not on import, changed after the server started
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert strategy.fresh_start_method() == "forkserver"
    forked = _launched(tmp_path, "CUBLAS_WORKSPACE_CONFIG")
    assert [r["value"] for r in forked] == [":16:8"] * 2
    assert all(r["parent"] != os.getpid() for r in forked)
    # a variable read on import (mixprec's, torch's, OpenMP's...): spawned, the launcher
    # their parent, the variable theirs
    monkeypatch.setenv("MIXPREC_TEST_SETTING", "read at import, perhaps")
    assert strategy.fresh_start_method() == "spawn"
    spawned = _launched(tmp_path, "MIXPREC_TEST_SETTING")
    assert [(r["value"], r["parent"]) for r in spawned] == [
        ("read at import, perhaps", os.getpid())
    ] * 2
    monkeypatch.delenv("MIXPREC_TEST_SETTING")
    assert strategy.fresh_start_method() == "forkserver"


class CollectsGarbage(Callback):
    """Each rank collects its garbage, the launcher's inherited by a fork with it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_fit_start(self, trainer, model):
        import gc

        gc.collect()
        (self.directory / f"collected{trainer.strategy.global_rank}").touch()


def test_a_forked_launch_frees_the_launchers_garbage_before_it_forks(tmp_path):
    """A gloo process group left in a reference cycle in the launcher (a test's, a fit's
    before): its destructor joins the group's threads. Collected in a forked rank, which has
    none of them, it killed the rank (SIGSEGV) as soon as that rank's collector ran."""
    import datetime
    import gc

    import torch.distributed as dist

    gc.disable()  # (the launcher's own collector must not free the group first)
    try:
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
        cycle: list = [group]
        cycle.append(cycle)
        del group, cycle
        # (a rank may also block for good, joining a thread it does not have)
        _one_epoch("ddp_fork", model(), CollectsGarbage(tmp_path))
    finally:
        gc.enable()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["collected0", "collected1"]


@contextlib.contextmanager
def _ranks_killed_after(seconds: float):
    """Kill this process's launched ranks if they still run after `seconds`: a hung rank
    fails the fit (and the test) instead of the suite."""
    import multiprocessing
    import threading

    def kill() -> None:
        for child in multiprocessing.active_children():
            child.kill()

    timer = threading.Timer(seconds, kill)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class DumpThreads(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_fit_start(self, trainer, model):
        rank = trainer.strategy.global_rank
        (self.directory / f"threads{rank}").write_text(str(torch.get_num_threads()))


def test_forked_ranks_take_one_thread_after_the_launcher_ran_a_parallel_region(
    tmp_path, monkeypatch
):
    """OpenMP's threads do not survive a fork: on a machine of 4 cores a forked rank took 2,
    and its first parallel region after the launcher had run one waited for ever for threads
    it did not have (torch's own elementwise ops; on this machine's 2 cores, 1 a rank, never
    seen). Forked ranks take one thread."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    try:
        torch.set_num_threads(2)
        a = torch.randn(1000, 1000)
        (a + a).sum()  # (a parallel region in the launcher: OpenMP's team of 2)
        _one_epoch("ddp_fork", BigBatch(), DumpThreads(tmp_path), limit_s=60.0)
    finally:
        torch.set_num_threads(threads)
    assert [(tmp_path / f"threads{r}").read_text() for r in range(2)] == ["1", "1"]


class BigBatch(nn.Module):
    """A model whose step runs parallel regions: an elementwise op over a million elements."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, x):
        big = torch.randn(1000, 1000)
        return self.net(x) + 0.0 * (big + big).sum()
