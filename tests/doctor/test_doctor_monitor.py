"""PrecisionMonitor: cheap per-layer range tracking that warns, by layer name, before
float16 overflows and when the loss scaler keeps skipping."""

import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import QUIET

import mixprec
from mixprec.doctor.monitor import LayerSample, PrecisionMonitor, PrecisionWarning
from mixprec.optim.scaling import DynamicLossScaler
from mixprec.trainer import Callback, Logger, Trainer
from mixprec.trainer.callbacks import callback_states, load_callback_states

pytestmark = pytest.mark.filterwarnings("ignore:precision .* is slow")


def model_16_mixed() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 2)
    )
    return mixprec.apply(model, "16-mixed")


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def run(model, monitor, steps, grow, scaler=None):
    """A loop in which layer "2"'s weight doubles after every step; returns the first step
    whose forward produced inf/NaN anywhere."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    first_bad = None
    for step in range(steps):
        monitor.start_step(step)
        out = model(x)
        if first_bad is None and not torch.isfinite(out).all():
            first_bad = step
        (out.float().pow(2).mean() * (scaler.loss_scale if scaler else 1.0)).backward()
        with torch.no_grad():
            model[2].weight.mul_(grow)
        if scaler is not None:
            overflow = first_bad is not None
            scaler.update(torch.tensor(float(overflow)), overflow)
        monitor.end_step(step, scaler)
    return first_bad


def test_warns_with_the_layer_name_before_it_overflows():
    model = model_16_mixed()
    logged = []
    monitor = PrecisionMonitor(every_n_steps=2, log_fn=lambda m, s: logged.append((s, m)))
    monitor.attach(model)
    with pytest.warns(PrecisionWarning) as caught:
        first_bad = run(model, monitor, 20, grow=2.0)
    messages = [str(w.message) for w in caught]
    assert first_bad is not None
    trend = next(i for i, m in enumerate(messages) if "at this rate it passes float16 max" in m)
    near = next(i for i, m in enumerate(messages) if "within 4x of float16 max 65504" in m)
    assert messages[trend].startswith("layer 2 amax grew")
    assert messages[near].startswith("layer 2 reaches")
    # both warnings came from steps before the first inf/NaN
    warned_at = [int(messages[i].split("step ")[1].split()[0].rstrip(";,")) for i in (trend, near)]
    assert max(warned_at) < first_bad
    # inf/NaN is named once, at the layer where it starts, not downstream
    nonfinite = [m for m in messages if "produced inf/NaN" in m]
    assert len(nonfinite) == 1
    assert nonfinite[0].startswith("layer 2 produced inf/NaN in float16 at step ")
    # metrics: every monitored step, every low-precision layer; islands (float32) are skipped
    assert [s for s, _ in logged] == list(range(0, 20, 2))
    first = logged[0][1]
    assert {"precision/0/amax", "precision/2/amax", "precision/4/grad_amax"} <= set(first)
    assert not any(k.startswith("precision/3/") for k in first)  # LayerNorm runs in float32
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert first["precision/0/amax"] == float(model[0](x).abs().max())  # never changes
    assert len(monitor.history["2"]) == 10


class _ExpBlock(nn.Module):
    """Two Linears with an ``exp`` between them, called as a function: its own code, not a
    child, overflows float16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.fc1(x).exp())


def test_an_inf_made_by_a_parents_own_code_is_named_at_the_parent_not_its_child():
    """Layers finish child first: the monitor named ``1.fc2``, which only received the inf
    the block's ``exp`` made (the doctor names the block). The first layer whose output is
    not finite while its inputs were is named, also one that hands on its child's output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _ExpBlock(), nn.Linear(8, 2))
    with torch.no_grad():
        model[1].fc1.weight.mul_(20)
    precision = mixprec.Precision("16-mixed", allow_slow=True)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    monitor = PrecisionMonitor(every_n_steps=1).attach(model)
    monitor.start_step(0)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    with pytest.warns(PrecisionWarning, match="produced inf/NaN"):
        precision.backward(F.cross_entropy(model(x), y))
        monitor.end_step(0, scaler=precision.scaler)
    nonfinite = [w for w in monitor.warnings if "produced inf/NaN" in w]
    assert len(nonfinite) == 1 and nonfinite[0].startswith("layer 1 produced inf/NaN")


def test_hooks_exist_only_on_monitored_steps():
    model = model_16_mixed()
    monitor = PrecisionMonitor(every_n_steps=3).attach(model)
    assert hooks(model) == 0
    assert monitor.start_step(1) is False and hooks(model) == 0
    assert monitor.end_step(1) == {}
    assert monitor.start_step(3) is True and hooks(model) == len(list(model.modules()))
    model(torch.randn(2, 8)).sum().backward()
    metrics = monitor.end_step(3)
    assert hooks(model) == 0 and metrics["precision/2/amax"] > 0
    assert monitor.start_step(3) is False  # a step is measured once
    # a monitored step that never reached end_step (its forward raised) ends at the next
    assert monitor.start_step(6) is True and hooks(model) > 0
    assert monitor.start_step(7) is False and hooks(model) == 0
    model(torch.randn(2, 8))
    assert monitor.end_step(7) == {} and monitor.end_step(6) == {}
    monitor.detach()
    with pytest.raises(RuntimeError, match="before attach"):
        monitor.start_step(0)


def test_warns_when_the_scaler_keeps_skipping():
    model = model_16_mixed()
    monitor = PrecisionMonitor(every_n_steps=5, skip_patience=3).attach(model)
    scaler = DynamicLossScaler(init_scale=2.0**8, min_scale=1.0, max_skips_at_min_scale=100)
    with pytest.warns(PrecisionWarning) as caught:
        run(model, monitor, 30, grow=4.0, scaler=scaler)
    skipping = [str(w.message) for w in caught if "keeps skipping" in str(w.message)]
    assert len(skipping) == 1
    assert "2 (inf/NaN)" in skipping[0]  # names the layer that overflows
    assert scaler.stats().skipped_steps > 3


def test_argument_checks():
    for kwargs, match in (
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"headroom": 0.5}, "headroom"),
        ({"skip_patience": 0}, "skip_patience"),
        ({"underflow_warn": 0}, "underflow_warn"),
        # these were taken: 2.5 monitored steps 0, 5, 10; True every step; history failed
        # at the first monitored step's end
        ({"every_n_steps": 2.5}, "every_n_steps must be a whole number >= 1, got 2.5"),
        ({"every_n_steps": True}, "every_n_steps must be a whole number >= 1, got True"),
        ({"every_n_steps": "5"}, "every_n_steps must be a whole number >= 1, got '5'"),
        ({"history": -1}, "history must be a whole number >= 1, got -1"),
        ({"horizon_steps": -3}, "horizon_steps must be a whole number >= 0, got -3"),
    ):
        with pytest.raises(ValueError, match=match):
            PrecisionMonitor(**kwargs)


class ListLogger(Logger):
    def __init__(self) -> None:
        super().__init__("unused")
        self.records: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics, step):
        self.records.append((step, dict(metrics)))


class Grow(Callback):
    """Sabotage: doubles one layer's weight after every step."""

    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        with torch.no_grad():
            model[2].weight.mul_(2.0)


def test_as_a_trainer_callback(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 2)
    )
    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), 8)
    logger = ListLogger()
    monitor = PrecisionMonitor(every_n_steps=2)
    trainer = Trainer(
        precision="16-mixed",
        allow_slow_precision=True,
        max_steps=16,
        callbacks=[monitor, Grow()],
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    with pytest.warns(PrecisionWarning, match="layer 2 "):
        trainer.fit(model, data, loss_fn=F.cross_entropy)
    monitored = [s for s, m in logger.records if "precision/2/amax" in m]
    assert monitored == [1, 3, 5, 7, 9, 11, 13, 15]  # steps 0, 2, ... logged as 1, 3, ...
    amax = [m["precision/2/amax"] for _, m in logger.records if "precision/2/amax" in m]
    finite = [a for a in amax if math.isfinite(a)]
    assert finite == sorted(finite) and finite[-1] > 8 * finite[0]
    assert all("precision/loss_scale" in m for _, m in logger.records if "precision/2/amax" in m)
    assert hooks(model) == 0  # detached at the end of fit


def test_the_trainer_calls_the_hooks_an_object_has_and_refuses_others(tmp_path):
    """The monitor is no Callback subclass (the doctor does not import the Trainer); the
    Trainer takes it for the hooks it defines, through a checkpointed run, its resume and a
    failing run, and refuses an object with a hook it does not have, by name."""
    assert not issubclass(PrecisionMonitor, Callback)

    class Foreign:  # a Lightning callback's shape
        def on_fit_start(self, trainer, model):
            pass

        def on_sanity_check_start(self, trainer, model):
            pass

    with pytest.raises(ValueError, match="Foreign, whose on_sanity_check_start are not"):
        Trainer(callbacks=[Foreign()])

    def fit(epochs, ckpt_path=None, model=None):
        monitor = PrecisionMonitor(every_n_steps=1)
        trainer = Trainer(
            precision="bf16-mixed",
            allow_slow_precision=True,
            max_epochs=epochs,
            callbacks=[monitor],
            logger=False,
            enable_progress_bar=False,
            default_root_dir=tmp_path,
        )
        torch.manual_seed(0)
        model = model or nn.Sequential(nn.Linear(4, 2))
        data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), 4)
        trainer.fit(model, data, loss_fn=F.cross_entropy, ckpt_path=ckpt_path)
        return monitor, trainer.checkpoint_callback.best_model_path

    monitor, saved = fit(1)  # two steps, checkpointed
    assert [s.step for s in monitor.history["0"]] == [0, 1] and saved
    monitor, _ = fit(2, ckpt_path=saved)
    # its history is part of the run's state: the resumed fit goes on from the checkpoint's
    # (so does a ddp_fork run's, handed back to this object from rank 0)
    assert [s.step for s in monitor.history["0"]] == [0, 1, 2, 3]
    assert pickle.loads(pickle.dumps(monitor)).history == monitor.history  # (a ddp run's copy)

    class Fails(nn.Sequential):
        def forward(self, x):
            raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        fit(1, model=Fails(nn.Linear(4, 2)))


def test_a_validation_inside_an_accumulation_window_does_not_count(tmp_path):
    """The hooks stay on from the step's first micro-batch to its optimizer step, and a
    validation due between two micro-batches ran under them: its forwards (inputs 3e4
    times the training ones) made every monitored step read inf in float16."""

    def amax(validate: bool):
        monitor = PrecisionMonitor(every_n_steps=1)
        trainer = Trainer(
            precision="16-mixed",
            allow_slow_precision=True,
            max_steps=2,
            accumulate_grad_batches=2,
            val_check_interval=1,  # after every training batch
            callbacks=[monitor],
            **QUIET,
        )
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 2))
        x = torch.randn(16, 4)
        train = DataLoader(TensorDataset(x, torch.randint(0, 2, (16,))), 4)
        val = DataLoader(TensorDataset(x * 3e4, torch.randint(0, 2, (16,))), 4)
        trainer.fit(model, train, val if validate else None, loss_fn=F.cross_entropy)
        return [s.amax for s in monitor.history["0"]], monitor.warnings

    alone, _ = amax(False)
    with_validation, warned = amax(True)
    assert with_validation == alone and all(math.isfinite(a) for a in alone)
    assert warned == []


class Distilled(nn.Module):
    """A student and a teacher whose float16 logits overflow (its last weight is 1e4)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        self.student = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        with torch.no_grad():
            self.teacher[1].weight.fill_(1e4)


def test_a_teacher_run_without_gradients_inside_the_step_counts_and_pause_leaves_out():
    """Forwards without gradients inside the step (a distillation's teacher) feed its loss:
    an overflow there is the monitor's to name. An evaluation between `pause` and
    `unpause` is not the step's."""
    model = Distilled()
    precision = mixprec.Precision("16-mixed", device="cpu", allow_slow=True)
    model, opt = precision.setup(model, torch.optim.SGD(model.student.parameters(), lr=0.1))
    monitor = PrecisionMonitor(every_n_steps=1).attach(model)
    x = torch.randn(16, 4) * 10
    monitor.start_step(0)
    with precision.forward_context():
        monitor.pause()
        model.student(x * 1e4)  # an evaluation: left out
        monitor.unpause()
        with torch.no_grad():
            taught = model.teacher(x)
        loss = F.mse_loss(model.student(x).float(), taught.float())
    precision.backward(loss)
    precision.step(opt)
    with pytest.warns(PrecisionWarning, match="layer teacher.1 produced inf/NaN in float16"):
        monitor.end_step(0, scaler=precision.scaler)
    assert sorted(monitor.history) == ["student.0", "student.1", "teacher.0", "teacher.1"]
    assert monitor.history["student.0"][0].amax < 1e3  # (the paused forward's is 1e4 times)


# a quiet bf16-mixed Trainer's flags (allowed where bfloat16 is slow: tiny models here)
BF16 = dict(precision="bf16-mixed", allow_slow_precision=True, **QUIET)


class BrokenLoader:
    """A validation loader that raises when iterated."""

    def __iter__(self):
        raise RuntimeError("validation data broken")

    def __len__(self) -> int:
        return 2


def test_a_validation_that_raised_leaves_the_monitor_counting_in_the_next_fit():
    """The pause of a validation that raised stayed: the next fit recorded nothing, and a
    step monitored in an earlier fit was left out of the next fit."""
    monitor = PrecisionMonitor(every_n_steps=1)
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), 4)

    def trainer():
        return mixprec.Trainer(max_steps=2, callbacks=[monitor], **BF16)

    with pytest.raises(RuntimeError, match="validation data broken"):
        trainer().validate(nn.Sequential(nn.Linear(4, 2)), BrokenLoader(), loss_fn=F.cross_entropy)
    for _ in range(2):  # (each fit records its own steps: a new fit starts afresh)
        trainer().fit(nn.Sequential(nn.Linear(4, 2)), data, loss_fn=F.cross_entropy)
        assert [s.step for s in monitor.history["0"]] == [0, 1]
    # one key for one setting, however it is written
    assert PrecisionMonitor(headroom=4).state_key == PrecisionMonitor(headroom=4.0).state_key


def test_two_monitors_of_one_run_keep_their_states_apart():
    """Each is kept under a key of its settings: two in one Trainer were refused as sharing
    the key "PrecisionMonitor"."""
    monitors = [PrecisionMonitor(every_n_steps=1), PrecisionMonitor(every_n_steps=2)]
    trainer = mixprec.Trainer(max_steps=2, callbacks=monitors, **BF16)
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), 4)
    trainer.fit(nn.Sequential(nn.Linear(4, 2)), data, loss_fn=F.cross_entropy)
    assert [len(m.history["0"]) for m in monitors] == [2, 1]
    assert monitors[0].state_key != monitors[1].state_key


def test_a_failing_fit_leaves_no_hook_on_the_model(tmp_path):
    """The forward ran (hooks armed), then the loss raised: on_fit_end never comes, and the
    hooks must not stay on the model, keeping statistics of each later forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), 4)
    monitor = PrecisionMonitor(every_n_steps=1)
    trainer = Trainer(
        precision="bf16-mixed",
        allow_slow_precision=True,
        max_steps=2,
        callbacks=[monitor],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )

    def failing_loss(outputs, target):
        raise RuntimeError("planted in the loss")

    with pytest.raises(RuntimeError, match="planted in the loss"):
        trainer.fit(model, data, loss_fn=failing_loss)
    assert hooks(model) == 0


@pytest.mark.parametrize("order", ["bad-first", "bad-last"])
def test_a_nan_from_any_call_of_a_layer_is_kept(order):
    """A layer called twice in a step (shared, or micro-batches) whose first call made a
    NaN and the second a finite output: the finite amax replaced the NaN, and the warning
    blamed the root instead of the layer."""

    class NaiveSoftmax(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.exp() / x.exp().sum(-1, keepdim=True)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.sm = NaiveSoftmax()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            big, small = h * 100.0, h * 0.1
            first, second = (big, small) if order == "bad-first" else (small, big)
            return self.sm(first) + self.sm(second)

    torch.manual_seed(0)
    model = Twice()
    mixprec.apply(model, "16-true")
    monitor = PrecisionMonitor(every_n_steps=1).attach(model)
    with pytest.warns(PrecisionWarning, match="layer sm produced inf/NaN"):
        monitor.start_step(0)
        model(torch.randn(4, 8, dtype=torch.float16)).float().sum().backward()
        metrics = monitor.end_step(0)
    assert math.isnan(metrics["precision/sm/amax"])


class _Residual(nn.Module):
    """A block written as torchvision's BasicBlock: its residual added in place to its
    layer's output, then an in-place ReLU (the identity ``fc``: outputs computed by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        self.relu = nn.ReLU(inplace=True)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(4))

    def forward(self, x):
        out = self.fc(x)
        out += x
        return self.relu(out)


def _residuals() -> nn.Sequential:
    return nn.Sequential(_Residual(), _Residual(), nn.Linear(4, 2)).half()


def test_an_output_changed_in_place_after_its_sample_is_sampled_again():
    """``fc``'s output, sampled before ``out += x``, was taken as the block's output handed
    on: block 0's 4e4 was never seen, and block 1's inf (4e4 + 4e4 in float16) was blamed
    on ``<root>``."""
    model = _residuals()
    x = torch.tensor([[20000.0, 1.0, 2.0, 3.0]], dtype=torch.float16)
    monitor = PrecisionMonitor(every_n_steps=1).attach(model)
    monitor.start_step(0)
    with pytest.warns(PrecisionWarning):
        model(x)
        metrics = monitor.end_step(0)
    assert metrics["precision/0.fc/amax"] == 20000.0  # (its sample, taken before the add)
    assert metrics["precision/0.relu/amax"] == 40000.0  # block 0's output: 2 * 2e4
    assert metrics["precision/1.fc/amax"] == 40000.0
    assert metrics["precision/1.relu/amax"] == math.inf  # 8e4 overflows float16
    nonfinite = [w for w in monitor.warnings if "produced inf/NaN" in w]
    assert len(nonfinite) == 1 and nonfinite[0].startswith("layer 1 produced inf/NaN")


def test_the_gradient_of_each_version_of_an_output_changed_in_place():
    """``fc``'s hook gets the gradient of its output before the add (the ReLU's cut where
    2x < 0: 3), the ReLU's that of the block's output (the loss's weights: 5); the outputs
    and gradients are those of a run without the monitor."""

    def run(monitored: bool):
        model = nn.Sequential(_Residual()).half()
        x = torch.tensor([[1.0, -3.0, 2.0, 0.5]], dtype=torch.float16, requires_grad=True)
        weights = torch.tensor([1.0, 5.0, 2.0, 3.0], dtype=torch.float16)
        monitor = PrecisionMonitor(every_n_steps=1).attach(model)
        if monitored:
            monitor.start_step(0)
        out = model(x)
        (out * weights).sum().backward()
        return out, x.grad, model[0].fc.weight.grad, monitor.end_step(0)

    out, x_grad, w_grad, metrics = run(True)
    assert metrics["precision/0.fc/grad_amax"] == 3.0
    assert metrics["precision/0.relu/grad_amax"] == 5.0
    assert metrics["precision/0.relu/amax"] == 4.0  # relu(2 * [1, -3, 2, 0.5])
    bare = run(False)
    assert bare[3] == {}
    for a, b in zip((out, x_grad, w_grad), bare[:3], strict=True):
        assert torch.equal(a, b)


class _ToFloat8(nn.Module):
    def forward(self, x):
        return x.to(torch.float8_e4m3fn)


class _Dequantize(nn.Module):
    def forward(self, x):
        return x.to(torch.float16) * 2


class _Sparse(nn.Module):
    """A float16 output the monitor cannot measure (no aminmax for sparse tensors)."""

    def forward(self, x):
        return x.to(torch.float16).to_sparse()


def test_a_float8_input_is_measured():
    """A module given a float8 input broke the step ("max_values_cpu" not implemented for
    Float8_e4m3fn)."""
    model = nn.Sequential(_ToFloat8(), _Dequantize())
    monitor = PrecisionMonitor(every_n_steps=1).attach(model)
    monitor.start_step(0)
    model(torch.tensor([1.0, 2.0]))
    metrics = monitor.end_step(0)
    assert metrics["precision/0/amax"] == 2.0 and metrics["precision/1/amax"] == 4.0
    assert hooks(model) == 0


def test_a_measure_that_raises_leaves_no_hook_on_the_model():
    """The step fails; the hooks stayed on the model, measuring every later forward."""
    model = nn.Sequential(nn.Linear(2, 2), _Sparse())
    monitor = PrecisionMonitor(every_n_steps=1).attach(model)
    monitor.start_step(0)
    with pytest.raises(NotImplementedError):
        model(torch.ones(1, 2))
    assert hooks(model) == 0
    assert monitor.start_step(0) is False  # (the step is over: not measured again)
    assert monitor.end_step(0) == {}


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


def _flush_step(monitor, model, step: int, factor: float, upstream: float) -> dict:
    """One monitored step: float16 inputs of 2^-14 (its smallest normal) scaled by `factor`,
    gradients of `upstream` from above (0 where float16 cannot hold it)."""
    model[0].factor = factor
    x = torch.full((8,), 2.0**-14, dtype=torch.float16, requires_grad=True)
    monitor.start_step(step)
    model(x).backward(torch.full((8,), upstream, dtype=torch.float16))
    return monitor.end_step(step)


def test_outputs_and_gradients_flushed_to_zero_are_flagged_and_warned():
    """All zero reads as 0% underflow (a fraction of the nonzero values): gradients flushed
    entirely read as recovered. Now ``flushed`` / ``grad_flushed`` mark a layer all zero
    where its last sample was not, and warn naming it; a layer zero from its first sample
    (a zero-initialized branch) is not flushed."""
    model = nn.Sequential(_Scale(), _Scale())
    monitor = PrecisionMonitor(every_n_steps=1).attach(model)
    with pytest.warns(PrecisionWarning, match="below float16's smallest normal"):
        first = _flush_step(monitor, model, 0, 1.0, 2.0**-15)  # subnormal gradients
    assert first["precision/0/grad_underflow"] == 1.0 and "precision/0/grad_flushed" not in first
    with pytest.warns(PrecisionWarning) as caught:
        # 2^-14 * 2^-12 and 2^-26: below float16's smallest subnormal 2^-24, stored as 0
        metrics = _flush_step(monitor, model, 1, 2.0**-12, 2.0**-26)
    assert metrics["precision/0/underflow"] == 0.0 == metrics["precision/0/grad_underflow"]
    assert metrics["precision/0/flushed"] == 1.0 == metrics["precision/0/grad_flushed"]
    sample = monitor.history["0"][-1]
    assert (sample.amax, sample.grad_amax, sample.flushed, sample.grad_flushed) == (0, 0, 1, 1)
    messages = [str(w.message) for w in caught]
    assert (
        "layer 0: all its outputs are 0 at step 1, nonzero before: flushed to zero below "
        "float16's smallest subnormal 6e-08, or cut off"
    ) in messages
    assert (
        "layer 0: all the (scaled) gradients reaching it are 0 at step 1, nonzero before: "
        "flushed to zero below float16's smallest subnormal 6e-08, or cut off: raise the "
        "loss scale"
    ) in messages
    _flush_step(monitor, model, 2, 2.0**-12, 2.0**-26)  # still flushed, warned once
    assert monitor.history["0"][-1].grad_flushed and len(monitor.warnings) == len(messages) + 2
    # kept by a checkpoint; a row from before the flags loads as not flushed
    restored = PrecisionMonitor(every_n_steps=1)
    restored.load_state_dict(monitor.state_dict())
    assert restored.history == monitor.history
    assert LayerSample(*(0, "float16", 0.0, 0.0, 0.0, 0.0)).grad_flushed is False
    zero_from_the_start = PrecisionMonitor(every_n_steps=1).attach(model)
    assert "precision/0/grad_flushed" not in _flush_step(zero_from_the_start, model, 0, 1, 0)
    assert zero_from_the_start.warnings == []


class _Overflows(nn.Module):
    def forward(self, x):
        return x * 1e5


def test_a_trainers_next_fit_starts_the_monitor_afresh():
    """The second fit of a Trainer kept the first's history (steps 0, 1, 2, 3, 0, 1...), its
    warnings given (the same overflow was not warned again) and the scaler's counts; a
    state handed back from launched processes is not one to resume from either."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=4)
    monitor = PrecisionMonitor(every_n_steps=1, skip_patience=2)
    trainer = Trainer(precision="16-mixed", allow_slow_precision=True, max_steps=4,
                      callbacks=[monitor], **QUIET)  # fmt: skip

    def fit() -> list[str]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), _Overflows(), nn.Linear(4, 2))
        with pytest.warns(PrecisionWarning) as caught:
            trainer.fit(model, data, loss_fn=F.cross_entropy)
        return [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]

    warned, first = fit(), repr(monitor.state_dict())  # (repr: NaN == NaN)
    assert warned[0].startswith("layer 1 produced inf/NaN in float16 at step 0")
    assert any("keeps skipping" in w for w in warned)
    assert [s.step for s in monitor.history["1"]] == [0, 1, 2, 3]
    assert fit() == warned and repr(monitor.state_dict()) == first
    load_callback_states([monitor], callback_states([monitor]), resume=False)
    assert fit() == warned and repr(monitor.state_dict()) == first


class _CopiesToHost(torch.overrides.TorchFunctionMode):
    """Counts the ``Tensor.cpu`` calls made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.Tensor.cpu
        return func(*args, **(kwargs or {}))


def test_a_steps_numbers_come_to_the_host_in_one_copy_per_device():
    """Each scalar was copied on its own (a device sync each: 15 here, 3 numbers for each
    of 2 layers' outputs and gradients, and 3 layers' inputs), though one transfer was
    promised."""
    model = nn.Sequential(_Scale(), _Scale())
    monitor = PrecisionMonitor(every_n_steps=1).attach(model)
    model[0].factor = 2.0
    x = torch.full((8,), 0.5, dtype=torch.float16, requires_grad=True)
    monitor.start_step(0)
    model(x).sum().backward()
    with _CopiesToHost() as copies:
        metrics = monitor.end_step(0)
    assert copies.calls == 1
    assert metrics["precision/0/amax"] == 1.0 == metrics["precision/1/amax"]
    assert metrics["precision/0/grad_amax"] == 1.0 == metrics["precision/1/grad_amax"]


@pytest.mark.parametrize("option", ["selective", "checkpoint"])
def test_a_block_recomputed_in_the_backward_is_sampled_once_and_trains(option):
    """The hooks ran again in the recomputation, and the running input max they keep added
    an op the forward never ran: torch's selective checkpoint refused the backward."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), nn.Linear(16, 4)
    )
    precision = mixprec.Precision("bf16-mixed", allow_slow=True, activations={"0": option})
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters()))
    monitor = PrecisionMonitor(every_n_steps=1).attach(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for step in range(2):
        monitor.start_step(step)
        precision.backward(F.cross_entropy(model(x), y))
        monitor.end_step(step)
        precision.step(opt)
        opt.zero_grad()
    assert [s.step for s in monitor.history["0.0"]] == [0, 1]


class _Checkpointed(nn.Module):
    """A block run through torch's checkpoint, reentrant or not, by the model's own code."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        self.blk = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.blk, self.inp(x), use_reentrant=self.reentrant)
        return self.head(h)


def test_a_reentrant_checkpoints_layers_keep_their_gradient_samples():
    """Its first forward runs without grad, so the layers' gradients are hooked in the
    recomputation; skipping the recomputation whole lost them (its values are sampled once,
    in the first forward, either way)."""
    metrics = []
    for reentrant in (True, False):
        torch.manual_seed(0)
        precision = mixprec.Precision("bf16-mixed", allow_slow=True)
        model = precision.setup(_Checkpointed(reentrant))
        monitor = PrecisionMonitor(every_n_steps=1).attach(model)
        monitor.start_step(0)
        precision.backward(F.cross_entropy(model(torch.randn(8, 16)), torch.arange(8) % 4))
        metrics.append(
            {k: v for k, v in monitor.end_step(0).items() if k.startswith("precision/blk")}
        )
    assert "precision/blk.2/grad_amax" in metrics[0]
    assert metrics[0] == metrics[1]


class _Growing(nn.Module):  # a layer called 12 times, each call 4x its input: past 65504
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.cell = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.cell.weight.copy_(torch.eye(8) * 4.0)

    def forward(self, x):
        h = self.pre(x)
        for _ in range(12):
            h = self.cell(h)
        return self.head(h)


def test_a_looped_layer_that_overflows_in_a_later_call_is_named():
    """Found by a review: a layer's inputs were its largest over all its calls, so a layer
    called in a loop whose 8th call overflowed float16 had non-finite inputs (its 9th call
    took that inf) and was not taken for the culprit: the model itself was named ("layer
    <root> produced inf/NaN"). Each call now notes whether its inputs were finite and its
    output not; the first such call names its layer."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,))), batch_size=16)
    monitor = PrecisionMonitor(every_n_steps=1)
    trainer = Trainer(
        precision="16-mixed", max_steps=1, callbacks=[monitor], allow_slow_precision=True, **QUIET
    )
    with pytest.warns(PrecisionWarning, match="produced inf/NaN"):
        trainer.fit(_Growing(), data, loss_fn=F.cross_entropy)
    nonfinite = [w for w in monitor.warnings if "produced inf/NaN" in w]
    assert len(nonfinite) == 1 and nonfinite[0].startswith("layer cell produced inf/NaN")
