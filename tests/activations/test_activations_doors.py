"""Each activation option at every door: `Precision`, the Trainer, Lightning's plugin, the
Hugging Face Trainer and the Accelerate recipe all go through `Precision.setup`, so the
options are on the model they train. Recomputing trains bit for bit as keeping does; storing
in fewer bits trains close to it; offloading is refused off CUDA at each door."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import QUIET

from mixprec import PolicyMap, PolicySpecError, Precision
from mixprec.activations import wrapped
from mixprec.trainer import Trainer

BLOCKS = r"[12]"
STORED = ["bf16", "fp8"]
RECOMPUTED = ["checkpoint", "selective"]


class Block(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(x)))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), Block(), Block(), nn.Linear(32, 1))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def spec(option: str) -> dict[str, str]:
    return {BLOCKS: option}


def same_or_close(option: str, trained: torch.Tensor, kept: torch.Tensor) -> None:
    if option in RECOMPUTED:
        assert torch.equal(trained, kept)
    else:  # lossy storage: another result, close to keeping
        assert not torch.equal(trained, kept)
        assert (trained - kept).norm() < 0.01 * kept.norm()


def precision_loop(activations) -> tuple[nn.Module, torch.Tensor]:
    precision = Precision("32-true", activations=activations)
    model = net()
    model, optimizer = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in DataLoader(data(), batch_size=16):
        optimizer.zero_grad()
        precision.backward(F.mse_loss(model(x), y))
        precision.step(optimizer)
    return model, weights(model)


@pytest.mark.parametrize("option", STORED + RECOMPUTED)
def test_the_precision_door(option):
    _, kept = precision_loop(None)
    model, trained = precision_loop(spec(option))
    assert wrapped(model) == {"1": option, "2": option}
    same_or_close(option, trained, kept)


def trainer_fit(activations) -> tuple[nn.Module, torch.Tensor]:
    model = net()
    trainer = Trainer(precision="32-true", activations=activations, max_epochs=1, seed=0, **QUIET)
    loader = DataLoader(data(), batch_size=16)
    trainer.fit(model, loader, loss_fn=F.mse_loss, optimizer=lambda p: torch.optim.SGD(p, 0.1))
    return model, weights(model)


@pytest.mark.parametrize("option", STORED + RECOMPUTED)
def test_the_trainer_door(option):
    _, kept = trainer_fit(None)
    model, trained = trainer_fit(option if option in STORED else spec(option))
    expected = {""} if option in STORED else {"1", "2"}
    assert set(wrapped(model)) == expected and set(wrapped(model).values()) == {option}
    same_or_close(option, trained, kept)


def test_the_trainer_refuses_offload_and_a_precision_saying_otherwise():
    with pytest.raises(PolicySpecError, match="'offload' .* the run is on cpu"):
        Trainer(precision="32-true", activations="offload", accelerator="cpu", **QUIET)
    with pytest.raises(ValueError, match="the Precision given was built with activations=None"):
        Trainer(precision=Precision("32-true"), activations="fp8", **QUIET)
    with pytest.raises(PolicySpecError, match="give them once"):
        Precision(PolicyMap("32-true", activations="bf16"), activations="fp8")
    # the same rules carried by the Precision's policy map are no conflict (refused before,
    # "built with activations=None"); other rules are, named as the map holds them
    carried = Precision(PolicyMap("32-true", activations="fp8"))
    Trainer(precision=carried, activations="fp8", **QUIET)
    with pytest.raises(ValueError, match=r"built with activations=ActivationRules\('fp8'\)"):
        Trainer(precision=carried, activations="bf16", **QUIET)


def lightning_fit(option: str | None) -> tuple[nn.Module, torch.Tensor]:
    pl = pytest.importorskip("pytorch_lightning")
    from mixprec.integrations.lightning import MixprecPrecision

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    activations = {r"net\.[12]": option} if option else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        plugins=[MixprecPrecision(Precision("32-true", activations=activations))],
    )
    trainer.fit(module, DataLoader(data(), batch_size=16))
    return module, weights(module)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("option", ["fp8", "checkpoint"])
def test_the_lightning_door(option):
    _, kept = lightning_fit(None)
    module, trained = lightning_fit(option)
    assert wrapped(module) == {"net.1": option, "net.2": option}
    same_or_close(option, trained, kept)


@pytest.fixture
def hf(monkeypatch):
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    AcceleratorState._reset_state(reset_partial_state=True)
    yield transformers, accelerate
    AcceleratorState._reset_state(reset_partial_state=True)
    sys.modules.pop("doctor_gpt2", None)


GPT2_BLOCKS = {r"transformer\.h\.\d+": "checkpoint"}


def token_rows() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_the_hugging_face_door(hf, tmp_path):
    transformers, _ = hf
    from doctor_gpt2 import tiny_gpt2

    from mixprec.integrations.huggingface import MixprecTrainer

    def train(activations) -> tuple[nn.Module, torch.Tensor]:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        model = tiny_gpt2()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            report_to=[],
            use_cpu=True,
            max_steps=2,
            per_device_train_batch_size=4,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        precision = Precision("32-true", activations=activations)
        trainer = MixprecTrainer(
            model=model, args=args, train_dataset=token_rows(), precision=precision
        )
        trainer.train()
        return model, weights(model)

    _, kept = train(None)
    model, trained = train(GPT2_BLOCKS)
    assert set(wrapped(model).values()) == {"checkpoint"} and len(wrapped(model)) == 2
    assert torch.equal(trained, kept)
    model, stored = train("fp8")
    assert wrapped(model) == {"": "fp8"} and torch.isfinite(stored).all()


def test_the_accelerate_door(hf):
    _, accelerate = hf
    from doctor_gpt2 import tiny_gpt2

    from mixprec.integrations.huggingface import prepare

    def train(activations) -> tuple[nn.Module, torch.Tensor]:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
        model = tiny_gpt2()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(token_rows(), batch_size=4)
        precision = Precision("32-true", activations=activations)
        model, optimizer, loader = prepare(accelerator, precision, model, optimizer, loader)
        for batch in loader:
            optimizer.zero_grad()
            accelerator.backward(model(**batch).loss)
            optimizer.step()
        return model, weights(model)

    _, kept = train(None)
    model, trained = train(GPT2_BLOCKS)
    assert len(wrapped(model)) == 2
    assert torch.equal(trained, kept)
    with pytest.raises(PolicySpecError, match="'offload' .* the run is on cpu"):
        train("offload")


def test_an_option_on_a_model_whose_own_forward_never_runs_is_warned_of_once():
    """Before: a LightningModule (or TrainingModule) whose training step calls `self.net`
    took a uniform option ("fp8", "checkpoint") on its own forward, which never ran: the
    option silently did nothing."""

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    x = torch.randn(4, 8)
    for direct in (False, True):
        precision = Precision("32-true", activations="fp8")
        model = Step()
        model, _ = precision.setup(model, torch.optim.SGD(model.parameters()))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                out = model.net(x) if direct else model(x)
                precision.backward(out.sum())
        told = [w for w in caught if "a backward ran without its forward" in str(w.message)]
        assert len(told) == direct  # (once)
        if direct:
            assert "activations={'net': 'fp8'}" in str(told[0].message)


@pytest.mark.parametrize("option", ["keep", *STORED, *RECOMPUTED])
def test_torch_func_grad_takes_keep_only_as_the_docs_say(option):
    """Found by a review: under `torch.func.grad` (per-sample gradients by `vmap(grad)`) a
    model set up with any option but keep raised torch's refusal of saved-tensor hooks,
    unsaid; docs/activations.md's known limits say so, and that keep works."""
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU()))
    spec = option if option in STORED or option == "keep" else {"1": option}
    model = Precision("32-true", activations=spec).setup(model)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).square().sum()

    x = torch.randn(2, 8)
    if option == "keep":
        assert grad(loss)(params, x)["0.weight"].shape == (8, 8)
        return
    with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        grad(loss)(params, x)
    said = (Path(__file__).parents[2] / "docs" / "activations.md").read_text()
    assert "don't yet support saved tensor hooks" in said
