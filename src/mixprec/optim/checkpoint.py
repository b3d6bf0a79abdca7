"""The checkpoint half of `mixprec.optim.LossScaleOptimizer`: its ``state_dict``, the loads
that check everything before changing anything, and ``load_state_dict_across_precisions``.

``state_dict`` keys the masters by the optimizer's parameter index (torch's own key for
optimizer state) and records the parameters' names and shapes, so a load is validated up
front and ``master_weights_by_name`` can hand the masters to a run in another precision;
``load_state_dict_across_precisions`` restores an optimizer from such a checkpoint.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.optim.compensated import Compensator
from mixprec.optim.masters import MasterWeights, check_positions, saved_compensation
from mixprec.optim.scaling import LossScaler
from mixprec.optim.states import LowBitOptimizer

__all__ = []

# per-parameter state buffers of torch's optimizers that have the parameter's shape
_PARAM_SHAPED_STATE = (
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "momentum_buffer",
    "compensation",
    "square_avg",
    "sum",
)

# the keys of a LossScaleOptimizer.state_dict() that a load needs
_STATE_KEYS = ("optimizer", "scaler", "master_weights", "param_shapes", "param_names")

# the name components torch's wrappers insert anywhere in parameter names (torch.compile's,
# FSDP's, activation checkpointing's): a model saved with or without them is the same model
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


class OptimizerCheckpoint:
    """What a `LossScaleOptimizer` saves and restores (its base class): the wrapped
    optimizer's state, the scaler's, the float32 masters by parameter index, each
    parameter's shape and names, and the compensation's state."""

    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    model: nn.Module | None
    _masters: MasterWeights
    _compensator: Compensator | None

    def _all_params(self) -> Iterator[torch.Tensor]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def model_param(self, tensor: torch.Tensor) -> torch.Tensor:
        """The model parameter a tensor of ``param_groups`` stands for (itself, unless it is
        a master)."""
        return self._masters.param_of.get(tensor, tensor)

    def _compensation_kind(self) -> str | None:
        """How the 16-bit parameters' updates are compensated: by the wrapper's
        `Compensator`, or by a low-bit optimizer's own (whose Kahan buffers are its states'
        ``"compensation"``, as the Compensator's are); None without."""
        if self._compensator is not None:
            return self._compensator.kind
        if isinstance(self.optimizer, LowBitOptimizer):
            return self.optimizer.compensation
        return None

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state (with Kahan buffers), the scaler's state, the float32 master
        weights by parameter index, each parameter's shape and names (by index, as in the
        optimizer's state), and the compensation's kind and seed (the wrapper's, or a
        low-bit optimizer's own, whose Kahan buffers a load or `master_weights_by_name`
        treats as the wrapper's). The masters first take what was written into their
        parameters since the last step (a model state loaded, an edit), as the next step
        would: saved stale, a resume copied the old masters over the loaded model."""
        self._masters.follow_edits()
        params = list(self._all_params())
        compensation = None
        if self._compensator is not None:
            compensation = self._compensator.state_dict()
        elif self._compensation_kind() is not None:
            compensation = {"kind": self._compensation_kind(), "seed": self.optimizer.seed}
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "master_weights": self._masters.by_index(params),
            "param_shapes": [list(self.model_param(p).shape) for p in params],
            "param_names": self._param_names(),
            "compensation": compensation,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict``; the model's low-precision parameters are refreshed from
        the restored masters, so the run continues exactly where it was saved.

        A plain torch optimizer state (``optimizer.state_dict()``) is accepted too: it goes
        to the wrapped optimizer, the masters are refreshed from the model's parameters and
        the scaler is left as it is. Everything is checked before anything is changed. A
        state saved under another precision goes to ``load_state_dict_across_precisions``.
        """
        self.check_state_dict(state)
        state = self._in_this_order(state)
        if "optimizer" not in state and {"state", "param_groups"} <= state.keys():
            self._load_inner(state)
            self._keep_saved_dtypes(state)
            self._masters.refresh_from_model()
            return
        if isinstance(state["master_weights"], Mapping):
            # (a parameter frozen at setup has its master made at its first step: one made
            # since the wrapper was built has none yet)
            self._masters.add(self.optimizer, state["master_weights"])
        masters = self._masters.check_saved(
            state["master_weights"],
            list(self._all_params()),
            self._describe,
            stepped=state["optimizer"]["state"],
        )
        compensation = state.get("compensation")
        self.scaler.load_state_dict(state["scaler"])  # checks its state before changing it
        self._load_inner(state["optimizer"])
        self._keep_saved_dtypes(state["optimizer"])
        if self._compensator is not None and compensation is not None:
            self._compensator.load_state_dict(compensation)
        self._masters.load(masters)

    def _keep_saved_dtypes_on_direct_loads(self) -> None:
        """Hook the wrapped torch optimizer's ``load_state_dict`` so that a state loaded into
        it directly (as Lightning restores optimizers, after the plugin) keeps the floating
        dtypes it was saved in, as `load_state_dict` does: torch's load casts float32
        moments of 16-bit weights to the weights' dtype, and what the cast lost (second
        moments under float16's range become 0) would stay lost."""
        owner = weakref.ref(self)
        loading: list[Mapping[str, Any]] = []

        def before(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
            loading[:] = [state]  # (one load at a time; a failed one's is replaced)

        def after(optimizer: torch.optim.Optimizer) -> None:
            saved = loading.pop() if loading else None
            wrapper = owner()
            if (
                wrapper is not None
                and saved is not None
                and wrapper.optimizer is optimizer
                and not wrapper.retired  # (a newer wrapper steps it: its own rules)
                and not getattr(wrapper, "_own_load", False)  # (its loads choose themselves)
            ):
                wrapper._keep_saved_dtypes(saved)

        self.optimizer.register_load_state_dict_pre_hook(before)
        self.optimizer.register_load_state_dict_post_hook(after)

    @property
    def retired(self) -> bool:
        """Whether a newer wrapper of the same optimizer took over (False here)."""
        return False

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy's torch optimizer has no hooks (torch's pickle drops them): hooked again."""
        self.__dict__.update(state)
        if "_seen_state" not in state:  # (pickled before loads were counted)
            self._taken_since_load, self._seen_state = None, None
        if self._compensator is not None:
            self._keep_saved_dtypes_on_direct_loads()

    def _load_inner(self, state: Mapping[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict``, without the direct-load hook (the
        caller decides which dtypes the state keeps)."""
        self._own_load = True
        try:
            self.optimizer.load_state_dict(dict(state))
        finally:
            self._own_load = False

    def _keep_saved_dtypes(self, saved: Mapping[str, Any]) -> None:
        """With compensation, put back the state tensors saved in another floating dtype
        than their parameter's (float32 moments beside 16-bit weights), which torch's load
        cast to the parameter's dtype: the compensated step keeps them in float32, so the
        resumed run is the one that never stopped; and step counts saved in float64 (past
        2^24, where float32 holds no longer every integer), which torch's fused optimizers
        load as float32."""
        if self._compensator is None:
            return
        index = [i for g in saved["param_groups"] for i in g["params"]]
        for p, key in zip(self._all_params(), index, strict=True):
            loaded = self.optimizer.state.get(p, {})
            for name, value in saved["state"].get(key, {}).items():
                if (
                    torch.is_tensor(value)
                    and value.is_floating_point()
                    and (name in _PARAM_SHAPED_STATE or (name == "step" and value.itemsize == 8))
                    and torch.is_tensor(loaded.get(name))
                    and loaded[name].dtype != value.dtype
                ):
                    loaded[name] = value.to(loaded[name].device, copy=True)

    def _widen_float16_moments(self, saved: Mapping[str, Any]) -> None:
        """With compensation, the moments of float16 parameters from their saved values in
        float32, as the compensated step keeps them (`Compensator._prepared`), not as torch's
        load cast them to float16 (second moments under its range became 0)."""
        if self._compensator is None:
            return
        index = [i for g in saved["param_groups"] for i in g["params"]]
        for p, key in zip(self._all_params(), index, strict=True):
            if p.dtype != torch.float16:
                continue
            loaded = self.optimizer.state.get(p, {})
            for name, value in saved["state"].get(key, {}).items():
                if name in ("exp_avg", "exp_avg_sq") and torch.is_tensor(loaded.get(name)):
                    loaded[name] = value.to(p.device, torch.float32, copy=True)

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise, changing nothing, what `load_state_dict` refuses in ``state`` (its keys;
        its parameters: their number per group, their shapes; the optimizer class that saved
        it; its compensation (its kind, and the entry the Compensator's load refuses), masters
        and scaler state; its parameters' names, where both sides know them), for a caller
        that loads other things first (a Trainer's resume, the weights)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"an optimizer state is a dict, got {type(state).__name__}")
        state = self._in_this_order(state)
        if "optimizer" not in state and {"state", "param_groups"} <= state.keys():
            self._check_inner_state(state, None)
            return
        self._check_keys(state)
        self._check_inner_state(state["optimizer"], state["param_shapes"])
        self._check_compensation(state)
        self._check_masters(state)
        self.scaler.check_state_dict(state["scaler"])

    def loads_directly(self, state: Mapping[str, Any]) -> bool:
        """Whether `load_state_dict` takes ``state`` (a `state_dict` of this precision) as it
        is: the same compensation and masters for the same parameters; else it goes to
        `load_state_dict_across_precisions`, as one saved under another precision does."""
        if "optimizer" not in state or self.compensation_differs(state):
            return "optimizer" not in state
        try:
            self._check_masters(self._in_this_order(state))
        except ValueError:
            return False
        return True

    def _check_masters(self, state: Mapping[str, Any]) -> None:
        saved = state["master_weights"]
        here = (
            self._masters.positions_after_add(self.optimizer, saved)
            if isinstance(saved, Mapping)
            else set()
        )
        check_positions(saved, here, stepped=state["optimizer"]["state"])

    def check_state_dict_across_precisions(self, state: Mapping[str, Any]) -> None:
        """Raise, changing nothing, what `load_state_dict_across_precisions` refuses in
        ``state`` before it changes anything (its keys, its parameters)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"an optimizer state is a dict, got {type(state).__name__}")
        self._check_keys(state)
        state = self._in_this_order(state)
        self._check_inner_state(state["optimizer"], state["param_shapes"])

    def compensation_differs(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` (a `state_dict`) was saved with a compensation this optimizer
        cannot take over as it is: another kind, or Kahan buffers (the wrapper's or a
        low-bit optimizer's own) where it keeps none."""
        kind = saved_compensation(state) if "optimizer" in state else None
        mine = self._compensation_kind()
        return kind is not None and kind != mine and (mine is not None or kind == "kahan")

    def _check_compensation(self, state: Mapping[str, Any]) -> None:
        if self.compensation_differs(state):
            raise ValueError(
                f"the checkpoint was trained with compensation {saved_compensation(state)!r}, "
                f"this optimizer uses {self._compensation_kind()!r}: load it with "
                "load_state_dict_across_precisions(state, weights), which folds the saved "
                "Kahan buffers into the weights (mixprec.optim.master_weights_by_name)"
            )
        saved = state.get("compensation")
        if self._compensator is not None and saved is not None:
            # (what `load_state_dict` hands the Compensator after loading the rest)
            self._compensator.check_state_dict(saved)

    def load_state_dict_across_precisions(
        self, state: Mapping[str, Any], weights: Mapping[str, torch.Tensor]
    ) -> None:
        """Restore a ``state_dict`` saved under another precision policy (or master_weights
        setting): the wrapped optimizer's state, which torch casts to this optimizer's
        tensors, and the masters from ``weights`` (parameter name -> full-precision weight:
        the model's state with ``master_weights_by_name(state, model_state)`` over it, so
        that the checkpoint's float32 masters, not its 16-bit weights, are used); the model's
        parameters follow their masters. The scaler and the compensation are left as they
        are (their kinds may differ), and the saved Kahan buffers are dropped: ``weights``
        holds them folded into the weights (`master_weights_by_name`), and a buffer kept
        would add them again or go stale. Everything is checked before anything is changed.
        """
        self.check_state_dict_across_precisions(state)
        state = self._in_this_order(state)  # (the masters come by name from ``weights``)
        params = list(self._all_params())
        masters = self._masters.by_name(weights, params, self._param_names(), self._describe)
        self._load_inner(state["optimizer"])  # (cast to this run's dtypes, but ...)
        self._widen_float16_moments(state["optimizer"])
        for inner in self.optimizer.state.values():
            inner.pop("compensation", None)
        self._masters.load(masters)

    def _param_names(self) -> list[list[str]]:
        """Names of each parameter (by index; shared parameters have several), from the
        model when known, else from the groups' ``param_names`` (torch >= 2.6)."""
        if self.model is not None:
            names: dict[torch.Tensor, list[str]] = {}
            for name, p in self.model.named_parameters(remove_duplicate=False):
                names.setdefault(p, []).append(name)
            return [names.get(self.model_param(p), []) for p in self._all_params()]
        out: list[list[str]] = []
        for group in self.optimizer.param_groups:
            given = group.get("param_names")
            out.extend([[n] for n in given] if given else [[] for _ in group["params"]])
        return out

    def _in_this_order(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state`` (a `state_dict`, or a torch optimizer's whose groups hold
        ``param_names``) with its parameters in this optimizer's order, matched by name
        where both sides know every parameter's names (`_by_name`: a wrapper's prefix
        aside), as the model's own load matches them: its optimizer state (each group's
        settings with the parameters saved in it), masters, shapes and names. A refactor
        that reordered same-shaped fields or listed the groups otherwise would else trade
        their states, and the masters copied over the weights the model's load restored.
        Names unknown on a side: ``state`` as it is (by position, as before)."""
        wrapped = "optimizer" in state
        inner = state.get("optimizer") if wrapped else state
        if not _well_formed(inner):
            return state  # (refused with why by the checks)
        groups = inner["param_groups"]
        index = [key for g in groups for key in g["params"]]
        saved_names = state.get("param_names") if wrapped else _group_names(groups)
        if not _names_list(saved_names) or len(saved_names) != len(index):
            return state
        perm = _by_name(saved_names, self._param_names())
        if perm is None or perm == list(range(len(index))):
            return state
        here = self.optimizer.param_groups
        if len(here) != len(groups):
            return state  # (refused as another set of groups)
        group_of = [h for h, g in enumerate(groups) for _ in g["params"]]
        local = [i for g in groups for i in range(len(g["params"]))]
        new_groups, start = [], 0
        for g, group in enumerate(here):
            positions = list(range(start, start + len(group["params"])))
            start += len(positions)
            sources = sorted({group_of[perm[i]] for i in positions}) or [g]
            for h in sources[1:]:
                _refuse_mixed(g, groups, sources[0], h, positions, perm, group_of, saved_names)
            first = groups[sources[0]]
            new = {k: v for k, v in first.items() if k != "param_names"}
            new["params"] = positions
            if "param_names" in first:  # (torch's load keeps the saved ones: this one's)
                new["param_names"] = group.get("param_names") or [
                    groups[group_of[perm[i]]]["param_names"][local[perm[i]]] for i in positions
                ]
            new_groups.append(new)
        moved = {
            i: inner["state"][index[j]] for i, j in enumerate(perm) if index[j] in inner["state"]
        }
        # (state of no parameter: torch's load keeps it as it is)
        known = set(index) | moved.keys()
        kept = {k: v for k, v in inner["state"].items() if k not in known}
        inner = {**inner, "state": {**moved, **kept}, "param_groups": new_groups}
        if not wrapped:
            return inner
        masters, shapes = state.get("master_weights"), state.get("param_shapes")
        out = {**state, "optimizer": inner, "param_names": [saved_names[j] for j in perm]}
        if isinstance(masters, Mapping):
            out["master_weights"] = {i: masters[j] for i, j in enumerate(perm) if j in masters}
        if isinstance(shapes, list) and len(shapes) == len(perm):
            out["param_shapes"] = [shapes[j] for j in perm]
        return out

    def _describe(self, index: int) -> str:
        names = self._param_names()[index]
        return f"parameter {index}" + (f" ({names[0]})" if names else "")

    def _check_keys(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"not a LossScaleOptimizer state: missing {missing} (keys: {sorted(state)}). "
                f"Pass the dict from LossScaleOptimizer.state_dict() or from a torch "
                f"optimizer's state_dict()"
            )

    def _check_inner_state(self, saved: Any, shapes: Any) -> None:
        """Refuse, before loading, an optimizer state saved for other parameters."""
        if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= saved.keys():
            raise ValueError("the saved optimizer state lacks 'state' and 'param_groups'")
        low_bit = any(
            isinstance(s, Mapping) and any(str(k).endswith("_codes") for k in s)
            for s in saved["state"].values()
        )
        if low_bit and not hasattr(self.optimizer, "to_float32_state_dict"):
            raise ValueError(
                f"the saved optimizer state is a low-bit optimizer's (mixprec.optim.states: "
                f"moments as codes and scales), which {type(self.optimizer).__name__} cannot load: "
                f"load it into the low-bit optimizer that saved it, or give this one that "
                f"optimizer's to_float32_state_dict() (float32 moments, as torch keeps them)"
            )
        groups = self.optimizer.param_groups
        # another optimizer class's groups hold settings this one lacks and lack some of its
        # own (SGD's momentum beside AdamW's betas); another torch version only adds or drops.
        # A low-bit optimizer checks its own: it loads its torch counterpart's state too
        ours = set().union(*(g.keys() for g in groups))
        theirs = set().union(*(g.keys() for g in saved["param_groups"]))
        converts = hasattr(self.optimizer, "to_float32_state_dict")
        if theirs - ours and ours - theirs and not converts:
            name = type(self.optimizer).__name__
            raise ValueError(
                f"the saved optimizer state's parameter groups hold {sorted(theirs - ours)}, "
                f"which this {name}'s lack, and lack its {sorted(ours - theirs)}: it was saved "
                f"from another optimizer class; load it into the class that saved it"
            )
        sizes = [len(g["params"]) for g in groups]
        saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
        if sizes != saved_sizes:
            raise ValueError(
                f"the saved optimizer has parameter groups of sizes {saved_sizes}, this one "
                f"{sizes}: it was saved for another model or another set of parameter groups"
            )
        params = [self.model_param(p) for p in self._all_params()]
        if shapes is not None:
            for i, (p, shape) in enumerate(zip(params, shapes, strict=True)):
                if list(p.shape) != list(shape):
                    raise ValueError(
                        f"{self._describe(i)} has shape {list(p.shape)}, the checkpoint's "
                        f"{list(shape)}: this optimizer state belongs to another model"
                    )
        index = [i for g in saved["param_groups"] for i in g["params"]]
        for i, key in enumerate(index):
            for name, value in saved["state"].get(key, {}).items():
                if name in _PARAM_SHAPED_STATE and torch.is_tensor(value):
                    if value.shape != params[i].shape:
                        raise ValueError(
                            f"{self._describe(i)} has shape {list(params[i].shape)}, its saved "
                            f"{name!r} {list(value.shape)}: this optimizer state belongs to "
                            f"another model"
                        )


def _well_formed(inner: Any) -> bool:
    return (
        isinstance(inner, Mapping)
        and isinstance(inner.get("state"), Mapping)
        and isinstance(inner.get("param_groups"), list)
        and all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list)
            for g in inner["param_groups"]
        )
    )


def _group_names(groups: list[Mapping[str, Any]]) -> list[list[str]] | None:
    """Each parameter's name in a torch optimizer state's groups (torch >= 2.6 saves those
    of an optimizer built from ``named_parameters()``), None where a group has none."""
    out = []
    for g in groups:
        names = g.get("param_names")
        if not isinstance(names, list) or len(names) != len(g["params"]):
            return None
        out.extend([n] for n in names)
    return out


def _names_list(names: Any) -> bool:
    """Whether ``names`` names every parameter (a list of non-empty lists of str)."""
    return isinstance(names, list) and all(
        isinstance(n, list) and n and all(isinstance(x, str) for x in n) for n in names
    )


def _unwrapped(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _common_prefix(names: set[str]) -> int:
    """The length of the longest dotted prefix every one of ``names`` starts with, leaving
    each a name of its own (DDP's ``module.``, a holder's attribute), 0 without one."""
    parts = [n.split(".") for n in names]
    if not parts:
        return 0
    depth = min(len(p) for p in parts) - 1
    k = 0
    while k < depth and len({p[k] for p in parts}) == 1:
        k += 1
    return sum(len(x) + 1 for x in parts[0][:k])


def _matched(saved: list[set[str]], here: list[set[str]]) -> list[int] | None:
    """For each parameter ``here``, the position of the saved one sharing a name with it
    (a tied parameter may be named once on one side, by each owner on the other), where
    that is one saved parameter each and each saved one is matched once; else None."""
    index: dict[str, int] = {}
    for j, names in enumerate(saved):
        for n in names:
            if index.setdefault(n, j) != j:
                return None
    perm = []
    for names in here:
        found = {index[n] for n in names if n in index}
        if len(found) != 1:
            return None
        perm.append(found.pop())
    return perm if sorted(perm) == list(range(len(saved))) else None


def _by_name(saved: list[list[str]], here: list[list[str]]) -> list[int] | None:
    """For each parameter ``here`` (its names, by position), the position of the saved one
    it shares a name with (`_matched`), or None where names are unknown (one without).
    Names that differ only by a wrapper's parts (`_WRAPPER_PARTS`, anywhere) or by a prefix
    on every name of a side (DDP's ``module.``, a holder's attribute), on one side or both,
    match without them; others are another model's: refused, naming some."""
    if not (_names_list(saved) and _names_list(here)) or any(
        len({n for names in side for n in names}) < sum(map(len, side)) for side in (saved, here)
    ):
        return None  # (a name given to two parameters: by position, as before)
    saved_bare = [{_unwrapped(n) for n in names} for names in saved]
    here_bare = [{_unwrapped(n) for n in names} for names in here]
    cut_saved = _common_prefix(set().union(*saved_bare))
    cut_here = _common_prefix(set().union(*here_bare))
    for a, b in ((0, 0), (cut_saved, 0), (0, cut_here), (cut_saved, cut_here)):
        perm = _matched(
            [{n[a:] for n in s} for s in saved_bare], [{n[b:] for n in h} for h in here_bare]
        )
        if perm is not None:
            return perm
    saved_all = {n for names in saved for n in names}
    here_all = {n for names in here for n in names}
    missing = sorted(saved_all - here_all)
    extra = sorted(here_all - saved_all)
    found = [
        f"{label}: {', '.join(names[:4])}"
        + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        for label, names in (("not in this model", missing), ("not in the checkpoint", extra))
        if names
    ] or ["the same names, shared otherwise (tied parameters)"]
    raise ValueError(
        f"the checkpoint's optimizer state was saved for other parameters than this "
        f"optimizer's ({len(saved)} there, {len(here)} here): {'; '.join(found)}. It belongs "
        "to another model: its states are restored by name (a prefix on every name of a "
        "side, as DDP's 'module.', or torch.compile's '_orig_mod.' aside). Nothing was loaded"
    )


def _same_setting(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (
            torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return a is b


def _refuse_mixed(
    g: int,
    groups: list[Mapping[str, Any]],
    h0: int,
    h: int,
    positions: list[int],
    perm: list[int],
    group_of: list[int],
    names: list[list[str]],
) -> None:
    """Refuse a restore by name putting in this optimizer's group ``g`` parameters saved in
    groups ``h0`` and ``h`` whose settings differ: one group's would go to the other's."""
    keys = sorted((set(groups[h0]) | set(groups[h])) - {"params", "param_names"})
    differ = [k for k in keys if not _same_setting(groups[h0].get(k), groups[h].get(k))]
    if not differ:
        return
    a = next(names[perm[i]][0] for i in positions if group_of[perm[i]] == h0)
    b = next(names[perm[i]][0] for i in positions if group_of[perm[i]] == h)
    raise ValueError(
        f"this optimizer's parameter group {g} holds {a}, saved in group {h0}, and {b}, saved "
        f"in group {h}, whose settings differ ({', '.join(differ)}): restored by name, one "
        f"group's settings would go to the other's parameters. Build the parameter groups as "
        f"at the save (the same parameters together). Nothing was loaded"
    )
