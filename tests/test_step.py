"""One training step (`mixprec.step`): the Trainer, the doctor and the bench compute the same
loss for the same batch under the same precision, bit for bit; and every door into a step
(mixprec's loops, the integrations, a bare LossScaleOptimizer, the doctor, the bench, the
search) runs one backward, `Precision.backward_context`."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch.utils.checkpoint import CheckpointError
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec import Trainer, diagnose
from mixprec.bench.models import load_workload
from mixprec.bench.runner import RunSpec, _build_mixprec
from mixprec.optim import LossScaleOptimizer
from mixprec.step import backward
from mixprec.trainer import Callback

FACTORY = """
import torch
from torch import nn
import torch.nn.functional as F


def make():
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))

    def make_batch(n):
        g = torch.Generator().manual_seed(1)
        return torch.randn(n, 8, generator=g) * 3, torch.randint(0, n, (n,), generator=g)

    def contrastive(out, target):  # a loss with a matmul of its own, as contrastive ones have
        return F.cross_entropy(out @ out.T, target)

    return model, make_batch, contrastive
"""


class FirstLoss(Callback):
    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.loss is None:
            self.loss = outputs.detach()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-mixed"])
def test_the_trainer_the_doctor_and_the_bench_compute_one_loss(tmp_path, precision):
    path = tmp_path / "workload.py"
    path.write_text(FACTORY)
    name = f"{path}:make"

    work = load_workload(name)
    x, y = work.make_batch(16)
    first = FirstLoss()
    trainer = Trainer(
        precision=precision,
        accelerator="cpu",
        max_steps=1,
        allow_slow_precision=True,
        callbacks=[first],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(work.model, DataLoader(TensorDataset(x, y), batch_size=16), loss_fn=work.loss_fn)

    work = load_workload(name)
    found = diagnose(work.model, (x, y), loss_fn=work.loss_fn, precision=precision, device="cpu")

    spec = RunSpec(
        model=name,
        precision=precision,
        batch_size=16,
        image_size=32,
        device="cpu",
        steps=1,
        warmup=0,
        threads=torch.get_num_threads(),
        allow_slow=True,
    )
    bench_loss = _build_mixprec(spec, torch.device("cpu")).step()

    assert first.loss is not None and first.loss.dtype == bench_loss.dtype
    # a mixed policy's outputs are float32, and so is the loss computed from them
    assert bench_loss.dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    assert float(first.loss) == found.target_loss == float(bench_loss)
    if precision != "32-true":  # the precision did change the loss: the test can tell
        assert found.target_loss != found.loss


# -- every door into a training step runs one backward ------------------------------------------
#
# A bfloat16 "true" model whose middle block is activation-checkpointed and makes a tensor
# without a dtype: its recomputation inside the backward matches the forward only when the
# backward runs in the forward's default dtype, which `Precision.backward_context` sets. Every
# door (mixprec's own loops, the integrations, a bare LossScaleOptimizer, the doctor, the
# bench, the search) must give the same loss, the same gradients and, after one SGD step,
# the same weights, bit for bit.

CHECKPOINTED = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        # a tensor made without a dtype (the default dtype, again when recomputed in
        # backward), saved for backward by the product
        return F.gelu(self.lin(x)) * torch.full((x.shape[-1],), 0.5)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = Block()
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(checkpoint(self.block, self.inp(x), use_reentrant=False))


def make():
    def make_batch(n):
        g = torch.Generator().manual_seed(1)
        return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)

    return Net(), make_batch, F.cross_entropy
"""

TRUE = "bf16-true"
LR = 0.1
N = 16


class Door(NamedTuple):
    """What one door computed: the loss, each parameter's gradient and its value after one
    SGD step (None where the door takes no such step)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor] | None
    weights: dict[str, torch.Tensor] | None


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("doors") / "checkpointed.py"
    path.write_text(CHECKPOINTED)
    return f"{path}:make"


def record_grads(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Each parameter's gradient as the backward leaves it (filled in as it runs), named as
    in the plain network (`prefix` is the wrapper's path to it)."""
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        key = name.removeprefix(prefix)
        p.register_post_accumulate_grad_hook(
            lambda p, key=key: grads.__setitem__(key, p.grad.detach().clone())
        )
    return grads


def weights(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {n.removeprefix(prefix): p.detach().clone() for n, p in model.named_parameters()}


def batch(workload: str) -> tuple[torch.Tensor, torch.Tensor]:
    return load_workload(workload).make_batch(N)


def loader(workload: str) -> DataLoader:
    return DataLoader(TensorDataset(*batch(workload)), batch_size=N)


def precision_loop(workload: str) -> Door:
    """The reference: a hand-written loop through `Precision`."""
    work = load_workload(workload)
    x, y = batch(workload)
    grads = record_grads(work.model)
    precision = mixprec.Precision(TRUE, allow_slow=True)
    model, opt = precision.setup(work.model, torch.optim.SGD(work.model.parameters(), lr=LR))
    opt.zero_grad()
    loss = work.loss_fn(model(x), y)
    precision.backward(loss)
    precision.step(opt)
    return Door(loss.detach(), grads, weights(model))


@pytest.fixture(scope="module")
def reference(workload) -> Door:
    door = precision_loop(workload)
    assert door.loss.dtype == torch.bfloat16 and len(door.grads) == 6
    assert all(g.dtype == torch.bfloat16 and g.abs().sum() > 0 for g in door.grads.values())
    return door


def assert_same(door: Door, reference: Door) -> None:
    assert door.loss.dtype == reference.loss.dtype
    assert torch.equal(door.loss, reference.loss), (float(door.loss), float(reference.loss))
    if door.grads is not None:
        assert door.grads.keys() == reference.grads.keys()
        for name, g in door.grads.items():
            assert torch.equal(g, reference.grads[name]), name
    if door.weights is not None:
        assert door.weights.keys() == reference.weights.keys()
        for name, w in door.weights.items():
            assert torch.equal(w, reference.weights[name]), name


def test_a_checkpointed_block_made_without_a_dtype_needs_the_backward_context(workload):
    """The workload tells a backward outside the context from one inside it: run plainly,
    its recomputation in float32 does not match the bfloat16 forward."""
    work = load_workload(workload)
    x, y = batch(workload)
    model = mixprec.apply(work.model, TRUE, warn=False)
    loss = work.loss_fn(model(x), y)
    with pytest.raises(CheckpointError):
        loss.backward()


def test_the_precision_loop_repeats_itself(workload, reference):
    assert_same(precision_loop(workload), reference)


def test_mixprecs_trainer_door(workload, reference):
    work = load_workload(workload)
    grads = record_grads(work.model)
    first = FirstLoss()
    trainer = Trainer(
        precision=TRUE,
        accelerator="cpu",
        max_steps=1,
        allow_slow_precision=True,
        callbacks=[first],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(
        work.model,
        loader(workload),
        loss_fn=work.loss_fn,
        optimizer=torch.optim.SGD(work.model.parameters(), lr=LR),
    )
    assert_same(Door(first.loss, grads, weights(work.model)), reference)


def test_the_bare_loss_scale_optimizer_door(workload, reference):
    """The loop `mixprec.optim` documents: the converted model given as ``model=``."""
    work = load_workload(workload)
    x, y = batch(workload)
    grads = record_grads(work.model)
    model = mixprec.apply(work.model, TRUE, warn=False)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model)
    opt.zero_grad()
    loss = work.loss_fn(model(x), y)
    opt.backward(loss)
    opt.step()
    # the default dynamic scale (2^16) scales and unscales bfloat16 gradients exactly
    grads = {name: g / opt.loss_scale for name, g in grads.items()}
    assert_same(Door(loss.detach(), grads, weights(model)), reference)


def test_the_doctors_door(workload, reference):
    """`doctor.running.loss_of` and the backward a diagnosis runs after it."""
    from mixprec.doctor.running import loss_of

    work = load_workload(workload)
    grads = record_grads(work.model)
    model = mixprec.apply(work.model, TRUE, warn=False)
    precision = mixprec.Precision(TRUE, device="cpu", allow_slow=True)
    loss = loss_of(model, precision, batch(workload), work.loss_fn)
    backward(precision, loss)
    assert_same(Door(loss.detach(), grads, None), reference)


def test_the_benchs_door(workload, reference):
    spec = RunSpec(
        model=workload,
        precision=TRUE,
        batch_size=N,
        image_size=32,
        device="cpu",
        steps=1,
        warmup=0,
        threads=torch.get_num_threads(),
        allow_slow=True,
    )
    loop = _build_mixprec(spec, torch.device("cpu"))
    loss = loop.step()
    names = [n for n, _ in load_workload(workload).model.named_parameters()]
    params = loop.optimizer.param_groups[0]["params"]
    grads = {n: p.grad for n, p in zip(names, params, strict=True)}
    assert_same(Door(loss, grads, None), reference)  # the bench steps Adam, not SGD


def test_the_searchs_door(workload, reference):
    """A plan's measured loss and timed training step (`plan.measure`), and its short
    training run: the search's backward is the one every loop runs."""
    from mixprec.plan.measure import measure_plans, train

    work = load_workload(workload)
    plan = mixprec.PolicyMap(TRUE)
    measured = measure_plans(
        work.model,
        {TRUE: plan},
        [],
        [batch(workload)],
        work.loss_fn,
        count="weights",
        training=True,
        reps=1,
        device=torch.device("cpu"),
        timed={TRUE},
        seed=0,
    )
    assert measured[TRUE].loss == float(reference.loss)
    trained = train(
        work.model,
        plan,
        [batch(workload)],
        [batch(workload)],
        work.loss_fn,
        steps=1,
        lr=LR,
        device=torch.device("cpu"),
        seed=0,
    )
    assert trained.losses == [float(reference.loss)]


def test_the_lightning_plugins_door(workload, reference):
    pl = pytest.importorskip("pytorch_lightning")
    from mixprec.integrations.lightning import MixprecPrecision

    class Module(pl.LightningModule):
        def __init__(self, net: torch.nn.Module, loss_fn) -> None:
            super().__init__()
            self.net, self.loss_fn, self.loss = net, loss_fn, None

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.loss_fn(self.net(x), y)
            self.loss = loss.detach()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    work = load_workload(workload)
    module = Module(work.model, work.loss_fn)
    grads = record_grads(module, "net.")
    trainer = pl.Trainer(
        plugins=[MixprecPrecision(TRUE, allow_slow=True)],
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader(workload))
    assert_same(Door(module.loss, grads, weights(module, "net.")), reference)


def hugging_face_model(workload: str) -> torch.nn.Module:
    """The workload's network inside a ``transformers.PreTrainedModel`` that computes its loss
    from ``labels``, as Hugging Face models do."""
    transformers = pytest.importorskip("transformers")
    work = load_workload(workload)

    class Config(transformers.PretrainedConfig):
        model_type = "mixprec-checkpointed"

    class Model(transformers.PreTrainedModel):
        config_class = Config
        main_input_name = "x"

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.net = torch.nn.Linear(1, 1)
            self.post_init()
            self.loss = None

        def forward(self, x, labels):
            loss = work.loss_fn(self.net(x), labels)
            self.loss = loss.detach()
            return {"loss": loss}

    model = Model(Config())
    model.net = work.model  # the workload's weights, as post_init would change them
    return model


def test_the_hugging_face_trainers_door(workload, reference, tmp_path):
    transformers = pytest.importorskip("transformers")
    from mixprec.integrations.huggingface import MixprecTrainer

    model = hugging_face_model(workload)
    grads = record_grads(model, "net.")
    x, y = batch(workload)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,
        max_steps=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        remove_unused_columns=False,
    )
    trainer = MixprecTrainer(
        model=model,
        args=args,
        train_dataset=[{"x": x, "labels": y}],  # one item: the whole batch, in its order
        data_collator=lambda rows: rows[0],
        optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
        precision=mixprec.Precision(TRUE, allow_slow=True),
    )
    trainer.train()
    assert_same(Door(model.loss, grads, weights(model, "net.")), reference)


def test_the_accelerate_door(workload, reference):
    accelerate = pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from mixprec.integrations.huggingface import prepare

    work = load_workload(workload)
    grads = record_grads(work.model)
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    precision = mixprec.Precision(TRUE, allow_slow=True)
    optimizer = torch.optim.SGD(work.model.parameters(), lr=LR)
    model, optimizer, data = prepare(
        accelerator, precision, work.model, optimizer, loader(workload)
    )
    for x, y in data:  # the loop as Accelerate users write it
        optimizer.zero_grad()
        loss = work.loss_fn(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
    assert_same(Door(loss.detach(), grads, weights(model)), reference)


@pytest.mark.parametrize(
    ("spec", "inside"), [("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)]
)
def test_the_backward_context_sets_a_true_policys_compute_dtype_and_scales(spec, inside):
    precision = mixprec.Precision(spec, scaler=8.0, allow_slow=True)
    model = torch.nn.Linear(2, 1)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters()))
    loss = model(torch.ones(1, 2)).sum()
    with precision.backward_context(loss) as scaled:
        assert torch.get_default_dtype() == inside
        assert torch.equal(scaled, loss * 8)
    assert torch.get_default_dtype() == torch.float32
    # a bare wrapper knows the policy from the model `apply` converted, and only from it
    net = mixprec.apply(torch.nn.Linear(2, 1), spec, warn=False)
    for given, expected in ((net, inside), (None, torch.float32)):
        lso = LossScaleOptimizer(torch.optim.SGD(net.parameters()), scaler=4.0, model=given)
        with lso.backward_context(loss) as scaled:
            assert torch.get_default_dtype() == expected
            assert torch.equal(scaled, loss * 4)


def test_a_backward_after_the_unscale_is_refused_at_every_door():
    precision = mixprec.Precision("16-mixed", allow_slow=True)
    model = torch.nn.Linear(2, 1)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters()))
    precision.backward(model(torch.ones(1, 2)).sum())
    precision.unscale_()
    loss = model(torch.ones(1, 2)).sum()
    for door in (precision, opt):
        with pytest.raises(RuntimeError, match="backward\\(\\) after unscale_\\(\\)"):
            with door.backward_context(loss):
                pass


def test_a_loss_scaled_twice_is_refused_at_every_door():
    """A loop written for a backward that did not scale (``accelerator.backward(
    precision.scaler.scale(loss))``) would scale twice: gradients the scale times too large
    after the one unscale, which an Adam step hides. Every backward refuses a scaled loss."""
    precision = mixprec.Precision("16-mixed", allow_slow=True)
    model = torch.nn.Linear(2, 1)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters()))
    scaled = precision.scaler.scale(model(torch.ones(1, 2)).sum())
    for door in (precision, opt):
        with pytest.raises(ValueError, match="already multiplied by the loss scale"):
            with door.backward_context(scaled):
                pass
    with pytest.raises(ValueError, match="pass the loss itself"):
        precision.backward(scaled)
    precision.backward(model(torch.ones(1, 2)).sum())  # the plain loss is taken
    assert model.weight.grad is not None
