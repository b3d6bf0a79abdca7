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
from mixprec.step import backward, batch_loss
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
    """`step.batch_loss`, the doctor's (and the search's) loss, and the backward a diagnosis
    runs after it."""
    work = load_workload(workload)
    grads = record_grads(work.model)
    model = mixprec.apply(work.model, TRUE, warn=False)
    precision = mixprec.Precision(TRUE, device="cpu", allow_slow=True)
    loss = batch_loss(precision, model, batch(workload), work.loss_fn)
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


# -- the per-step work of the formats: every door enters `Precision.before_step` ----------------
# Two gloo ranks train a delayed-scaling float8 model whose inputs run 4x larger on rank 1.
# DDP broadcasts rank 0's buffers before each forward, so after a step each rank holds its own
# newest amaxes unless the door shared them (the elementwise max over the ranks) before the
# optimizer step; every door must leave both ranks with the same histories.

AMAX_STEPS = 3


def float8_net() -> torch.nn.Module:
    """Linear-ReLU-Linear on 16 features, delayed float8 with 4-long amax histories."""
    from mixprec.quantize.float8 import convert_to_float8

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    return convert_to_float8(net, recipe="delayed", amax_history_length=4, skip_small=False)


def rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: the same draws on both ranks, rank 1's inputs 4x larger."""
    g = torch.Generator().manual_seed(3)
    draws = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(8)]
    return [(x * (1 + 3 * rank), y) for x, y in draws[:AMAX_STEPS]]


def alternating_rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` rows, the odd ones 4x larger: a sampler striding over two ranks gives rank 1 those."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 16, generator=g) * torch.tensor([1.0, 4.0]).repeat(n // 2)[:, None]
    return x, torch.randn(n, 16, generator=g)


def save_histories(net: torch.nn.Module, out: str, rank: int) -> None:
    histories = {k: v.clone() for k, v in net.state_dict().items() if k.endswith("amax_history")}
    torch.save(histories, f"{out}/rank{rank}.pt")


def assert_shared_histories(out) -> None:
    """Both ranks hold the same amax histories, with a step's amaxes recorded in each."""
    r0, r1 = (torch.load(out / f"rank{r}.pt") for r in range(2))
    assert sorted(r0) == sorted(r1) and len(r0) == 6
    for name in r0:
        assert bool((r0[name][:AMAX_STEPS] > 0).all()), name
        assert torch.equal(r0[name], r1[name]), name


def _precision_loop_amax_worker(rank: int, out: str) -> None:
    import torch.nn.functional as F

    net = float8_net()
    precision = mixprec.Precision("32-true")
    net, opt = precision.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    for x, y in rank_batches(rank):
        opt.zero_grad()
        precision.backward(F.mse_loss(ddp(x), y))
        precision.step(opt)
    save_histories(net, out, rank)


def _trainer_amax_worker(rank: int, out: str) -> None:
    import torch.nn.functional as F

    net = float8_net()
    trainer = Trainer(
        precision="32-true", strategy="ddp", devices=2, max_steps=AMAX_STEPS, seed=0,
        logger=False, enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    data = DataLoader(TensorDataset(*alternating_rows(8 * AMAX_STEPS)), batch_size=4)
    trainer.fit(net, data, loss_fn=F.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    save_histories(net, out, rank)


def _lightning_amax_worker(rank: int, out: str) -> None:
    import pytorch_lightning as pl
    import torch.nn.functional as F

    from mixprec.integrations.lightning import MixprecPrecision

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = float8_net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", plugins=[MixprecPrecision("32-true")],
        max_steps=AMAX_STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = DataLoader(TensorDataset(*alternating_rows(8 * AMAX_STEPS)), batch_size=4)
    trainer.fit(module, data)
    save_histories(module.net, out, rank)


def _hugging_face_amax_worker(rank: int, out: str) -> None:
    import tempfile

    import torch.nn.functional as F
    import transformers

    from mixprec.integrations.huggingface import MixprecTrainer

    class Config(transformers.PretrainedConfig):
        model_type = "mixprec-float8"

    class Model(transformers.PreTrainedModel):
        config_class = Config
        main_input_name = "x"

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.net = torch.nn.Linear(1, 1)
            self.post_init()

        def forward(self, x, labels):
            return {"loss": F.mse_loss(self.net(x), labels)}

    model = Model(Config())
    model.net = float8_net()
    x, y = alternating_rows(2 * AMAX_STEPS)
    rows = [{"x": x[i : i + 1], "labels": y[i : i + 1]} for i in range(len(x))]
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=1, max_steps=AMAX_STEPS,
            learning_rate=0.1, max_grad_norm=0.0, report_to=[], save_strategy="no",
            use_cpu=True, remove_unused_columns=False, disable_tqdm=True,
        )  # fmt: skip
        trainer = MixprecTrainer(
            model=model, args=args, train_dataset=rows, data_collator=lambda r: r[0],
            optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
            precision=mixprec.Precision("32-true"),
        )  # fmt: skip
        trainer.train()
    save_histories(model.net, out, rank)


def _accelerate_amax_worker(rank: int, out: str) -> None:
    import accelerate
    import torch.nn.functional as F

    from mixprec.integrations.huggingface import prepare

    net = float8_net()
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = prepare(accelerator, mixprec.Precision("32-true"), net, optimizer)
    for x, y in rank_batches(rank):  # the loop as Accelerate users write it
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
    save_histories(net, out, rank)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("door", "needs"),
    [
        ("precision_loop", ()),
        ("trainer", ()),
        ("lightning", ("pytorch_lightning",)),
        ("hugging_face", ("transformers",)),
        ("accelerate", ("accelerate", "transformers")),
    ],
)
def test_every_door_shares_the_float8_amax_histories_across_ranks(tmp_path, door, needs):
    from spawning import run_ranks

    for package in needs:
        pytest.importorskip(package)
    run_ranks(globals()[f"_{door}_amax_worker"], str(tmp_path), nprocs=2)
    assert_shared_histories(tmp_path)


class CountedLinear(torch.nn.Linear):
    """A Linear whose format counts the steps it was told of."""

    steps_told = 0


class CountingFormat(mixprec.formats.Format):
    """A format with work before each optimizer step: it counts them on its layers."""

    name = "counting"

    def step_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in model.modules() if isinstance(m, CountedLinear)]

    def before_step(self, layers, group) -> None:
        for layer in layers:
            layer.steps_told += 1


@pytest.fixture
def counting():
    mixprec.formats.register(CountingFormat())
    try:
        yield
    finally:
        mixprec.formats.unregister("counting")


def test_precision_step_runs_the_formats_work_once_per_step_and_after_each_closure(counting):
    net = torch.nn.Sequential(CountedLinear(4, 4), torch.nn.Linear(4, 1))
    precision = mixprec.Precision("32-true")
    net, opt = precision.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    for _ in range(3):
        opt.zero_grad()
        precision.backward(net(x).square().mean())
        precision.step(opt)
    assert net[0].steps_told == 3

    evaluations = []
    lbfgs = torch.optim.LBFGS(net.parameters(), max_iter=3)
    precision = mixprec.Precision("32-true")
    net, lbfgs = precision.setup(net, lbfgs)

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = net(x).square().mean()
        loss.backward()
        evaluations.append(net[0].steps_told)
        return loss

    precision.step(lbfgs, closure=closure)
    # each evaluation's backward is followed by the work, before the next evaluation
    assert evaluations == list(range(3, 3 + len(evaluations)))
    assert net[0].steps_told == 3 + len(evaluations)
    precision.reset()  # another run: the models set up before are forgotten
    precision.before_step()
    assert net[0].steps_told == 3 + len(evaluations)


class Argmax(torch.nn.Module):
    """A classifier that returns class indices: no loss computed from them reaches its
    weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).argmax(-1)


def test_the_trainer_the_doctor_and_the_search_check_one_batch_loss_alike():
    """`step.batch_loss` is the one checked loss of a batch: a loss that cannot train (outputs
    with no floating tensor, a loss left unreduced) is refused with the same words by the
    Trainer and the doctor (the Trainer ran the first into its backward before)."""
    from trainers import QUIET

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    precision = mixprec.Precision("32-true")
    for model, loss_fn in (
        (Argmax(), lambda out, t: (out.float() - t).abs().mean()),
        (torch.nn.Linear(4, 3), lambda out, t: out - t[:, None]),
    ):
        with pytest.raises(TypeError) as direct:
            batch_loss(precision, model, (x, y), loss_fn)
        with pytest.raises(TypeError) as trained:
            Trainer(max_steps=1, **QUIET).fit(model, data, loss_fn=loss_fn)
        with pytest.raises(TypeError) as diagnosed:
            diagnose(model, (x, y), loss_fn, "32-true")
        assert str(trained.value) == str(diagnosed.value) == str(direct.value)


def test_the_search_takes_its_losses_from_the_step_not_from_the_doctor():
    """The search (`mixprec.plan`) and the doctor share `step.batch_loss`; no module of the
    search imports the doctor's runner."""
    import ast
    from pathlib import Path

    plan = Path(mixprec.__file__).parent / "plan"
    imported = {
        node.module
        for path in plan.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "mixprec.step" in imported and "mixprec.doctor.running" not in imported


def test_a_precision_with_per_step_work_pickles_and_finds_it_again_at_setup(counting):
    """The Trainer sends its Precision to the processes it spawns: the models it set up stay
    behind, and the copy finds their work again when it sets them up."""
    import pickle

    net = torch.nn.Sequential(CountedLinear(4, 4))
    precision = mixprec.Precision("32-true")
    precision.setup(net)
    copied = pickle.loads(pickle.dumps(precision))
    copied.before_step()
    assert net[0].steps_told == 0
    copied.setup(net)
    copied.before_step()
    assert net[0].steps_told == 1
