"""The checkpoint half of the low-bit optimizers (`StateCheckpoint`, their base class): a
state dict with the engine's seed, loads that check every group and parameter before
changing anything (and take torch's Adam, AdamW and SGD state dicts, quantizing their
moments), states of another format converted to each parameter's own (`adopt`), and the
state as torch's own optimizer saves it (`to_float32_state_dict`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mixprec.optim.engine import COMPENSATED_DTYPES, check_seed
from mixprec.optim.states.formats import StateFormat, parse_state_format
from mixprec.optim.states.moments import (
    MOMENTS,
    describe,
    elements_of,
    float32_moment,
    like_saved,
    local_part,
    shards_of,
    stored_moment,
)

__all__: list[str] = []


# torch optimizer flags the low-bit step does not honour, refused wherever they arrive (a
# group, a converted torch optimizer, a loaded state dict), with why
UNSUPPORTED_FLAGS = {
    "amsgrad": "the low-bit step keeps no maximum of the second moment",
    "maximize": "the low-bit step minimizes",
    "capturable": "the low-bit step is not CUDA-graph capturable",
    "differentiable": "the low-bit step is not differentiable",
}


def refuse_flags(name: str, flags: Mapping[str, Any]) -> None:
    """Refuse the `UNSUPPORTED_FLAGS` set among ``flags`` (torch's optimizer arguments a
    low-bit step cannot honour), naming why; those left False change nothing."""
    refused = [f"{k}=True ({UNSUPPORTED_FLAGS[k]})" for k, v in flags.items() if v]
    if refused:
        raise ValueError(
            f"{name} does not support {', '.join(refused)}: use torch.optim's optimizer for it"
        )


# a group's form of Adam's weight decay (torch's key): the optimizer's own, never a state's
_DECAY_FORM = "decoupled_weight_decay"


class StateCheckpoint(torch.optim.Optimizer):
    """What a low-bit optimizer saves and restores. A subclass gives ``algorithm``,
    ``compensation``, ``seed`` and ``format_of`` (`LowBitOptimizer` does)."""

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, plus ``"seed"``: with the step counts in the state, all the
        random bits of stochastic rounding and of the Kahan buffer's rounding depend on
        (the engine's counter-based scheme: no generator state); and in each low-bit
        state ``"shards"``, the parts its blocks were cut in (`shards_of`: an FSDP2
        parameter's processes), and ``"shape"``, its parameter's, both of which a load
        checks: codes cut in 2 shards, read as one parameter's, have the right length and
        the wrong blocks, and so do the flat codes of a (32, 8) weight loaded into a (8, 32)
        one (a model whose parameters came in another order). As torch's, it holds the live
        state's tensors; a step may put new step counts in a state, so save it (or
        deepcopy it) before the next step."""
        out = super().state_dict()
        out["seed"] = self.seed
        params = [p for g in self.param_groups for p in g["params"]]
        for key, p in enumerate(params):
            entry = out["state"].get(key)
            if entry and parse_state_format(entry.get("format", "float32")).quantized:
                # (a new dict: torch's state dict holds the live state's own)
                out["state"][key] = {**entry, "shards": shards_of(p), "shape": list(p.shape)}
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a `state_dict` bit for bit, or load a torch Adam/AdamW/SGD state dict:
        its float32 moments are stored in each parameter's format (quantized on load).

        A parameter saved in another format than the one this optimizer gives it (an int8
        state loaded into `AdamW4bit`) is decoded and stored in this one's; the groups keep
        this optimizer's ``"states"`` and form of weight decay (``"decoupled_weight_decay"``,
        the class's where the group has none). Everything is checked first (the groups' settings,
        every parameter's keys, shapes, lengths and dtypes): a refused state changes
        nothing. torch's loader casts floating state to the parameter's dtype; the saved
        dtypes are put back (float32 moments and scales beside 16-bit parameters)."""
        if (
            not isinstance(state_dict, Mapping)
            or not {"state", "param_groups"} <= set(state_dict)
            or not isinstance(state_dict["state"], Mapping)
        ):
            raise ValueError(
                "an optimizer state dict holds 'state' (a dict) and 'param_groups' (from "
                "optimizer.state_dict())"
            )
        saved = dict(state_dict)
        # an empty entry is no state (reading ``optimizer.state[p]`` makes one): as torch's
        # loader takes it, the parameter starts afresh at its next step
        saved["state"] = {
            k: v for k, v in saved["state"].items() if not (isinstance(v, Mapping) and not v)
        }
        # (states saved before the engine's random bits hold a generator state instead of
        # the seed: checked and set aside, the rounding draws from no generator now)
        generator = saved.pop("generator", None)
        seed = saved.pop("seed", None)
        if seed is not None:  # (checked before anything is loaded)
            check_seed(seed)
        self._check_groups(saved["param_groups"])
        params = [p for g in self.param_groups for p in g["params"]]
        index = [i for g in saved["param_groups"] for i in g["params"]]
        for i, (p, key) in enumerate(zip(params, index, strict=True)):
            if saved["state"].get(key) is not None:
                self._check_saved(i, p, saved["state"][key])
        if generator is not None and not (
            torch.is_tensor(generator) and generator.dtype == torch.uint8
        ):
            raise ValueError(
                f"the saved 'generator' is a random generator's state (a uint8 tensor from "
                f"Generator.get_state()), got {type(generator).__name__}"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"the saved 'seed' is an int (from state_dict()), got {seed!r}")
        # each group keeps this optimizer's format and form of weight decay: a torch Adam
        # state's decoupled_weight_decay=False made an AdamW run L2 decay (torch's AdamW
        # sets it back to True on load); absent here, the class's form holds
        saved["param_groups"] = [
            {
                **{k: v for k, v in g.items() if k != _DECAY_FORM},
                "states": ours["states"],
                **({_DECAY_FORM: ours[_DECAY_FORM]} if _DECAY_FORM in ours else {}),
            }
            for g, ours in zip(saved["param_groups"], self.param_groups, strict=True)
        ]
        # (the layout, checked above, is the state dict's, not a state's)
        saved["state"] = {
            key: {k: v for k, v in entry.items() if k not in ("shards", "shape")}
            if isinstance(entry, Mapping)
            else entry
            for key, entry in saved["state"].items()
        }
        # the loaded settings go into the groups this optimizer has (torch's loader makes new
        # ones), so that whoever holds them goes on seeing them: the torch optimizer it was
        # converted from, whose scheduler sets their learning rates (`conversion.hand_over`)
        groups = self.param_groups
        super().load_state_dict(saved)
        for mine, loaded in zip(groups, self.param_groups, strict=True):
            mine.clear()
            mine.update(loaded)
        self.param_groups = groups
        for p, key in zip(params, index, strict=True):
            entry = saved["state"].get(key)
            if entry is None:
                continue
            state = self.state[p]
            for name, value in entry.items():
                if torch.is_tensor(value) and name != "step":
                    state[name] = like_saved(value, p)
                elif not torch.is_tensor(value):  # torch's loader rebuilds a string
                    state[name] = value
            self.adopt(p, state, self._group_of(p))
        if seed is not None:
            self.seed = seed

    def _check_groups(self, saved: Any) -> None:
        """Refuse saved parameter groups of another shape, or of another algorithm (an SGD
        state lacks AdamW's ``betas``) or of settings this step does not keep."""
        if not isinstance(saved, list) or not all(isinstance(g, Mapping) for g in saved):
            raise ValueError("the saved 'param_groups' is a list of dicts (from state_dict())")
        sizes = [len(g["params"]) for g in self.param_groups]
        saved_sizes = [len(g.get("params", ())) for g in saved]
        if sizes != saved_sizes:
            raise ValueError(
                f"the saved optimizer has parameter groups of sizes {saved_sizes}, this one "
                f"{sizes}: it was saved for other parameters or other parameter groups"
            )
        name = type(self).__name__
        # (torch's own loader adds "differentiable" to the defaults: not a saved setting; the
        # decay's form is the loading optimizer's own, `load_state_dict`)
        ours = set(self.defaults) - {"states", "differentiable", _DECAY_FORM}
        for i, group in enumerate(saved):
            missing = sorted(ours - set(group))
            if missing:
                extra = sorted(set(group) - ours - {"params", "param_names", "states"})
                raise ValueError(
                    f"the saved parameter group {i} lacks {missing}, which {name} needs "
                    f"(it holds {extra}): it was saved from another optimizer class; load "
                    f"it into the class that saved it (torch's SGD into LowBitSGD, AdamW "
                    f"or Adam into LowBitAdamW or LowBitAdam)"
                )
            refused = [f"{k} ({why})" for k, why in UNSUPPORTED_FLAGS.items() if group.get(k)]
            if refused:
                raise ValueError(
                    f"the saved parameter group {i} was stepped with {', '.join(refused)}, "
                    f"which {name} does not do"
                )

    def _check_saved(self, i: int, p: torch.Tensor, entry: Any) -> None:
        """Refuse the saved state ``entry`` of parameter ``i`` unless it is one this
        optimizer can step: a torch state (float32 moments of ``p``'s shape) or one of
        ours, its keys, and the lengths and dtypes of its codes and scales, as its
        ``"format"`` says."""
        where = f"parameter {i} (shape {list(p.shape)})"
        if not isinstance(entry, Mapping):
            raise ValueError(f"the saved state of {where} is a {type(entry).__name__}, not a dict")
        spec = entry.get("format")
        if spec is None:
            fmt = StateFormat("float32")  # a torch optimizer's state
        else:
            try:
                fmt = parse_state_format(spec)
            except (TypeError, ValueError) as error:
                raise ValueError(f"the saved state of {where}: {error}") from None
        keys = {"step", "format", "compensation", "shards", "shape"}
        moments = {}
        for name, _ in MOMENTS[self.algorithm]:
            moments[name] = (f"{name}_codes", f"{name}_scales") if fmt.quantized else (name,)
            keys.update(moments[name])
        extra = sorted(set(entry) - keys)
        if extra:
            raise ValueError(
                f"the saved state of {where} holds {extra}, which {type(self).__name__}'s "
                f"{fmt} states do not (they keep {sorted(keys)}): it was saved by another "
                f"optimizer or relabelled"
            )
        required = [k for names in moments.values() for k in names]
        if self.algorithm == "sgd":  # a buffer is made at the first step with momentum
            required = [] if all(entry.get(k) is None for k in required) else required
        if self.algorithm == "adam":
            required.append("step")
        missing = [k for k in required if entry.get(k) is None]
        if missing:
            raise ValueError(
                f"the saved state of {where} lacks {missing} (it holds {sorted(entry)}): "
                f"{type(self).__name__}'s {fmt} state needs {sorted(required)}"
            )
        step = entry.get("step")
        if step is not None and not (
            (torch.is_tensor(step) and step.numel() == 1)
            or (isinstance(step, int | float) and not isinstance(step, bool))
        ):
            raise ValueError(f"the saved 'step' of {where} is not a number: {step!r}")
        shape = entry.get("shape")
        if shape is not None and list(shape) != list(p.shape):
            raise ValueError(
                f"the saved state of {where} was made for a parameter of shape {list(shape)}: "
                f"it belongs to another parameter (the model's parameters come in another "
                f"order, or a layer changed shape); its {fmt} codes have the right length "
                f"but hold another layout's elements"
            )
        shards = entry.get("shards")
        if fmt.quantized and shards is not None and shards != shards_of(p):
            raise ValueError(
                f"the saved {fmt} moments of {where} were cut into blocks within each of "
                f"{shards} shards (an FSDP2 run of {shards} processes saved them), where this "
                f"optimizer cuts them in {shards_of(p)}: low-bit states load into the layout "
                f"they were saved in only (the same number of FSDP2 processes). To move them "
                f"to another, load them where they were saved and save "
                f"to_float32_state_dict(), which any layout loads (quantized on load)"
            )
        for name, names in moments.items():
            if all(entry.get(k) is None for k in names):
                continue
            if fmt.quantized:
                blocks = fmt.blocks(elements_of(p))
                code_dtype = fmt.codec.code_dtype
                expected = [
                    (names[0], (fmt.code_count(blocks * fmt.block),), code_dtype),
                    (names[1], (blocks,), torch.float32),
                ]  # type: ignore[operator]
                for key, shape, dtype in expected:
                    value = entry[key]
                    local = local_part(value) if torch.is_tensor(value) else None
                    if local is None or tuple(local.shape) != shape or local.dtype != dtype:
                        raise ValueError(
                            f"the saved {key!r} of {where} is {describe(value)}; its "
                            f"{fmt} state keeps {dtype} of shape {list(shape)}: it belongs "
                            f"to another parameter, or its format was relabelled; or (read "
                            f"through torch.distributed.checkpoint, which fills this "
                            f"optimizer's own tensors) it was saved in another format: load "
                            f"it into an optimizer of the saving format, then change the "
                            f"group's 'states'"
                        )
            else:
                value = entry[name]
                kind = "complex" if p.is_complex() else "floating"
                _check_sharded_alike(value, p, name, where)
                if (
                    not torch.is_tensor(value)
                    or tuple(value.shape) != tuple(p.shape)
                    or value.is_complex() != p.is_complex()
                    or not (value.is_complex() or value.is_floating_point())
                ):
                    raise ValueError(
                        f"the saved {name!r} of {where} is {describe(value)}; a float32 "
                        f"moment is a {kind} tensor of the parameter's shape: it belongs to "
                        f"another parameter"
                    )
        buf = entry.get("compensation")
        if buf is not None:
            _check_sharded_alike(buf, p, "compensation", where)
        if buf is not None and (not torch.is_tensor(buf) or tuple(buf.shape) != tuple(p.shape)):
            raise ValueError(
                f"the saved 'compensation' (Kahan buffer) of {where} is {describe(buf)}; it "
                f"has the parameter's shape"
            )

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def adopt(self, p: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any]) -> None:
        """Give a loaded state this optimizer's layout: the moments of a torch optimizer's
        state (float32, no format) or of another format than the one ``format_of`` gives
        ``p`` decoded and stored in that one."""
        fmt = self.format_of(p, group)
        old = parse_state_format(state["format"]) if "format" in state else None
        if "step" not in state:  # (torch's SGD keeps none)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        elif not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), dtype=_count_dtype(state["step"]))
        elif state["step"].dim() or state["step"].dtype not in (torch.float32, torch.float64):
            # (an int64 count, or one of shape [1], as torch's optimizers step them too)
            count = state["step"].detach().reshape(())
            state["step"] = count.to(_count_dtype(count.item()))
        if old != fmt:
            for name, signed in MOMENTS[self.algorithm]:
                if old is None or not old.quantized:
                    value = state.pop(name, None)
                elif f"{name}_codes" in state:
                    value = float32_moment(state, name, p, old, signed)
                    del state[f"{name}_codes"], state[f"{name}_scales"]
                else:
                    value = None
                if value is not None:
                    state.update(stored_moment(name, value, p, fmt, signed))
        state["format"] = str(fmt)
        if self.compensation == "kahan" and p.dtype in COMPENSATED_DTYPES:
            state.setdefault("compensation", torch.zeros_like(p))

    def to_float32_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as torch's optimizer of the same algorithm saves it
        (float32 ``exp_avg``/``exp_avg_sq`` or ``momentum_buffer`` of each parameter's shape,
        ``step``; no formats, codes or Kahan buffers; complex64 ones of a complex parameter,
        complex128 of a complex128 one): loadable into ``torch.optim.AdamW``
        (``Adam``, ``SGD``) of the same parameters. An Adam group says which weight decay
        its steps took (``decoupled_weight_decay``), as torch's own groups do."""
        out = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for key, p in enumerate(params):
            state = self.state.get(p)
            if not state:
                continue
            fmt = parse_state_format(state["format"])
            plain: dict[str, Any] = {"step": state["step"].clone()}
            for name, signed in MOMENTS[self.algorithm]:
                if name in state or f"{name}_codes" in state:
                    value = float32_moment(state, name, p, fmt, signed)
                    # (a complex128 parameter's in its dtype, exactly: torch's load casts
                    # only a real parameter's state, and its step needs the two to match)
                    wide = p.dtype == torch.complex128
                    plain[name] = value.to(torch.complex128) if wide else value
            out["state"][key] = plain
        for group in out["param_groups"]:
            group.pop("states", None)
            if self.algorithm == "adam":
                # the decay the steps took, written down: torch's Adam reads a missing key as
                # L2, so ``Adam(decoupled_weight_decay=True)`` would go on with another decay
                decoupled = group.get("decoupled_weight_decay", getattr(self, "decoupled", True))
                group["decoupled_weight_decay"] = bool(decoupled)
        return out


def _check_sharded_alike(value: Any, p: torch.Tensor, name: str, where: str) -> None:
    """Refuse a whole tensor saved for a parameter FSDP2 shards (or a sharded one for a
    whole parameter): it has the parameter's shape, passed the checks, and failed halfway
    through the load, the states already replaced."""
    if not torch.is_tensor(value):
        return
    sharded, saved_sharded = local_part(p) is not p, local_part(value) is not value
    if sharded != saved_sharded:
        raise ValueError(
            f"the saved {name!r} of {where} is a "
            f"{'sharded DTensor' if saved_sharded else 'whole tensor'}, where this optimizer's "
            f"parameter is {'sharded by FSDP2' if sharded else 'whole'}: load a sharded "
            f"optimizer's state through torch.distributed.checkpoint "
            f"(set_optimizer_state_dict), which hands each rank its part"
        )


def _count_dtype(count: float) -> torch.dtype:
    """The dtype a loaded step count is kept in: float32 as torch keeps counts, float64 from
    2^24 on, where float32 holds no longer every integer (the steps' counts go on in float64
    there too: `mixprec.optim.engine.StepCounts`)."""
    return torch.float64 if count >= 1 << 24 else torch.float32
