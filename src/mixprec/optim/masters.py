"""``MasterWeights``: the float32 master copies of an optimizer's low-precision parameters,
and their restore by parameter name, across precisions.

A ``LossScaleOptimizer`` keeps one ``MasterWeights``. It re-points the wrapped optimizer at
float32 copies of the trainable parameters of its master dtypes (float16; bfloat16 too with
``master_weights=True``), moves the model's gradients into them before a step, and copies
the stepped masters back into the model. A saved state keys the masters by the optimizer's
parameter index; `master_weights_by_name` turns that into parameter names for a model of
another precision, and ``MasterWeights.by_name`` takes such weights back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.aliasing import overlapping
from mixprec.optim.engine import COMPENSATED_DTYPES, settled, written_mark
from mixprec.optim.states import LowBitOptimizer, parse_state_format

__all__ = []

# which parameter dtypes get float32 masters, per value of `master_weights`
MASTER_DTYPES: dict[bool | None, tuple[torch.dtype, ...]] = {
    None: (torch.float16,),
    True: (torch.float16, torch.bfloat16),
    False: (),
}


def check_positions(saved: Any, here: set[int], stepped: Iterable[int] = ()) -> None:
    """Refuse saved masters (position -> tensor) that do not correspond to those kept
    ``here``: the same positions, or fewer where the missing ones were never stepped
    (``stepped``: a layer frozen when the checkpoint was saved)."""
    if isinstance(saved, Mapping) and set(saved) < here and not (here - set(saved)) & set(stepped):
        return
    if not isinstance(saved, Mapping) or set(saved) != here:
        got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(
            f"the checkpoint has float32 master weights for parameters {got}, this "
            f"optimizer keeps them for {sorted(here)}: it was saved under another "
            f"precision policy (or master_weights setting). To change precision, load "
            f"the model's state with mixprec.optim.master_weights_by_name(state, "
            f"model_state) over it, then this optimizer's with "
            f"load_state_dict_across_precisions(state, weights)"
        )


def _refuse_aliases(params: list[torch.Tensor]) -> None:
    """Refuse parameters (distinct objects) over overlapping memory: each would get a float32
    master of its own, written back in turn, so one's update would overwrite the other's."""
    found = sorted(overlapping(params))
    if found:
        shapes = ", ".join(f"{tuple(params[i].shape)} {params[i].dtype}" for i in found)
        raise ValueError(
            f"parameters over the same memory ({shapes}; as b.weight = nn.Parameter("
            "a.weight.data) ties them) cannot each have a float32 master: the masters would "
            "be written back in turn and one update lost. Tie them as one Parameter "
            "(b.weight = a.weight), or step them without masters (master_weights=False)"
        )


def _refuse_repeats(params: list[torch.Tensor], mastered: Mapping[torch.Tensor, Any]) -> None:
    """Refuse a parameter given twice, or given again beside its float32 master (a group
    added on the optimizer after setup): torch's own check cannot see it behind the master,
    and the alias check would call it tied memory."""
    ids = [id(p) for p in params]
    repeated = {id(p) for p in params if p in mastered or ids.count(id(p)) > 1}
    if repeated:
        raise ValueError(
            f"some parameters appear in more than one parameter group, or twice in one "
            f"({len(repeated)} of them), which torch.optim refuses for its own groups (a "
            "group added after setup holding parameters the optimizer steps already, through "
            "their float32 masters, is one such case): list each parameter once"
        )


class MasterWeights:
    """The float32 masters of one optimizer's parameters of ``dtypes``, each linked to the
    model parameter it stands for (``master_of``) and back (``param_of``).

    ``params`` and ``masters`` list the pairs in the order they were made, for the one-call
    (``torch._foreach_*``) copies between them."""

    def __init__(self, dtypes: tuple[torch.dtype, ...]) -> None:
        self.dtypes = dtypes
        self.params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        self.master_of: dict[torch.Tensor, torch.Tensor] = {}
        self.param_of: dict[torch.Tensor, torch.Tensor] = {}
        # after a step, a master's gradient is that step's until moved over or zeroed
        self._grads_stale = False
        # each parameter's version counter and memory when mixprec last wrote or read it
        self._seen: dict[torch.Tensor, tuple[int, int | None]] = {}

    def __len__(self) -> int:
        return len(self.masters)

    # -- creation ---------------------------------------------------------------------------

    def take_over(self, other: MasterWeights) -> None:
        """Keep the masters of an earlier wrapper of the same optimizer (its groups already
        hold them), with what it knew of them: which parameter writes the masters have seen
        (a model state loaded since is taken at the next step, not overwritten by it) and
        whether their gradients are the last step's."""
        for p, master in other.master_of.items():
            self._link(p, master)
            self._seen[p] = other._seen[p]
        self._grads_stale = other._grads_stale

    def positions_after_add(self, optimizer: torch.optim.Optimizer, saved: Iterable[int]) -> set:
        """The positions (in ``optimizer``'s order) that would hold masters after
        ``add(optimizer, saved)``, changing nothing: those mastered now and those `add`
        would give one."""
        saved = set(saved)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {i for i, p in enumerate(params) if p in self.param_of or self._takes(p, i in saved)}

    def _takes(self, p: torch.Tensor, saved: bool) -> bool:
        """Whether `add` gives ``p`` a master: trainable (or one a checkpoint holds a master
        for, ``saved``) and of a master dtype (one mastered already is float32)."""
        return p.dtype in self.dtypes and (p.requires_grad or p.grad is not None or saved)

    def add(self, optimizer: torch.optim.Optimizer, saved: Iterable[int] = ()) -> None:
        """Give every trainable parameter of a master dtype in ``optimizer``'s groups its
        float32 master, in its place there (with its state cast to float32, and a low-bit
        optimizer's state format given to the parameter given to the master). The ones already
        mastered are float32 and skipped, so this also catches groups added on the optimizer
        and parameters unfrozen after wrapping. ``saved``: positions (in the optimizer's
        order) that a checkpoint holds masters for, given theirs whether trainable now or not
        (a layer frozen at setup and unfrozen before the checkpoint was saved)."""
        saved = set(saved)
        index = -1
        taken = []  # (group, position, parameter) of each one given a master now
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                index += 1
                if self._takes(p, index in saved):
                    taken.append((params, i, p))
        if taken:
            _refuse_repeats([p for *_, p in taken], self.master_of)
            _refuse_aliases([p for *_, p in taken] + self.params)
        for params, i, p in taken:
            master = nn.Parameter(p.detach().to(torch.float32))
            params[i] = master
            if isinstance(optimizer, LowBitOptimizer):
                # a state format given to the parameter is its master's: the one stepped; so
                # is float32 where ``keep_float32`` picks it (asked of the master, a tensor
                # the caller's function never saw, it answered False)
                if optimizer.keep_float32 is not None and optimizer.keep_float32(p):
                    optimizer.formats.pop(p, None)
                    optimizer.formats[master] = parse_state_format("float32")
                elif p in optimizer.formats:
                    optimizer.formats[master] = optimizer.formats.pop(p)
            if p in optimizer.state:
                optimizer.state[master] = {
                    k: v.to(torch.float32) if torch.is_tensor(v) and v.dtype == p.dtype else v
                    for k, v in optimizer.state.pop(p).items()
                }
            self._link(p, master)

    def _link(self, p: torch.Tensor, master: torch.Tensor) -> None:
        self.params.append(p)
        self.masters.append(master)
        self.master_of[p] = master
        self.param_of[master] = p
        self._seen[p] = written_mark(p)

    def follow_edits(self) -> None:
        """Give the masters what was written into their parameters since mixprec last wrote
        them (a model state or pretrained weights loaded after setup, an init, a padding row
        zeroed): the elements the write changed take its values, the others keep their
        float32 bits. Without this the next step, which copies the masters into the model,
        would undo the write."""
        for p, m in zip(self.params, self.masters, strict=True):
            if written_mark(p) == self._seen[p]:
                continue
            with torch.no_grad():
                changed = p.ne(m.to(p.dtype))
                m.copy_(torch.where(changed, p.to(torch.float32), m))
            self._seen[p] = written_mark(p)

    def _saw_all(self) -> None:
        self._seen = {p: written_mark(p) for p in self.params}

    # -- gradients and the step -------------------------------------------------------------

    def move_grads(self) -> None:
        """Move the model parameters' gradients into their masters (as float32). The first
        move after a step drops a master's gradient whose parameter has none: it is the last
        step's (the model's own ``zero_grad`` cannot reach the masters), and stepping it again
        would update a parameter this step did not use."""
        self.follow_edits()
        drop_stale = self._grads_stale
        self._grads_stale = False
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for p, m in zip(self.params, self.masters, strict=True):
            g = p.grad
            if g is None:
                if drop_stale:
                    m.grad = None
                continue
            if m.grad is None or g.is_sparse or m.grad.is_sparse:
                m.grad = g.to(torch.float32)
            else:
                dst.append(m.grad)
                src.append(g)
            p.grad = None
        if dst:
            torch._foreach_copy_(dst, src)

    def sync(self, optimizer: torch.optim.Optimizer) -> None:
        """Move gradients into the masters, first giving a master to any parameter of a
        master dtype found with a gradient but none (a parameter of such a dtype in the
        optimizer's groups has no master). For steps that do not unscale."""
        dtypes = self.dtypes
        if dtypes:
            unmastered = False
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.dtype in dtypes and p.grad is not None:
                        unmastered = True
                        break
                if unmastered:
                    break
            if unmastered:
                self.add(optimizer)
        if self.masters:
            self.move_grads()

    def copy_to_model(self) -> None:
        """Copy the masters into their model parameters (rounding to the parameters' dtype)."""
        if self.masters:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
            self._saw_all()

    def end_step(self, stepped: bool) -> None:
        """After a step: the model follows its masters if they moved, and the masters'
        gradients are now the last step's."""
        if stepped and self.masters:
            self.copy_to_model()
        self._grads_stale = True

    def zero_model_grads(self, set_to_none: bool) -> None:
        """Clear the model parameters' gradients (the optimizer clears the masters')."""
        self._grads_stale = False  # the masters' gradients are None or zeros now
        if not self.params:
            return
        if set_to_none:
            for p in self.params:
                p.grad = None
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    # -- state ------------------------------------------------------------------------------

    def by_index(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Index in ``params`` (an optimizer's tensors, in order) -> master, for a saved state."""
        return {i: p.detach() for i, p in enumerate(params) if p in self.param_of}

    def check_saved(
        self,
        saved: Any,
        params: list[torch.Tensor],
        describe: Callable[[int], str],
        stepped: Iterable[int] = (),
    ) -> dict[torch.Tensor, torch.Tensor]:
        """Master -> its value in ``saved`` (``by_index`` of a same-precision state), after
        checking that they correspond; ``describe(index)`` names a parameter in errors. A
        master without a saved one, at a position the saved optimizer never stepped
        (``stepped``: those it holds state for; a layer frozen when it was saved), takes its
        model parameter's value, as a master made now does."""
        here = {i for i, p in enumerate(params) if p in self.param_of}
        check_positions(saved, here, stepped)
        if set(saved) < here:
            saved = {
                **saved,
                **{i: self.param_of[params[i]].detach() for i in here - set(saved)},
            }
        out = {}
        for i in sorted(here):
            if saved[i].shape != params[i].shape:
                raise ValueError(
                    f"{describe(i)}: saved master has shape {list(saved[i].shape)}, "
                    f"this one {list(params[i].shape)}"
                )
            out[params[i]] = saved[i]
        return out

    def by_name(
        self,
        weights: Mapping[str, torch.Tensor],
        params: list[torch.Tensor],
        names: list[list[str]],
        describe: Callable[[int], str],
    ) -> dict[torch.Tensor, torch.Tensor]:
        """Master -> its weight in ``weights`` (parameter name -> tensor, as a model state),
        for a restore from another precision. ``names`` holds each of ``params``'s names."""
        if not isinstance(weights, Mapping):
            raise TypeError(
                f"weights are parameter name -> tensor (a model state), got "
                f"{type(weights).__name__}"
            )
        out = {}
        for i, p in enumerate(params):
            if p not in self.param_of:
                continue
            found = [n for n in names[i] if n in weights]
            if not found:
                raise ValueError(
                    f"{describe(i)} keeps a float32 master, but the weights have no entry "
                    f"under its names {names[i]}: pass the model's state dict (with "
                    f"master_weights_by_name over it); a wrapper needs model= (Precision.setup "
                    f"passes it) or an optimizer built from model.named_parameters() to know "
                    f"its parameters' names"
                )
            value = weights[found[0]]
            if not torch.is_tensor(value) or value.shape != p.shape:
                shape = list(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(
                    f"{describe(i)} has shape {list(p.shape)}, the weight {found[0]!r} "
                    f"{shape}: these weights belong to another model"
                )
            out[p] = value
        return out

    def load(self, values: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """Set masters (``check_saved`` / ``by_name``'s keys) to their values, then their
        model parameters from them."""
        if values:
            with torch.no_grad():
                torch._foreach_copy_(list(values), [s.to(m.device) for m, s in values.items()])
                torch._foreach_copy_([self.param_of[m] for m in values], list(values))
            self._saw_all()

    def refresh_from_model(self) -> None:
        """Set every master to its model parameter (an optimizer state without masters)."""
        with torch.no_grad():
            for p, m in self.master_of.items():
                m.copy_(p)
        self._saw_all()


def master_weights_by_name(
    optimizer_state: Mapping[str, Any], model_state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Parameter name -> float32 master weight, from a checkpoint, for a restore in another
    precision.

    ``optimizer_state`` is a ``LossScaleOptimizer.state_dict()`` and ``model_state`` the
    model's ``state_dict()`` saved with it. Put the result over the model state before
    loading it into the new model (``{**model_state, **masters}``): the float32 masters,
    not the 16-bit parameters they shadow, become the new weights. A 16-bit parameter
    stepped with Kahan compensation (no master) counts its weight plus its compensation in
    float32, the value its steps track (the weight alone loses what the last roundings
    did). Shared parameters get an entry under each of their names. Raises ``ValueError``
    when a master has no name (saved by a wrapper built without ``model=`` from an
    optimizer without parameter names) or does not match the model state.
    """
    missing = [k for k in ("master_weights", "param_names") if k not in optimizer_state]
    if missing:
        raise ValueError(
            f"not a LossScaleOptimizer state: missing {missing} (keys: {sorted(optimizer_state)})"
        )
    names = optimizer_state["param_names"]
    out: dict[str, torch.Tensor] = {}
    for index, master in _full_weights(optimizer_state, model_state).items():
        if not names[index]:
            raise ValueError(
                f"the master weight of parameter {index} has no name in this checkpoint: wrap "
                f"the optimizer with LossScaleOptimizer(..., model=model) (Precision.setup does) "
                f"or build it from model.named_parameters()"
            )
        for name in names[index]:
            if name not in model_state:
                raise ValueError(f"master weight {name!r} is not in the model state")
            if model_state[name].shape != master.shape:
                raise ValueError(
                    f"master weight {name!r} has shape {list(master.shape)}, the model state "
                    f"{list(model_state[name].shape)}"
                )
            out[name] = master
    return out


def saved_compensation(optimizer_state: Mapping[str, Any]) -> str | None:
    """The compensation a ``LossScaleOptimizer.state_dict()`` was saved with (its entry's
    kind: the wrapper's, or a low-bit optimizer's own), None without one."""
    entry = optimizer_state.get("compensation")
    return entry.get("kind") if isinstance(entry, Mapping) else None


def _full_weights(
    optimizer_state: Mapping[str, Any], model_state: Mapping[str, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Parameter index -> its full-precision weight in ``optimizer_state``: its float32
    master, or (saved by a Kahan-compensated step, the wrapper's or a low-bit optimizer's)
    its weight plus the entries of its compensation the next step would keep
    (`engine.settled`: a weight written since its last step, pruned or loaded, takes no
    old weight's error)."""
    out = dict(optimizer_state["master_weights"])
    if saved_compensation(optimizer_state) != "kahan":
        return out
    names = optimizer_state["param_names"]
    for index, state in optimizer_state["optimizer"]["state"].items():
        buffer = state.get("compensation") if isinstance(state, Mapping) else None
        if index in out or not isinstance(buffer, torch.Tensor) or not names[index]:
            continue
        weight = model_state.get(names[index][0])
        if isinstance(weight, torch.Tensor) and weight.shape == buffer.shape:
            w, c = weight.float(), buffer.to(weight.device, torch.float32)
            # (the grid the step rounds to: the weight's, else the buffer's, stored in it)
            grid = next((t.dtype for t in (weight, buffer) if t.dtype in COMPENSATED_DTYPES), None)
            out[index] = w + (c if grid is None else settled(w, c, grid))
    return out
