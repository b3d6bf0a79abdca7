"""The doctor on other libraries' models: a Hugging Face GPT-2 (a dict batch, the output's
`.loss`) and a Lightning LightningModule (`training_step`), each with a planted float16
fault that must be named; `mixprec doctor` on a factory returning a Hugging Face model."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from nets import Overflow, overflow_model

import mixprec
from mixprec.cli import main
from mixprec.doctor import BROKEN, diagnose
from mixprec.errors import PrecisionError
from mixprec.step import is_hugging_face_model

transformers = pytest.importorskip("transformers")
pl = pytest.importorskip("pytorch_lightning")

from test_doctor import names  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from doctor_gpt2 import make as make_gpt2  # noqa: E402
from doctor_gpt2 import tiny_gpt2  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:precision .* is slow")


# -- Hugging Face -----------------------------------------------------------------------------


def test_gpt2_outlier_layer_is_named_through_the_models_own_loss():
    model, batch = make_gpt2()
    d = diagnose(model, batch, precision="16-mixed")
    assert names(d) == ["transformer.h.1.mlp.c_fc"]
    assert d.modules["transformer.h.1.mlp.c_fc"].verdict == BROKEN
    assert d.modules["transformer.h.1.mlp.c_fc"].reason.startswith("output reaches 1.0e5")
    # the reference loss is the model's own: cross-entropy of the shifted labels
    with torch.no_grad():
        assert d.loss == pytest.approx(float(model(**batch).loss), rel=1e-6)


def test_healthy_gpt2_has_no_finding_in_bfloat16():
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    d = diagnose(model, {"input_ids": ids, "labels": ids}, precision="bf16-mixed")
    assert d.findings == [] and d.passes()


def test_a_noisy_float32_reference_is_said_when_no_layer_can_be_moved():
    """GPT-2 whose first attention's query and key saturate the softmax: bf16-mixed's
    gradients are 0.5 off float32's with no module at risk, and float32's are as far off
    float64's. recommend said only that the error builds up over many layers; it now says
    the reference itself is that noisy."""
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(3e4)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    d = diagnose(model, {"input_ids": ids, "labels": ids}, precision="bf16-mixed")
    assert d.findings == [] and not d.passes()
    with pytest.raises(PrecisionError, match=r"32-true against 64-true gives .* gradient error"):
        d.recommend()


def test_hugging_face_model_errors_say_what_is_accepted():
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8))
    assert is_hugging_face_model(model) and not is_hugging_face_model(Overflow())
    with pytest.raises(TypeError, match=r"returned no loss .*\['input_ids'\].*labels=input_ids"):
        diagnose(model, {"input_ids": ids})
    with pytest.raises(TypeError, match="Hugging Face model: its batch is a dict"):
        diagnose(model, ids)


def test_cli_doctor_on_a_hugging_face_factory(tmp_path, capsys):
    factory = tmp_path / "hf_factory.py"
    factory.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from doctor_gpt2 import make\n"
    )
    code = main(["doctor", f"{factory}:make", "--no-report", "--no-recommend"])
    out = capsys.readouterr().out
    assert code == 1
    assert "broken transformer.h.1.mlp.c_fc (Conv1D): output reaches 1.0e5" in out


# -- Lightning ---------------------------------------------------------------------------------


class OverflowModule(pl.LightningModule):
    """The doctor tests' planted overflow (`proj` reaches 1e5) inside a LightningModule whose
    training_step logs and returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.net, _ = overflow_model(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_module_overflow_is_named_through_training_step():
    module = OverflowModule()
    _, batch = overflow_model(1e5)
    d = diagnose(module, batch, precision="16-mixed")
    assert names(d) == ["net.proj"]
    with torch.no_grad():
        reference = float(F.cross_entropy(module(batch[0]), batch[1]))
    assert d.loss == pytest.approx(reference, rel=1e-6)
    fix = d.recommend()
    assert set(fix.policy.rules) == {"net.proj"} and fix.verified.passes()


def test_lightning_example_factory_from_the_cli(capsys):
    code = main(
        ["doctor", str(ROOT / "examples/doctor_lightning.py:make"), "--no-report", "--no-recommend"]
    )
    assert code == 1
    assert "broken proj (Linear): output reaches 1.0e5" in capsys.readouterr().out


def test_lightning_manual_optimization_is_refused_with_the_way_out():
    class Manual(OverflowModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    _, batch = overflow_model(1e5)
    with pytest.raises(TypeError, match="manual optimization.*loss_fn=..."):
        diagnose(Manual(), batch)
    # the network inside it can still be diagnosed
    d = diagnose(Manual().net, batch, F.cross_entropy, precision="16-mixed")
    assert names(d) == ["proj"]


NAIVE_SOFTMAX = """
import torch, torch.nn.functional as F
from torch import nn


class NaiveSoftmax(nn.Module):
    def forward(self, x):
        return x.exp() / x.exp().sum(-1, keepdim=True)  # overflows float16 past 11


def make():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), NaiveSoftmax(), nn.Linear(8, 2)
    )
    with torch.no_grad():
        model[2].weight.mul_(20.0)
    return model, (torch.randn(64, 8), torch.randint(0, 2, (64,))), F.cross_entropy
"""


def test_cli_doctor_honours_a_type_rule_for_a_class_of_the_factory_file(tmp_path, capsys):
    """Found by a review: the CLI imported the factory file under a name of its own, and a
    policy file's type rule "softmaxes.NaiveSoftmax" imported it again: another class, which
    no module of the model is, so the float32 rule was silently ignored (broken, exit 1). The
    file is now the module its name imports, and a type rule of the user's matching nothing
    is warned of."""
    import sys

    (tmp_path / "softmaxes.py").write_text(NAIVE_SOFTMAX)
    policy = tmp_path / "policy.json"
    rule = '{"type": "softmaxes.NaiveSoftmax", "policy": "32-true"}'
    policy.write_text('{"default": "16-mixed", "rules": [' + rule + "]}")
    try:
        args = ["doctor", f"{tmp_path / 'softmaxes.py'}:make", "--precision", str(policy)]
        assert main([*args, "--no-report", "--no-recommend"]) == 0
        assert "0 broken" in capsys.readouterr().out
    finally:
        sys.modules.pop("softmaxes", None)
    # a rule for a class of the same name as a module's, not its class, is warned of; one
    # for a type the model lacks (a map shared by several models) is not
    twin = type("Linear", (torch.nn.Module,), {"__module__": "elsewhere"})
    lacking = type("Gone", (torch.nn.Module,), {"__module__": "elsewhere"})
    policy_map = mixprec.PolicyMap("32-true", {twin: "bf16-mixed", lacking: "bf16-mixed"})
    with pytest.warns(UserWarning, match=r"type rules match no module of Sequential: elsewh"):
        mixprec.apply(torch.nn.Sequential(torch.nn.Linear(2, 2)), policy_map)
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # (a slow-precision note may come)
        warnings.simplefilter("always")
        mixprec.apply(
            torch.nn.Sequential(torch.nn.Linear(2, 2)),
            mixprec.PolicyMap("32-true", {lacking: "bf16-mixed"}),
        )
    assert not [w for w in caught if "type rules" in str(w.message)]
