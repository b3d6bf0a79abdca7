"""Low-bit optimizer states where precision is set: `Precision(optimizer_states=...)`, the
Trainer's ``optimizer_states=`` (resumed bit-identically from its checkpoints, under DDP and
FSDP2 too), a PolicyMap's ``states`` rules (policy files, `explain`)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from spawning import WORLD, run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import SILENT

import mixprec
from mixprec import PolicyMap, Precision
from mixprec.cli import main
from mixprec.doctor import state_errors
from mixprec.errors import PolicySpecError
from mixprec.optim.states import LowBitAdamW, LowBitSGD, StateFormat, assign_formats, state_bytes
from mixprec.plan import BudgetError, search
from mixprec.policy.explanation import explain
from mixprec.trainer import ModelCheckpoint, Trainer, TrainingModule
from mixprec.trainer.checkpoint import CheckpointError


class StatesNet(TrainingModule):
    """An embedding table, a Linear big enough for low-bit states (64 x 128), small ones, a
    LayerNorm, dropout, AdamW under a step schedule."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(64, 128)
        self.body = nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 64), nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x).mean(1)))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (96, 5), generator=g)
    return DataLoader(TensorDataset(x, x[:, 0] % 3), batch_size=8, shuffle=True)


def _step(precision: Precision, model: StatesNet, opt: Any, batch: Any) -> None:
    opt.zero_grad()
    precision.backward(model.training_step(batch, 0))
    precision.step()


# -- Precision ------------------------------------------------------------------------------


def test_precision_converts_adamw_into_int8_states_per_parameter() -> None:
    model = StatesNet()
    precision = Precision("32-true", optimizer_states="int8")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert isinstance(opt.optimizer, LowBitAdamW)
    assert len(opt.param_groups) == 1  # float32 choices are made per parameter, not by groups
    assert "optimizer_states='int8'" in repr(precision)
    _step(precision, model, opt, next(iter(loader())))
    state = opt.optimizer.state
    fc = state[model.body[1].weight]
    assert fc["format"] == "int8"
    assert fc["exp_avg_codes"].dtype == torch.uint8 and fc["exp_avg_codes"].numel() == 8192
    assert state[model.embed.weight]["format"] == "float32"  # an embedding table
    assert state[model.head.weight]["format"] == "float32"  # 192 elements: small
    # exactly: two int8 moments of the Linear (codes + one float32 scale per 256), float32
    # moments of everything else
    small = sum(p.numel() for n, p in model.named_parameters() if n != "body.1.weight")
    assert state_bytes(opt.optimizer) == 2 * (8192 + 4 * 32) + 2 * 4 * small


def test_the_optimizer_given_to_setup_still_names_its_wrapper() -> None:
    model = StatesNet()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precision = Precision("32-true", optimizer_states="int4")
    model, opt = precision.setup(model, sgd)
    assert isinstance(opt.optimizer, LowBitSGD) and precision.converted(sgd) is opt.optimizer
    opt.zero_grad()
    precision.backward(model.training_step(next(iter(loader())), 0))
    assert precision.step(sgd)  # the optimizer as given steps through its conversion
    assert opt.optimizer.state[model.body[1].weight]["format"] == "int4"
    assert precision.setup(model, sgd)[1] is opt  # setting up twice changes nothing


def test_compensation_goes_to_the_converted_optimizer_of_16_bit_weights() -> None:
    model = nn.Sequential(nn.Linear(128, 64))
    precision = Precision(
        "bf16-true", optimizer_states="int8", compensation="kahan", allow_slow=True
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*round away")  # it compensates itself
        model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert opt.compensation is None and opt.optimizer.compensation == "kahan"
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    precision.backward(model(x).float().square().mean())
    precision.step()
    state = opt.optimizer.state[model[0].weight]
    assert state["format"] == "int8" and state["compensation"].dtype == torch.bfloat16


def test_unsupported_optimizers_and_formats_are_refused() -> None:
    model = StatesNet()
    with pytest.raises(TypeError, match=r"AdamW, Adam and SGD.*got RMSprop"):
        Precision("32-true", optimizer_states="int8").setup(
            model, torch.optim.RMSprop(model.parameters())
        )
    with pytest.raises(ValueError, match="amsgrad"):
        Precision("32-true", optimizer_states="int8").setup(
            model, torch.optim.AdamW(model.parameters(), amsgrad=True)
        )
    with pytest.raises(ValueError, match=r"unknown state format 'int9'"):
        Precision("32-true", optimizer_states="int9")
    with pytest.raises(ValueError, match="give the format once"):
        Precision(PolicyMap("32-true", states="int4"), optimizer_states="int8")


def test_a_scheduler_built_before_setup_drives_the_converted_optimizer() -> None:
    model = StatesNet()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)
    precision = Precision("32-true", optimizer_states="int8")
    model, opt = precision.setup(model, adamw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()"
        for batch in list(loader())[:2]:
            _step(precision, model, opt, batch)
            sched.step()
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 1e-2 * 0.5**2
    # the torch optimizer's own step would train float32 moments nothing reads
    with pytest.raises(RuntimeError, match=r"AdamW was converted into LowBitAdamW.*int8"):
        adamw.step()


def test_the_converted_optimizer_follows_its_scheduler_after_either_is_loaded() -> None:
    """A caller restoring the torch optimizer it holds (Lightning on resume), or the
    converted one (Hugging Face's and Accelerate's resumes, through the LossScaleOptimizer),
    gave that optimizer groups of its own: the scheduler built on the torch one then set
    groups the stepping one does not read, which kept the resume's learning rate for the
    rest of the run. Loaded settings now go into the groups both hold."""
    model = StatesNet()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)
    precision = Precision("32-true", optimizer_states="int8")
    model, opt = precision.setup(model, adamw)
    batches = list(loader())[:3]
    _step(precision, model, opt, batches[0])
    sched.step()
    saved = copy.deepcopy(adamw.state_dict())
    saved["param_groups"][0]["lr"] = 3e-3  # (what a checkpoint of that moment held)
    adamw.load_state_dict(saved)
    assert adamw.param_groups is opt.param_groups and opt.param_groups[0]["lr"] == 3e-3
    for batch in batches[1:]:
        _step(precision, model, opt, batch)
        sched.step()
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 3e-3 * 0.5**2
    # and a load into the optimizer that steps (a Hugging Face or Accelerate resume): torch's
    # loader gave it groups of its own, and the scheduler on the torch one set nothing used
    opt.load_state_dict(opt.state_dict())
    assert adamw.param_groups is opt.param_groups
    sched.step()
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 3e-3 * 0.5**3


def test_a_low_bit_optimizer_of_another_format_is_refused_as_a_maps_is() -> None:
    from mixprec.optim.states import AdamW4bit, AdamW8bit

    model = StatesNet()
    with pytest.raises(ValueError, match=r"optimizer_states='int8'.*AdamW4bit.*'int4'.*once"):
        Precision("32-true", optimizer_states="int8").setup(model, AdamW4bit(model.parameters()))
    with pytest.raises(ValueError, match=r"map's states say 'int4'.*AdamW8bit.*'int8'"):
        Precision(PolicyMap("32-true", states="int4")).setup(model, AdamW8bit(model.parameters()))
    # the same format, or no format given: taken as it is
    opt = AdamW8bit(model.parameters())
    assert Precision("32-true", optimizer_states="int8").setup(model, opt)[1].optimizer is opt


def test_a_low_bit_optimizer_the_maps_state_rules_disagree_with_is_refused() -> None:
    """Per-module rules cannot reach a low-bit optimizer taken as it is: where they give a
    parameter another format than it keeps, setup says which, instead of ignoring them."""
    from mixprec.optim.states import AdamW8bit, from_model

    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
    pmap = PolicyMap("32-true", states={"2": "int4"})
    with pytest.raises(ValueError, match=r"2\.weight keeps int8 where the map says int4"):
        Precision(pmap).setup(model, AdamW8bit(model.parameters()))
    # built by the same rules, it agrees and is taken as it is
    agreed = from_model(model, states="int8", rules={r"2\..*": "int4"})  # parameter names
    assert Precision(pmap).setup(model, agreed)[1].optimizer is agreed


@pytest.mark.parametrize(
    ("spec", "masters"), [("16-true", None), ("bf16-true", True)], ids=["16-true", "bf16-masters"]
)
def test_a_state_rule_reaches_the_float32_master_of_its_parameter(spec, masters) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
    pmap = PolicyMap(spec, states={"2": "int4"})
    precision = Precision(pmap, optimizer_states="int8", master_weights=masters, allow_slow=True)
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    precision.backward(model(precision.convert_input(torch.randn(4, 64))).float().square().mean())
    precision.step()
    assert len(opt.master_params) == 4
    state = opt.optimizer.state
    formats = {n: state[opt.master_params[p]]["format"] for n, p in model.named_parameters()}
    assert formats == {
        "0.weight": "int8",
        "0.bias": "float32",
        "2.weight": "int4",
        "2.bias": "float32",
    }
    said = explain(model, pmap, optimizer_states="int8").states
    assert {n: fmt for n, (fmt, _) in said.items()} == formats  # explain says what ran
    assert mixprec.explain(model, pmap, optimizer_states="int8").states == said


# -- PolicyMap ------------------------------------------------------------------------------


def test_a_policy_map_state_rule_gives_a_layer_its_own_format(tmp_path: Path) -> None:
    pmap = PolicyMap("32-true", states={"body\\.1": "int4", "embed": "int8"})
    loaded = PolicyMap.load(pmap.save(tmp_path / "policy.json"))
    assert loaded == pmap and loaded.states == {"body\\.1": "int4", "embed": "int8"}
    model = StatesNet()
    precision = Precision(loaded, optimizer_states="fp8")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _step(precision, model, opt, next(iter(loader())))
    formats = {n: opt.optimizer.state[p]["format"] for n, p in model.named_parameters()}
    assert formats["body.1.weight"] == "int4"  # the rule
    assert formats["embed.weight"] == "int8"  # a rule outranks the embedding's float32
    assert formats["body.1.bias"] == formats["head.weight"] == "float32"  # small
    # explain names each parameter's format and why
    why = explain(model, loaded).states
    assert why["body.1.weight"] == ("int4", "state rule 'body\\\\.1'")
    assert why["body.1.bias"] == ("float32", "small: 64 < 4096 elements")
    assert "optimizer states" in str(explain(model, loaded))
    assert PolicyMap("32-true", states="int8").state_formats(model)["embed.weight"] == (
        StateFormat("float32"),
        "embedding",
    )
    assert "states={'body\\\\.1': 'int4', 'embed': 'int8'}" in pmap.to_code()


def test_a_policy_maps_single_format_converts_without_splitting_groups() -> None:
    model = StatesNet()
    precision = Precision(PolicyMap("32-true", states="int4"))
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["states"] == "int4"
    _step(precision, model, opt, next(iter(loader())))
    assert opt.optimizer.state[model.body[1].weight]["format"] == "int4"
    assert opt.optimizer.state[model.embed.weight]["format"] == "float32"


def test_state_rules_matching_nothing_warn_as_policy_rules_do() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
    written_as_a_parameter = PolicyMap("32-true", states={"2.weight": "int4"})
    said = r"state rule '2\.weight' matches no module.*module paths.*name its module, '2'"
    with pytest.warns(UserWarning, match=said):
        Precision(written_as_a_parameter, optimizer_states="int8").setup(
            model, torch.optim.AdamW(model.parameters())
        )
    with pytest.warns(UserWarning, match=r"state rule 'haed' matches no module.*closest: 'head'"):
        explain(StatesNet(), PolicyMap("32-true", states={"haed": "int4"}))
    with pytest.warns(UserWarning, match=r"'body' has no parameters of its own: 'body\\\..\*'"):
        explain(StatesNet(), PolicyMap("32-true", states={"body": "int4"}))
    rules = {"body.2.weight": "int4"}
    with pytest.warns(UserWarning, match=r"matches no trainable parameter.*'body\.1\.weight'"):
        assign_formats(StatesNet(), "int8", rules=rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rules that match say nothing
        explain(model, PolicyMap("32-true", states={"2": "int4", "0|2": "int8"}))
        assign_formats(model, "int8", rules={r"2\.weight": "int4"})


def test_a_state_rule_matches_its_module_path_as_written() -> None:
    """A rule was pasted into a larger pattern on parameter names: an anchored rule
    (``head$``) matched nothing, silently (its parameters kept the default), and an inline
    flag (``(?i)``) failed at setup with a bare ``re.error``. Each is now ``re.fullmatch``'ed
    against the owning module's path, as written."""
    model = nn.Sequential()
    model.add_module("body", nn.Linear(128, 128))
    model.add_module("head", nn.Linear(128, 64))
    for rule in ("head$", "(?i)HEAD", "hea."):
        pmap = PolicyMap("32-true", states={rule: "int4", "body": "int8"})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            formats = pmap.state_formats(model)
            pmap.warn_unmatched_states(model)
        assert formats["head.weight"] == (StateFormat("int4"), f"state rule {rule!r}")
        assert formats["body.weight"] == (StateFormat("int8"), "state rule 'body'")
    precision = Precision(PolicyMap("32-true", states={"(?i)HEAD": "int4"}), optimizer_states="fp8")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with precision.forward_context():
        loss = model(torch.randn(4, 128)).square().mean()
    precision.backward(loss)
    precision.step(opt)
    assert opt.optimizer.state[model.head.weight]["format"] == "int4"
    assert opt.optimizer.state[model.body.weight]["format"] == "float8"


def test_a_state_rule_for_the_roots_own_parameters_is_not_called_a_typo() -> None:
    """Found by a review: the doctor's own suggestion for a parameter of the model itself,
    ``{"": "float32"}``, applied but was warned of as matching no module."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(64, 64))
            self.lin = nn.Linear(64, 64)

    pmap = PolicyMap("32-true", states={"": "float32"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pmap.warn_unmatched_states(Scaled())
    assert pmap.state_formats(Scaled(), "int8")["scale"][1] == "state rule ''"
    with pytest.warns(UserWarning, match="state rule '' matches no module"):
        pmap.warn_unmatched_states(nn.Sequential(nn.Linear(4, 4)))


def test_bad_state_rules_are_refused_naming_the_rule() -> None:
    with pytest.raises(PolicySpecError, match=r"state rule 'head'.*unknown state format"):
        PolicyMap("32-true", states={"head": "int3"})
    with pytest.raises(PolicySpecError, match=r"state rule '\(' is not a valid regex"):
        PolicyMap("32-true", states={"(": "int8"})
    with pytest.raises(PolicySpecError, match="'states' is null"):
        PolicyMap.from_config({"default": "32-true", "states": None})


# -- Trainer --------------------------------------------------------------------------------


def _trainer(root: Path, steps: int, **kwargs: Any) -> Trainer:
    return Trainer(
        precision="32-true", optimizer_states="int8", max_steps=steps, seed=3,
        deterministic=True, default_root_dir=root, **SILENT, **kwargs,
    )  # fmt: skip


def test_the_trainer_switch_trains_low_bit_states_and_resumes_them_bit_identically(tmp_path):
    straight = StatesNet()
    t_straight = _trainer(tmp_path / "a", 10)
    t_straight.fit(straight, loader())
    opt = t_straight.optimizers[0]
    assert isinstance(opt.optimizer, LowBitAdamW)
    assert opt.optimizer.state[straight.body[1].weight]["format"] == "int8"
    assert opt.param_groups[0]["lr"] == 3e-3 * 0.5**3  # the schedule drove the converted one

    t_first = _trainer(tmp_path / "b", 5)
    t_first.fit(StatesNet(), loader())
    path = t_first.save_checkpoint(tmp_path / "half.ckpt")
    resumed = StatesNet(seed=9)
    t_resumed = _trainer(tmp_path / "c", 10)
    t_resumed.fit(resumed, loader(), ckpt_path=path)

    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    sa, sb = opt.optimizer.state, t_resumed.optimizers[0].optimizer.state
    for pa, pb in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert sa[pa].keys() == sb[pb].keys()
        for k, v in sa[pa].items():
            assert torch.equal(v, sb[pb][k]) if torch.is_tensor(v) else v == sb[pb][k], k


def test_a_checkpoint_resumes_in_another_state_format_announced(tmp_path):
    """int8 states resumed with optimizer_states="int4", a float32 AdamW's with "int8": the
    moments are stored in the new format, said in a warning naming both, and the run goes
    on; a low-bit checkpoint resumed by a torch optimizer is refused, naming the formats."""
    first = _trainer(tmp_path / "a", 5)
    first.fit(StatesNet(), loader())
    int8 = first.save_checkpoint(tmp_path / "int8.ckpt")
    plain = Trainer(
        precision="32-true", max_steps=5, seed=3, default_root_dir=tmp_path / "b", **SILENT
    )
    plain.fit(StatesNet(), loader())
    float32 = plain.save_checkpoint(tmp_path / "float32.ckpt")
    fresh = {*LowBitAdamW(StatesNet().parameters()).param_groups[0]}

    for ckpt, was, now in ((int8, "int8", "int4"), (float32, "float32", "int8")):
        model = StatesNet(seed=9)
        saved = torch.load(ckpt, weights_only=False)["model"]["body.1.weight"]
        resumed = Trainer(
            precision="32-true", optimizer_states=now, max_steps=8, seed=3,
            default_root_dir=tmp_path / now, **SILENT,
        )  # fmt: skip
        with pytest.warns(UserWarning, match=rf"1 saved as {was}, resumed as {now} param"):
            resumed.fit(model, loader(), ckpt_path=ckpt)
        opt = resumed.optimizers[0].optimizer
        state = opt.state[model.body[1].weight]
        assert state["format"] == now and state["step"].item() == 8  # three steps more
        assert not torch.equal(model.body[1].weight.detach(), saved)
        # (the scheduler's key; a group converted from torch's AdamW keeps its form of decay)
        keys = {*opt.param_groups[0]} - {"initial_lr", "decoupled_weight_decay"}
        assert keys == fresh
        assert opt.param_groups[0].get("decoupled_weight_decay", True) is True
        assert opt.param_groups[0]["states"] == now

    back = Trainer(precision="32-true", max_steps=8, default_root_dir=tmp_path / "c", **SILENT)
    with pytest.raises(CheckpointError, match=r"int8 .*\(LowBitAdamW\).*optimizer_states='int8'"):
        back.fit(StatesNet(), loader(), ckpt_path=int8)
    # formats set per parameter by a map's states rules: those rules, not one
    # optimizer_states (which stored the int8 moments again in float32, and said the
    # checkpoint held float32 ones)
    ruled = Trainer(
        precision=PolicyMap("32-true", states={r"body\.1": "int8"}), max_steps=2,
        default_root_dir=tmp_path / "r", **SILENT,
    )  # fmt: skip
    ruled.fit(StatesNet(), loader())
    ruled.save_checkpoint(tmp_path / "ruled.ckpt")
    back = Trainer(precision="32-true", max_steps=4, default_root_dir=tmp_path / "d", **SILENT)
    with pytest.raises(
        CheckpointError, match=r"float32 \(per parameter: .*1 in int8\).*states rules"
    ):
        back.fit(StatesNet(), loader(), ckpt_path=tmp_path / "ruled.ckpt")


def test_float16_weights_step_int8_states_through_their_float32_masters(tmp_path):
    model = StatesNet()
    trainer = Trainer(
        precision="16-true", optimizer_states="int8", max_steps=4, allow_slow_precision=True,
        default_root_dir=tmp_path, **SILENT,
    )  # fmt: skip
    trainer.fit(model, loader())
    opt = trainer.optimizers[0]
    assert len(opt.master_params) == len(list(model.parameters()))  # every weight: float16
    master = opt.master_params[model.body[1].weight]
    assert master.dtype == torch.float32
    assert opt.optimizer.state[master]["format"] == "int8"
    # the embedding's master keeps float32 moments, as the embedding would
    assert opt.optimizer.state[opt.master_params[model.embed.weight]]["format"] == "float32"
    assert opt.param_groups[0]["lr"] == 3e-3 * 0.5  # the schedule drove it: 4 steps, 3 a halving


def test_a_scheduler_drives_a_group_whose_parameters_take_two_formats(tmp_path):
    """A state rule gives one layer int4 inside the group the default int8 fills: the group
    stays whole (formats are held per parameter), so the scheduler built on the torch
    optimizer drives the converted one."""
    pmap = PolicyMap("32-true", states={"body\\.1": "int4"})
    trainer = Trainer(
        precision=pmap, optimizer_states="int8", max_steps=3, default_root_dir=tmp_path, **SILENT
    )
    model = StatesNet()
    trainer.fit(model, loader())
    opt = trainer.optimizers[0].optimizer
    assert len(opt.param_groups) == 1
    formats = {n: opt.state[p]["format"] for n, p in model.named_parameters() if p in opt.state}
    assert formats["body.1.weight"] == "int4"
    assert opt.param_groups[0]["lr"] == pytest.approx(1.5e-3)  # StepLR halved it at step 3
    given = Precision("32-true", optimizer_states="int4")
    with pytest.raises(ValueError, match="configured Precision as it is"):
        Trainer(precision=given, optimizer_states="int8", **SILENT)


# -- DDP and FSDP2 --------------------------------------------------------------------------


class Wide(TrainingModule):
    """A 128 x 128 Linear: each FSDP shard (64 rows) still has low-bit states."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Linear(6, 128), nn.GELU(), nn.Linear(128, 128))
        self.head = nn.Linear(128, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.blocks(x)))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def wide_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (64,), generator=g)), batch_size=8)


def _distributed_fit(strategy: str, steps: int, out: Path, **fit: Any) -> dict[str, Any]:
    every_3 = ModelCheckpoint(dirpath=out.parent / f"{out.stem}-ckpt", every_n_train_steps=3)
    trainer = Trainer(
        precision="32-true", optimizer_states="int8", strategy=strategy, devices=WORLD,
        max_steps=steps, seed=0, callbacks=[every_3], **SILENT,
    )  # fmt: skip
    model = Wide()
    trainer.fit(model, wide_loader(), **fit)
    trainer.save_full_state_dict(out)
    inner = trainer.optimizers[0].optimizer
    state = inner.state[model.blocks[2].weight]
    codes = state["exp_avg_codes"]
    return {
        "optimizer": type(inner).__name__,
        "format": state["format"],
        "codes": getattr(codes, "_local_tensor", codes).clone(),
    }


def _worker(rank: int, out: str) -> None:
    d = Path(out)
    results = {
        "ddp": _distributed_fit("ddp", 6, d / "ddp.pt"),
        "fsdp": _distributed_fit("fsdp", 6, d / "fsdp.pt"),
        "fsdp_half": _distributed_fit("fsdp", 3, d / "half.pt"),
    }
    checkpoint = d / "half-ckpt" / "epoch=0-step=3.ckpt"
    results["fsdp_resumed"] = _distributed_fit("fsdp", 6, d / "resumed.pt", ckpt_path=checkpoint)
    torch.save(results, d / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out: Path = tmp_path_factory.mktemp("states")
    run_ranks(_worker, str(out), nprocs=WORLD)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.slow
def test_ddp_ranks_keep_identical_int8_states(runs):
    _, ranks = runs
    for r in ranks:
        assert r["ddp"]["optimizer"] == "LowBitAdamW" and r["ddp"]["format"] == "int8"
    assert torch.equal(ranks[0]["ddp"]["codes"], ranks[1]["ddp"]["codes"])


@pytest.mark.slow
def test_fsdp_shards_int8_states_and_resumes_its_dcp_checkpoint_bit_identically(runs):
    out, ranks = runs
    for r in ranks:
        assert r["fsdp"]["format"] == "int8"
        assert torch.equal(r["fsdp"]["codes"], r["fsdp_resumed"]["codes"])
    # each rank holds its own shard's codes: 64 rows x 128, padded to whole blocks
    assert ranks[0]["fsdp"]["codes"].numel() == 64 * 128
    assert not torch.equal(ranks[0]["fsdp"]["codes"], ranks[1]["fsdp"]["codes"])
    straight = torch.load(out / "fsdp.pt", weights_only=True)
    resumed = torch.load(out / "resumed.pt", weights_only=True)
    start = Wide().state_dict()
    assert any(not torch.equal(straight[k], start[k]) for k in start)  # it trained
    for k, v in straight.items():
        assert torch.equal(v, resumed[k]), k
    # and DDP's run, the same steps on the whole tensors, ends close to FSDP's
    ddp = torch.load(out / "ddp.pt", weights_only=True)
    for k, v in ddp.items():
        torch.testing.assert_close(v, straight[k], rtol=0, atol=2e-2)


# -- the doctor -----------------------------------------------------------------------------


class TwoBranches(nn.Module):
    """``flat``'s gradient is the same number everywhere (its moments store exactly in any
    format); ``rough``'s varies as random inputs do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.flat = nn.Linear(64, 64, bias=False)
        self.rough = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flat(torch.ones_like(x)).sum() + self.rough(x).square().sum()


def test_the_doctor_names_the_layer_whose_states_int4_hurts() -> None:
    batches = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = TwoBranches()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = state_errors(model, batches, states="int4", steps=3)
    assert [r.param for r in report.hurting] == ["rough.weight"]
    flat = next(r for r in report.rows if r.param == "flat.weight")
    assert flat.first == flat.second == 0.0  # equal values are a block's exact maximum
    assert report.states_rules() == {"rough": "float32"}
    assert "rough.weight  int4" in str(report) and "HURT" in str(report)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    # int8 keeps both within the threshold; the rule, applied, keeps rough's moments float32
    assert state_errors(model, batches, states="int8").hurting == []
    fixed = PolicyMap("32-true", states=report.states_rules())
    assert fixed.state_formats(model, "int4")["rough.weight"][0] == StateFormat("float32")
    with pytest.raises(ValueError, match="at least one batch"):
        state_errors(model, [], states="int8")


# -- the search -----------------------------------------------------------------------------


def test_a_training_search_chooses_state_formats_and_its_policy_file_carries_them(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
    batches = [(torch.randn(16, 64), torch.randn(16, 64)) for _ in range(2)]
    common = dict(formats=["32-true"], baseline="32-true", count="training", reps=1)
    # float32 weights with float32 AdamW states: 16 bytes a weight, over a 0.7 budget
    with pytest.raises(BudgetError):
        search(model, batches, F.mse_loss, budget={"memory": 0.7}, **common)
    report = search(model, batches, F.mse_loss, budget={"memory": 0.7}, states="int8", **common)
    assert report.policy.states == {"0": "int8", "2": "int8"}  # one format, not its letters
    int8 = StateFormat("int8")
    # weights, gradients and int8 moments of the two big weights; float32 ones of the biases
    expected = sum(8 * 8192 + 2 * int8.bytes(8192) + 16 * b for b in (128, 64))
    assert report.measured["plan"].unit_bytes == expected
    assert report.measured["baseline"].unit_bytes == 16 * sum(p.numel() for p in model.parameters())
    loaded = PolicyMap.load(report.policy.save(tmp_path / "plan.json"))
    assert loaded.states == {"0": "int8", "2": "int8"}
    with pytest.raises(ValueError, match="count='training'"):
        search(model, batches, F.mse_loss, budget={"memory": 0.7}, states=["int8"])
    as_format = search(model, batches, F.mse_loss, budget={"memory": 0.7}, states=int8, **common)
    assert as_format.policy.states == report.policy.states


FACTORY = """
import torch
from torch import nn


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.flat = nn.Linear(64, 64, bias=False)
        self.rough = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.flat(torch.ones_like(x)).sum() + self.rough(x).square().sum()


def make():
    return TwoBranches(), torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
"""


def test_mixprec_doctor_states_names_the_hurt_layer_and_exits_1(tmp_path, capsys) -> None:
    path = tmp_path / "factory.py"
    path.write_text(FACTORY)
    args = ["doctor", f"{path}:make", "--precision", "32-true", "--no-report"]
    assert main([*args, "--states", "int4"]) == 1
    out = capsys.readouterr().out
    assert "rough.weight  int4" in out and "HURT" in out
    assert "states={'rough': 'float32'}" in out
    assert main([*args, "--states", "int8"]) == 0  # the diagnosis passes, no layer hurt
    assert main([*args, "--states", "int9"]) == 2
    assert "--states: unknown state format 'int9'" in capsys.readouterr().err


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 64))


def _train(precision: Precision, model: nn.Module, opt: Any, steps: int) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        precision.backward(model(x).square().mean())
        precision.step(opt)


def test_the_torch_optimizer_handed_over_saves_loads_and_grows_the_converted_one():
    """A loop that holds on to the torch optimizer it gave setup saved its empty state (the
    converted optimizer's moments and counts lost), loaded a state into that torch
    optimizer's own state silently, and added groups without the ``"states"`` the step reads
    (a bare KeyError at the next step). It stands for the converted optimizer in each."""
    precision = Precision("32-true", optimizer_states="int8")
    model = _net()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = precision.setup(model, torch_opt)
    _train(precision, model, opt, 3)
    saved = copy.deepcopy(torch_opt.state_dict())
    assert len(saved["state"]) == 4 and "exp_avg_codes" in saved["state"][2]
    weights = copy.deepcopy(model.state_dict())
    _train(precision, model, opt, 2)
    after = [p.detach().clone() for p in model.parameters()]

    again = Precision("32-true", optimizer_states="int8")
    model2 = _net()
    torch_opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2, opt2 = again.setup(model2, torch_opt2)
    model2.load_state_dict(weights)
    torch_opt2.load_state_dict(saved)
    assert float(opt2.optimizer.state[next(model2.parameters())]["step"]) == 3.0
    _train(again, model2, opt2, 2)
    assert all(torch.equal(p, q) for p, q in zip(model2.parameters(), after, strict=True))

    extra = nn.Parameter(torch.randn(64, 64))
    torch_opt2.add_param_group({"params": [extra], "lr": 1e-3})
    assert opt2.param_groups[-1]["states"] == "int8" and opt2.param_groups[-1]["lr"] == 1e-3
    extra.grad = torch.randn(64, 64)
    opt2.optimizer.step()
    assert "exp_avg_codes" in opt2.optimizer.state[extra]


def test_a_second_setup_of_a_converted_optimizer_keeps_its_moments():
    """A torch optimizer converted before (a second fit, a setup after reset()) was
    converted again from its empty state: moments and counts started afresh (5 -> 5 where
    5 -> 10). It stands for the low-bit one it became."""
    precision = Precision("32-true", optimizer_states="int8")
    model = _net()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = precision.setup(model, torch_opt)
    _train(precision, model, opt, 5)
    precision.reset()
    model, opt = precision.setup(model, torch_opt)
    _train(precision, model, opt, 5)
    assert float(opt.optimizer.state[next(model.parameters())]["step"]) == 10.0


def test_parameters_frozen_at_setup_take_the_maps_formats_when_unfrozen():
    """Formats were given to the trainable parameters only: a layer frozen at setup and
    unfrozen later took the default low-bit format where a state rule (or the embedding
    rule) keeps it float32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 128), nn.Linear(128, 64))
    for p in [*model[0].parameters(), *model[2].parameters()]:
        p.requires_grad_(False)
    policy = PolicyMap("32-true", states={"2": "float32"})
    precision = Precision(policy, optimizer_states="int4")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for p in model.parameters():
        p.requires_grad_(True)
    x = torch.randint(0, 256, (4, 8))
    precision.backward(model(x).square().mean())
    precision.step(opt)
    formats = {n: opt.optimizer.state[p]["format"] for n, p in model.named_parameters()}
    assert formats["0.weight"] == "float32" and formats["2.weight"] == "float32"
    assert formats["1.weight"] == "int4"


def test_a_torch_state_loads_through_the_wrapper_into_low_bit_states():
    """The wrapper refused a torch AdamW state for its LowBitAdamW ("saved from another
    optimizer class"), which that optimizer loads (quantized) and the Trainer resumes."""
    plain = Precision("32-true")
    model = _net()
    model, opt = plain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(plain, model, opt, 3)
    low = Precision("32-true", optimizer_states="int8")
    model2 = _net()
    model2, opt2 = low.setup(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2))
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    state = opt2.optimizer.state[next(model2.parameters())]
    assert state["format"] == "int8" and float(state["step"]) == 3.0


def test_float16_kahan_with_low_bit_states_compensates_instead_of_masters():
    """Under 16-true, compensation="kahan" with optimizer_states gave float32 masters and no
    Kahan buffer (the compensation asked for never ran), where bf16-true or 16-true without
    optimizer_states gave Kahan buffers and no masters."""
    precision = Precision(
        "16-true", compensation="kahan", optimizer_states="int8", scaler=1.0, allow_slow=True
    )
    model = _net()
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randn(16, 32, dtype=torch.float16)
    precision.backward(model(x).float().square().mean())
    precision.step(opt)
    assert len(opt.master_params) == 0
    assert all("compensation" in opt.optimizer.state[p] for p in model.parameters())


def test_a_wrapper_of_a_torch_optimizer_with_optimizer_states_is_refused():
    """setup kept a LossScaleOptimizer of a torch AdamW as it was under
    optimizer_states="int8": float32 states, four times the bytes, no word."""
    precision = Precision("32-true", optimizer_states="int8")
    model = _net()
    wrapped = mixprec.LossScaleOptimizer(torch.optim.AdamW(model.parameters()), precision.scaler)
    with pytest.raises(ValueError, match="pass the plain optimizer to setup"):
        precision.setup(model, wrapped)


def test_explain_shows_the_block_a_run_cuts_to_the_parameter():
    """A block larger than a parameter is cut to the parameter's size rounded up to the
    kind's default block; `explain` showed the block as given, not what the run records."""
    model = _net()
    shown = explain(model, PolicyMap("32-true"), optimizer_states="int8/block=65536").states
    precision = Precision("32-true", optimizer_states="int8/block=65536")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(precision, model, opt, 1)
    for name, p in model.named_parameters():
        assert str(shown[name][0]) == opt.optimizer.state[p]["format"]
    assert str(shown["0.weight"][0]) == "int8/block=4096"


def test_keep_float32_still_picks_a_parameter_once_it_has_a_float32_master() -> None:
    """Masters are other tensors than the ones ``keep_float32`` was written about: asked of
    the master it answered False, and the embedding got int8 moments, without a word."""
    model = nn.Sequential(nn.Embedding(512, 16), nn.Linear(16, 512)).half()
    emb, head = model[0].weight, model[1].weight
    opt = LowBitAdamW(
        model.parameters(), min_size=0, keep_float32=lambda p: p is emb, formats={head: "int4"}
    )
    wrapped = mixprec.optim.LossScaleOptimizer(opt, scaler="none")
    wrapped.backward(model(torch.arange(4)).float().square().mean())
    wrapped.step()
    formats = [opt.state[p]["format"] for g in opt.param_groups for p in g["params"]]
    assert formats == ["float32", "int4", "int8"]
