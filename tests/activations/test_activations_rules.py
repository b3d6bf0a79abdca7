"""Activation rules: precedence, recompute below a recomputed module, the PolicyMap field
(saved, loaded and refused as strictly as states rules), warnings, and `explain`."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import PolicyMap, PolicySpecError
from mixprec.activations import ActivationRules, saved_bytes, wrapped
from mixprec.activations.codecs import FP8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.GELU()
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.act(self.fc(x)))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 2))


def options(model: nn.Module, spec) -> dict[str, str]:
    return {name: option for name, (option, _) in ActivationRules(spec).resolve(model).items()}


def test_precedence_exact_then_regex_then_type_then_parent_then_default():
    got = options(net(), {"1.fc": "bf16", r"\d\.fc": "keep", nn.Linear: "fp8", "2": "offload"})
    assert got["1.fc"] == "bf16"  # exact beats the regex
    assert got["2.fc"] == "keep"  # regex beats the type rule
    assert got["0"] == got["3"] == got["1.out"] == got["2.out"] == "fp8"
    assert got["2"] == got["2.act"] == "offload"  # inherited from its block
    assert got[""] == got["1"] == got["1.act"] == "keep"


def test_one_option_for_every_module_and_case_is_forgiven():
    got = options(net(), " FP8 ")
    assert set(got.values()) == {"fp8"}


def test_below_a_recomputed_module_every_module_is_recomputed_with_it():
    resolved = ActivationRules({r"\d": "checkpoint", nn.Linear: "fp8"}).resolve(net())
    assert resolved["1.fc"] == ("checkpoint", "recomputed with '1'")
    assert resolved["0"] == ("checkpoint", "regex rule '\\\\d'")
    assert resolved[""] == ("keep", "default")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fp4", "unknown activation option 'fp4'; expected 'keep', 'bf16', 'fp8', 'checkpoint'"),
        ({"1": 8}, "activation rule '1': unknown activation option int 8"),
        ({"(": "fp8"}, "activation rule '\\('.* is not a valid regex"),
        ({3: "fp8"}, "must be a module path regex"),
        (["fp8"], "one option for every module .* or a mapping"),
    ],
)
def test_bad_specs_are_refused_naming_what_is_accepted(spec, message):
    with pytest.raises(PolicySpecError, match=message):
        PolicyMap("32-true", activations=spec)


def test_two_rules_of_one_rank_matching_a_module_are_refused():
    with pytest.raises(PolicySpecError, match="matched by 2 activation regex rules"):
        ActivationRules({r"1\..*": "fp8", r".*\.fc": "bf16"}).resolve(net())


def test_the_map_saves_and_loads_its_activation_rules(tmp_path):
    pmap = PolicyMap(
        "bf16-mixed", {"3": "32-true"}, activations={r"[12]": "checkpoint", nn.Linear: "fp8"}
    )
    path = pmap.save(tmp_path / "policy.json")
    assert json.loads(path.read_text())["activations"] == [
        {"path": "[12]", "option": "checkpoint"},
        {"type": "torch.nn.modules.linear.Linear", "option": "fp8"},
    ]
    loaded = PolicyMap.load(path)
    assert loaded == pmap and loaded.activations == pmap.activations
    assert PolicyMap.from_config(PolicyMap("32-true", activations="bf16").to_config()) == (
        PolicyMap("32-true", activations="bf16")
    )
    assert "activations" not in PolicyMap("32-true").to_config()  # old files stay as they were
    assert "activations={'[12]': 'checkpoint', torch.nn.modules.linear.Linear: 'fp8'}" in (
        pmap.to_code()
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "'activations' is null"),
        (8, "'activations' is the number 8"),
        ([{"path": "1"}], "activation rule 0 is an object"),
        ([{"path": "1", "option": "fp8", "extra": 1}], "activation rule 0 is an object"),
        ([{"path": 1, "option": "fp8"}], "activation rule 0 'path' is the number 1"),
        ([{"type": "torch.nn.Nope", "option": "fp8"}], "cannot import module type"),
        ([{"type": "torch.Tensor", "option": "fp8"}], "not an nn.Module subclass"),
        ([{"path": "1", "option": "fp8"}, {"path": "1", "option": "bf16"}], "repeats the rule"),
        ([{"path": "1", "option": "fp9"}], "unknown activation option 'fp9'"),
    ],
)
def test_a_policy_file_with_bad_activations_is_refused_naming_the_file(tmp_path, value, message):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"default": "32-true", "activations": value}))
    with pytest.raises(PolicySpecError, match=message):
        PolicyMap.load(path)


def test_a_path_rule_matching_no_module_warns_with_the_closest_paths():
    said = r"activation rule\(s\) '1\.fcc' \(closest: '1\.fc'"
    with pytest.warns(UserWarning, match=said) as caught:
        mixprec.apply(net(), PolicyMap("32-true", activations={"1.fcc": "fp8"}))
    assert caught[0].filename == __file__  # said of the caller's line
    with pytest.warns(UserWarning, match=said):
        mixprec.Precision("32-true", activations={"1.fcc": "fp8"}).setup(net())


def test_reapplying_replaces_the_wrappers_and_remove_takes_them_off():
    model = mixprec.apply(net(), PolicyMap("32-true", activations={"1": "fp8"}))
    assert wrapped(model) == {"1": "fp8"}
    mixprec.apply(model, PolicyMap("32-true", activations={"2": "checkpoint"}))
    assert wrapped(model) == {"2": "checkpoint"}
    mixprec.apply(model, "32-true")
    assert wrapped(model) == {}
    mixprec.apply(model, PolicyMap("32-true", activations="bf16"))
    mixprec.remove(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_explain_shows_each_layers_option_and_saved_bytes_at_a_batch():
    model = net()
    pmap = PolicyMap("32-true", activations={"1": "checkpoint", "2": "fp8"})
    shown = mixprec.explain(model, pmap, batch=torch.randn(64, 8))
    assert shown.activations["1.fc"] == ("checkpoint", "recomputed with '1'")
    assert shown.activations["2"] == ("fp8", "path rule '2'")
    saved = shown.saved_bytes
    # float32 activations of 64 x 16: 4 KiB each. A recomputed block holds its input only
    assert saved["1"] == 64 * 16 * 4 and saved["1.fc"] == saved["1.act"] == 0
    assert saved["0"] == 0  # its input is the batch: alive without the graph
    # each Linear's input and GELU's: 1024 codes and a float32 scale a block
    assert saved["2.fc"] == saved["2.act"] == saved["2.out"] == 64 * 16 + 4 * 64 * 16 // FP8.block
    assert saved["3"] == 64 * 16 * 4  # the head's input, kept as it is
    text = str(shown)
    assert "checkpoint (recomputed with '1')" in text and "activations" in text
    assert model.__dict__.get("forward") is None  # explained on a copy


def test_explain_under_a_true_policy_counts_the_batch_as_a_step_hands_it_over():
    """Under bf16-true, `explain(batch=...)` ran the float32 batch and counted the first
    layer's bfloat16 copy of it, which a step (`Precision.convert_input`) never makes."""
    model = net()
    x = torch.randn(64, 8)
    shown = mixprec.explain(model, "bf16-true", batch=x)
    precision = mixprec.Precision("bf16-true", allow_slow=True)
    stepped = precision.setup(net())
    from mixprec.activations import saved_bytes

    assert shown.saved_bytes == saved_bytes(stepped, precision.convert_input(x))
    assert shown.saved_bytes["0"] == 0  # the converted batch: alive without the graph


def test_a_refused_re_apply_leaves_the_previous_activation_options_in_place():
    """Before: a re-apply refused by the quantization (the model itself a Linear) put the
    previous regions back but not the activation wrappers: the model stopped storing its
    activations in fp8 while its applied policy still said fp8."""
    model = mixprec.apply(nn.Linear(64, 64), mixprec.PolicyMap("32-true", activations="fp8"))
    with pytest.raises(ValueError, match="quantize swaps submodules"):
        mixprec.apply(model, mixprec.PolicyMap("int8_from_mixed_bfloat16", activations="fp8"))
    assert wrapped(model) == {"": "fp8"}
    seen = []
    x = torch.randn(8, 64, requires_grad=True) * 1.0  # (an activation: not a leaf)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        model(x).sum()
    assert not [t for t in seen if t.dtype == torch.float32 and t.numel() == x.numel()]


def test_an_activation_type_rule_for_a_class_imported_twice_is_warned_of():
    """A type rule naming another class of the same name as the model's modules' (a script
    loaded under two module names) matched nothing and no option was put on, silently; it
    is warned of, as a policy type rule is; a type the model lacks, in a warning of its own."""
    twin = type("Linear", (nn.Module,), {"__module__": "elsewhere"})
    lacking = type("Gone", (nn.Module,), {"__module__": "elsewhere"})
    pmap = mixprec.PolicyMap("32-true", activations={twin: "checkpoint", lacking: "bf16"})
    with pytest.warns(UserWarning, match=r"activation type rules match no module.*elsewhere\.Lin"):
        with pytest.warns(UserWarning, match=r"activation rule\(s\) Gone match no module"):
            mixprec.apply(nn.Sequential(nn.Linear(2, 2)), pmap)


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 64), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = self.drop(self.fc(x))
        return h if scale is None else h * scale


def test_explain_measures_in_training_mode_and_leaves_the_models_mode():
    """`explain(batch=...)` measured in the model's own mode: a model in eval mode (as
    `from_pretrained` leaves it) saved no dropout mask, so the bytes a step holds were
    under-counted. It measures a training forward, and the model stays in eval mode."""
    x = torch.randn(4, 8)
    model = _Dropped().eval()
    shown = mixprec.explain(model, "32-true", batch=x)
    trained = mixprec.explain(_Dropped().train(), "32-true", batch=x)
    assert shown.saved_bytes == trained.saved_bytes
    assert shown.saved_bytes["drop"] > 0  # (dropout's mask)
    assert not model.training and not any(m.training for m in model.modules())


def test_explain_passes_a_mapping_batch_as_keyword_arguments():
    """A mapping batch (a Hugging Face batch) went in as one positional argument and failed
    deep in the model; it is passed as keyword arguments, cast under a "true" policy as a
    tuple batch is."""
    x, scale = torch.randn(4, 8), torch.full((4, 64), 2.0)
    for policy in ("32-true", "bf16-true"):
        by_name = mixprec.explain(_Dropped(), policy, batch={"x": x, "scale": scale})
        by_place = mixprec.explain(_Dropped(), policy, batch=(x, scale))
        assert by_name.saved_bytes == by_place.saved_bytes
        assert sum(by_name.saved_bytes.values()) > 0


class _TakesABatch(nn.Module):
    """A forward taking its batch whole: ``forward(batch)`` with a mapping."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 64)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(batch["x"]).relu()


def test_explain_passes_a_mapping_whole_to_a_forward_not_taking_its_keys():
    """A mapping batch went in as keyword arguments to every forward: one taking the batch
    whole (``forward(self, batch)``) failed with an unexpected keyword."""
    x = torch.randn(4, 8)
    by_name = mixprec.explain(_TakesABatch(), "32-true", batch={"x": x})
    assert sum(by_name.saved_bytes.values()) > 0


def test_a_type_rule_matching_no_module_warns():
    """A type rule for a class the model lacks was dropped silently (a path rule warns)."""
    pmap = PolicyMap("32-true", activations={nn.Conv2d: "fp8"})
    with pytest.warns(UserWarning, match=r"activation rule\(s\) Conv2d match no module"):
        mixprec.apply(net(), pmap)


def test_a_rule_inside_a_recomputed_module_warns():
    """A rule whose every module runs inside a recomputed module was dropped silently: its
    modules are recomputed with the parent."""
    pmap = PolicyMap("32-true", activations={"1": "checkpoint", r"1\.fc": "fp8"})
    said = r"rule\(s\) '1\\\\.fc': 'fp8' \(recomputed with '1'\) take no effect"
    with pytest.warns(UserWarning, match=said):
        mixprec.apply(net(), pmap)


def test_a_type_rule_taking_effect_somewhere_does_not_warn(recwarn):
    """A type rule matching modules inside and outside a recomputed module takes effect."""
    mixprec.apply(net(), PolicyMap("32-true", activations={"1": "checkpoint", nn.Linear: "fp8"}))
    assert not [w for w in recwarn if "activation rule" in str(w.message)]


class _Stacks(nn.Module):
    """A ModuleList whose first block holds a BatchNorm, and a ModuleDict holding a GRU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))]
            + [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)]
        )
        self.rnns = nn.ModuleDict({"r": nn.GRU(8, 8), "l": nn.Linear(8, 8)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.rnns["l"](self.rnns["r"](x)[0])


@pytest.mark.parametrize(
    "spec, expected",
    [
        (
            {"layers": "checkpoint", "layers.0": "keep"},
            {"layers.1": "checkpoint", "layers.2": "checkpoint"},
        ),
        (
            {"layers": "checkpoint", "layers.0": "fp8"},
            {"layers.0": "fp8", "layers.1": "checkpoint", "layers.2": "checkpoint"},
        ),
        (
            {"rnns": "selective", "rnns.r": "checkpoint"},
            {"rnns.r": "checkpoint", "rnns.l": "selective"},
        ),
    ],
)
def test_a_rule_on_a_container_is_checked_on_the_children_that_carry_it(spec, expected):
    """Found by a review: a rule on a ModuleList or ModuleDict was refused for the BatchNorm
    or RNN of a child given another option: the container is never called, its children
    carry the rule and are checked on their own."""
    for model in (
        mixprec.Precision("32-true", activations=spec).setup(_Stacks()),
        mixprec.apply(_Stacks(), PolicyMap("32-true", activations=spec)),
    ):
        assert wrapped(model) == expected
        model(torch.randn(4, 8)).sum().backward()


@pytest.mark.parametrize(
    "spec, refused",
    [
        ({"layers": "checkpoint"}, "'layers.0' (Sequential)"),
        ({"layers": "keep", "layers.0": "checkpoint"}, "'layers.0' (Sequential)"),
        ({"rnns": "selective"}, "'rnns.r' (GRU)"),
    ],
)
def test_a_child_of_a_container_holding_the_batchnorm_is_still_refused(spec, refused):
    """The children of a container that recompute a BatchNorm (or keep a GRU's matmul
    outputs) are refused, by their own paths."""
    with pytest.raises(PolicySpecError, match=re.escape(f"module {refused} cannot take")):
        mixprec.Precision("32-true", activations=spec).setup(_Stacks())
    with pytest.raises(PolicySpecError, match=re.escape(f"module {refused} cannot take")):
        mixprec.apply(_Stacks(), PolicyMap("32-true", activations=spec))


class _ConvNeXtish(nn.Module):
    """A convolution's output with an offset, permuted to channels-last for a LayerNorm over
    its channels, as ConvNeXt's blocks do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.norm, self.out = nn.Conv2d(16, 16, 1), nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm((self.conv(x) + 30.0).permute(0, 2, 3, 1)))


@pytest.mark.parametrize("option, most", [("bf16", 1e-2), ("fp8", 6e-2)])
def test_a_layer_norm_on_a_permuted_input_is_stored_centred(option, most):
    """Found by a review: a LayerNorm's input permuted to channels-last (ConvNeXt's), not
    contiguous, was stored as the codec stores it, not centred: with an offset of 30 its
    gradients were 3x keep's size off under fp8 (10% under bf16), against about 2.5% for a
    contiguous input. It is handed to the norm contiguous (its kernels copy it so anyway)
    and centred; the forward's values are keep's, bit for bit."""
    x = torch.randn(4, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    grads, outs = {}, {}
    for name in ("keep", option):
        model = mixprec.Precision("32-true", activations=name).setup(_ConvNeXtish())
        given = x.clone().requires_grad_()
        outs[name] = model(given)
        outs[name].square().mean().backward()
        grads[name] = [given.grad, *(p.grad for p in model.parameters())]
    assert torch.equal(outs[option], outs["keep"])
    for kept, stored in zip(grads["keep"], grads[option], strict=True):
        assert float((stored - kept).norm() / kept.norm()) < most


def test_a_permuted_input_the_codec_keeps_is_not_copied():
    """Found by a diff review: under ``bf16`` a 16-bit model's permuted layer-norm input is
    kept as it is, and the contiguous copy was saved beside the memory the permuted view
    shares with another save: 49% more than keep. No copy is made there."""

    class Both(nn.Module):  # (the norm's input also saved by a GELU)
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv1d(16, 16, 1), nn.LayerNorm(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.conv(x) + 30.0
            return F.gelu(h).sum() + self.norm(h.transpose(1, 2)).square().sum()

    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    saved = {}
    for name in ("keep", "bf16"):
        torch.manual_seed(0)
        model = mixprec.Precision("bf16-true", activations=name, allow_slow=True).setup(Both())
        saved[name] = sum(saved_bytes(model, x.bfloat16().requires_grad_()).values())
    assert saved["bf16"] == saved["keep"]
