"""`diagnose`: run a model once in a reference precision and once in a target precision,
compare them module by module, and say which layers break in the target and why.

`Diagnosis.recommend` then finds the smallest per-layer policy that repairs the target run,
checking each candidate by running it, and returns it as a `Recommendation`.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.doctor.probe import Recording
from mixprec.doctor.rules import judge
from mixprec.doctor.running import Session, grad_amax
from mixprec.doctor.verdicts import (
    AT_RISK,
    BROKEN,
    DEFAULT_LOSS_SCALE,
    DEFAULT_TOLERANCE,
    OK,
    QUANTIZED_TOLERANCE,
    FindingKind,
    ModuleReport,
    ParamReport,
    UpdateModel,
    largest_loss_scale,
    loss_scale_for,
    module_reports,
    param_reports,
    range_dtype,
    scale_text,
    vanishing_by_module,
)
from mixprec.dtypes import format_info
from mixprec.errors import PolicySpecError, PrecisionError
from mixprec.hardware import (
    FAST,
    SUPPORTED,
    detect,
    device_of,
    dtype_support,
    parse_device,
    resolve_policy,
)
from mixprec.optim.scaling import LossScaler
from mixprec.policy import Policy, QuantizedPolicy
from mixprec.policy.map import PolicyMap, as_map
from mixprec.tree import map_tensors

__all__ = ["Diagnosis", "Recommendation", "ReferenceRunError", "diagnose"]


class ReferenceRunError(ValueError):
    """The reference run itself gives a non-finite loss, or inf/NaN gradients with a finite
    loss: the problem is the model's or the data's, not the precision's, and `diagnose`
    refuses to blame the target for it."""


# how many last layers `recommend` tries when no module is at risk and the run misses
_OUTPUT_TRIES = 3
# modules `_upstream` looks at above a module broken in float32 (moving at most one)
_UPSTREAM_TRIES = 8
# a forward agrees with the reference when its errors are at most this many units of the
# reference dtype's rounding (an op order that differs, not a lower precision)
_AGREE_ULPS = 4


class Diagnosis:
    """What changed between the reference run and the target run, module by module.

    `modules` (execution order) and `params` hold the statistics; `findings` lists the
    modules judged "at risk" or "broken", worst first. Prints as a rich table; `to_markdown`
    and `save` write a report. Keeps the reference run's tensors so that `recommend` can
    verify its candidates.
    """

    def __init__(
        self,
        session: Session,
        precision: PolicyMap,
        reference: PolicyMap,
        ref: Recording,
        target: Recording,
        loss_scale: float,
        recommended_loss_scale: float,
    ) -> None:
        values, params = target.rows()
        self.precision = precision
        self.reference = reference
        self.device = session.device
        self.dtype = range_dtype(precision)
        self.loss = ref.loss
        self.target_loss = target.loss
        self.loss_scale = loss_scale
        self.recommended_loss_scale = recommended_loss_scale
        self.params: dict[str, ParamReport] = param_reports(target, params)
        self.modules, origins = module_reports(target, values, self.params)
        for name, res in precision.resolve(session.model).items():
            if res.quantized and name in self.modules:
                self.modules[name].quantized = res.policy.name
        self.update = session.update
        if self.update is not None:
            grads = {n: g.value for n, g in ref.param_grads.items() if g is not None}
            vanishing = vanishing_by_module(session.model, target.trained, grads, self.update)
            for name, share in vanishing.items():
                if name in self.modules:
                    self.modules[name].vanishing = share
        judge(
            self.modules,
            origins,
            loss_scale,
            recommended_loss_scale,
            self.dtype,
            self.update,
            loss_finite=math.isfinite(self.target_loss),
            grads_finite=self.finite,
            loss_dtype=target.loss_dtype,
            loss=self.target_loss,
            reference_loss=self.loss,
        )
        ref_sq = sum(row.ref_sq for row in params.values())
        err_sq = sum(row.err_sq for row in params.values())
        nonfinite = sum(p.nonfinite for p in self.params.values())
        self.grad_rel_error = (
            (math.inf if nonfinite or (err_sq and not ref_sq) else math.sqrt(err_sq / ref_sq))
            if ref_sq or err_sq or nonfinite
            else 0.0
        )
        self._session = session
        self._ref = ref
        # where no loss scale was given: the scale a dynamic scaler starts this batch at,
        # which `recommend`'s runs at the default scale start from too (see `_scaled_run`)
        self._start: float | None = None
        self._shared: list[list[str]] | None = None  # (`_sharing`)
        self._tied: list[tuple[list[tuple[str, str]], bool]] = []
        # the modules whose output each module took as an input, in the order it took them
        # (a tensor is keyed by where it was first seen: a child's output its parent hands
        # on is the child's)
        self._producers: dict[str, list[str]] = {}
        for call in target.calls:
            found = self._producers.setdefault(call.name, [])
            for name, _, kind, _ in call.inputs:
                if kind == "out" and name != call.name and name not in found:
                    found.append(name)

    # -- summaries ---------------------------------------------------------------------------

    @property
    def findings(self) -> list[ModuleReport]:
        """Modules judged at risk or broken: broken first, each group in execution order."""
        found = [m for m in self.modules.values() if m.verdict != OK]
        return sorted(found, key=lambda m: (m.verdict.severity, m.order))

    def worst(self, n: int | None = None) -> list[ModuleReport]:
        """Modules ordered worst first: by verdict, then by relative error."""
        ranked = sorted(
            self.modules.values(),
            key=lambda m: (
                m.verdict.severity,
                -(m.rel_error if not math.isnan(m.rel_error) else -1.0),
                m.order,
            ),
        )
        return ranked[:n] if n is not None else ranked

    @property
    def loss_rel_error(self) -> float:
        """|target loss - reference loss| / |reference loss| (inf if the target's is not
        finite)."""
        if not math.isfinite(self.target_loss):
            return math.inf
        return abs(self.target_loss - self.loss) / max(abs(self.loss), 1e-12)

    @property
    def finite(self) -> bool:
        """Whether the target run's loss and every parameter gradient are finite."""
        return math.isfinite(self.target_loss) and not any(
            p.nonfinite for p in self.params.values()
        )

    @property
    def default_tolerance(self) -> float:
        """The relative error `passes` and `recommend` accept unless told: looser under a
        quantized policy, whose healthy layers already differ more from float."""
        quantized = any(isinstance(p, QuantizedPolicy) for p in self.precision.policies())
        return QUANTIZED_TOLERANCE if quantized else DEFAULT_TOLERANCE

    def passes(self, tolerance: float | None = None) -> bool:
        """The target run is finite, no module is broken, and the loss and the gradient
        (as one vector) are within `tolerance` (default: `default_tolerance`) relative error
        of the reference's."""
        if tolerance is None:
            tolerance = self.default_tolerance
        if not tolerance > 0:  # nan and negative ones failed every run without a word
            raise ValueError(f"tolerance must be a positive relative error, got {tolerance}")
        return (
            self.finite
            and not any(m.verdict == BROKEN for m in self.modules.values())
            and self.loss_rel_error <= tolerance
            and self.grad_rel_error <= tolerance
        )

    # -- the fix -----------------------------------------------------------------------------

    def _safer(self, module: ModuleReport, current: Policy | None) -> Policy | None:
        """The next, safer policy for `module`: a quantized layer first goes back to the float
        policy it was quantized from; then bfloat16 for a float16 range problem when this
        device runs bfloat16, else float32; None when float32 was tried already. A module
        moved to bfloat16 for a range finding it no longer has (fixed by that move) still
        escalates to float32: the step taken stays on the ladder whatever the finding now."""
        inherited = self.precision.resolve(self._session.model)[module.name].policy
        wide = (
            inherited.param_dtype
            if format_info(inherited.param_dtype).bits >= 32
            else torch.float32
        )
        steps = []
        if isinstance(inherited, QuantizedPolicy):  # first the float policy it came from
            source = inherited.source
            steps.append(source)
            inherited = source
        bf16 = Policy(
            param_dtype=wide, compute_dtype=torch.bfloat16, output_dtype=inherited.output_dtype
        )
        if current == bf16 or (
            module.kind == FindingKind.RANGE
            and self.dtype == torch.float16
            and dtype_support(torch.bfloat16, detect(self.device)).status in (FAST, SUPPORTED)
        ):
            steps.append(bf16)
        steps.append(
            Policy(
                param_dtype=wide, compute_dtype=torch.float32, output_dtype=inherited.output_dtype
            )
        )
        steps = list(dict.fromkeys(steps))  # a float32 source is already the last step
        if current is None:
            return steps[0]
        later = steps[steps.index(current) + 1 :] if current in steps else []
        return later[0] if later else None

    def _rule_key(self, name: str) -> str:
        """`name` as a rule key: escaped only if, as a regex, it would match another module
        too or is no regex at all (a ModuleDict key ``"a("``). A key equal to a module's
        path is that module's exact rule whatever it means as a regex (``"blocks.big+1"``,
        which as a regex does not match itself): escaped it would become a regex rule,
        clashing with the user's regex rules of the same rank."""
        try:
            pattern = re.compile(name)
        except re.error:
            return re.escape(name)
        names = [n for n, _ in self._session.model.named_modules(remove_duplicate=False)]
        if any(n != name and pattern.fullmatch(n) for n in names):
            return re.escape(name)
        return name

    def _map(self, chosen: dict[str, Policy]) -> PolicyMap:
        """The target map with each module of `chosen` moved to its policy, and the modules
        that move with it (`_moves`)."""
        return self._moves(chosen)[0]

    def _moves(self, chosen: dict[str, Policy]) -> tuple[PolicyMap, dict[str, list[str]]]:
        """The map of `chosen` and, for each of its modules, the other paths given its rule
        with it, each said with why: one module runs in one policy and one weight is stored
        in one dtype, so a moved module takes its own other paths (``self.b = self.a``, which
        the probe names at its first), its submodules' other paths (an activation module
        another block shares too) and, where the move changes the dtype its tied weights are
        stored in, the modules holding them (a head tied to the embedding). A module
        containing the moved one (the model itself holding the weight) is never taken: that
        map is refused as it is, a move that cannot be made alone."""
        shared, tied = self._sharing()
        roots: dict[str, list[str]] = {name: [name] for name in chosen}
        why: dict[str, list[str]] = {name: [] for name in chosen}

        def inside(path: str, name: str) -> bool:
            return any(path == r or path.startswith(r + ".") for r in roots[name])

        def take(name: str, path: str, reason: str) -> bool:
            if path == "" or any(r.startswith(path + ".") for r in roots[name]):
                return False  # (a module containing the moved one)
            roots[name].append(path)
            why[name].append(f"{path}, {reason}")
            return True

        def build() -> PolicyMap:
            rules: dict[Any, Any] = dict(self.precision.rules)
            for name, policy in chosen.items():
                for path in roots[name]:
                    rules[self._rule_key(path)] = policy
            # (the user's activation and optimizer-state rules stay, verified with the fix)
            return self.precision.replace(rules=rules)

        for _ in range(len(shared) + len(tied) + 1):
            grown = False
            for name in chosen:
                for paths in shared:  # a module at several paths: one policy at each
                    inner = next((q for q in paths if inside(q, name)), None)
                    if inner is None:
                        continue
                    for path in paths:
                        if not inside(path, name):
                            grown |= take(name, path, f"the same module as {inner}")
            policy = build()
            if not tied:
                return policy, why
            try:
                resolved = policy.resolve(self._session.model)
            except PolicySpecError:
                return policy, why  # (refused when it runs, with the reason)
            for owners, param in tied:  # a weight held by several modules: one dtype
                stored = {
                    (resolved[q].policy.param_dtype if param else resolved[q].policy.buffer_dtype)
                    for q, _ in owners
                    if not resolved[q].quantized  # (quantization replaces the module)
                }
                if len(stored) < 2:
                    continue
                for name in chosen:
                    held = next((t for q, t in owners if inside(q, name)), None)
                    if held is None:
                        continue
                    for q, theirs in owners:
                        if not inside(q, name):
                            grown |= take(name, q, f"whose {theirs} is {held}")
            if not grown:
                return policy, why
        return build(), why

    def _with(self, chosen: dict[str, Policy], name: str) -> str:
        """The modules moving with `name` in the map of `chosen`, as the log says them."""
        taken = self._moves(chosen)[1].get(name)
        return f" (with {'; '.join(taken)})" if taken else ""

    def _sharing(self) -> tuple[list[list[str]], list[tuple[list[tuple[str, str]], bool]]]:
        """The model's modules reachable at several paths (each one's paths), and its
        floating tensors held by several modules (each one's holders as (path, the tensor's
        name there), and whether it is a parameter); computed once."""
        if self._shared is None:
            paths: dict[int, list[str]] = {}
            holders: dict[int, tuple[list[tuple[str, str]], set[int], bool]] = {}
            for path, module in self._session.model.named_modules(remove_duplicate=False):
                paths.setdefault(id(module), []).append(path)
                for param, store in ((True, module._parameters), (False, module._buffers)):
                    for key, t in store.items():
                        if t is None or not t.is_floating_point():
                            continue
                        found = holders.setdefault(id(t), ([], set(), param))
                        found[0].append((path, f"{path}.{key}" if path else key))
                        found[1].add(id(module))
            self._shared = [p for p in paths.values() if len(p) > 1]
            self._tied = [(h, param) for h, ids, param in holders.values() if len(ids) > 1]
        return self._shared, self._tied

    def _tried(self, chosen: dict[str, Policy], loss_scale: float) -> Diagnosis | str:
        """`_trial`, or why the map of `chosen` cannot run: a module moved alone that shares
        a submodule or a weight with a module elsewhere (one module, one weight, one policy;
        refused before anything runs)."""
        try:
            return self._trial(chosen, loss_scale)
        except PolicySpecError as error:
            return str(error)

    def _trial(self, chosen: dict[str, Policy], loss_scale: float) -> Diagnosis:
        """The run of the map of `chosen` at `loss_scale`; at the diagnosis's own scale
        where no scale was given, at the one a dynamic scaler runs that map at (starting
        where the diagnosis's started and halving on a backward overflow, as it would): a
        fix needing no more than that needs no explicit loss scale."""
        policy = self._map(chosen)
        start = self._start if loss_scale == self.loss_scale else None
        if start is None:
            target = self._session.run(policy, self._ref, loss_scale)
        else:
            target, loss_scale = _scaled_run(
                self._session, policy, self._ref, start, self.recommended_loss_scale, True
            )
        trial = Diagnosis(
            self._session,
            policy,
            self.reference,
            self._ref,
            target,
            loss_scale,
            self.recommended_loss_scale,
        )
        trial._start = self._start
        return trial

    def recommend(self, tolerance: float | None = None) -> Recommendation:
        """The target policy with the fewest modules moved to a safer precision such that the
        target run is finite, has no broken module, and its loss and gradient are within
        `tolerance` (relative) of the reference.

        Greedy: fix the first remaining finding (broken before at risk, in execution order),
        re-run, repeat; then drop every fix the run does not need. A finding the loss scale
        causes (kind "scale": a backward overflow above the recommended scale, gradients
        flushed below it) is fixed by that scale, not by a layer's dtype: the result then
        carries `loss_scale`. Each step is one run of the model. Raises PrecisionError when
        no per-module map gets there. The diagnosis itself is not changed: pass the result
        to `save` / `to_markdown` to report it.
        """
        if tolerance is None:
            tolerance = self.default_tolerance
        if not tolerance > 0:
            raise ValueError(f"tolerance must be a positive relative error, got {tolerance}")
        chosen: dict[str, Policy] = {}
        exhausted: set[str] = set()
        log: list[str] = []
        alone: list[str] = []  # the moves the policy refused (a shared module or weight)
        trial: Diagnosis = self
        scale = self.loss_scale
        output_tried = False
        for _ in range(2 * len(self.modules) + 3):
            if trial.passes(tolerance):
                break
            rescale = scale != self.recommended_loss_scale
            pick = next(
                (m for m in trial.findings if _to_fix(m, trial, tolerance, exhausted, rescale)),
                None,
            )
            if pick is not None and pick.kind == FindingKind.LOSS:
                raise PrecisionError(
                    f"{pick.reason}: no per-module policy changes what happens outside the modules"
                )
            if pick is not None and pick.kind == FindingKind.SCALE and rescale:
                before, scale = scale, self.recommended_loss_scale
                trial = self._trial(chosen, scale)
                log.append(
                    f"loss scale {scale_text(before)} -> {scale_text(scale)}, for "
                    f"{pick.display_name}'s gradients: "
                    + ("the run passes" if trial.passes(tolerance) else _why_not(trial, tolerance))
                )
                continue
            if pick is None and not output_tried:
                # no module at risk, yet the run misses: the loss reads a last layer's output
                # (a classifier's 16-bit logits round a near-certain loss to 0)
                output_tried = True
                found = self._fix_output(trial, chosen, scale, tolerance, exhausted, log)
                if found is not None:
                    chosen, trial = found
                    continue
            if pick is None:
                raise self._stuck(trial, tolerance, exhausted, chosen, alone)
            # a module that never runs (a root whose training_step calls its children) has
            # no region a rule could change
            safer = self._safer(pick, chosen.get(pick.name)) if pick.calls else None
            if safer is None:
                exhausted.add(pick.name)
                # broken in its safest precision: its input came rounded from the module
                # that made it (an offset the next layer cancels), which moves next
                found = self._upstream(pick, trial, chosen, scale, tolerance, exhausted, log)
                if found is not None:
                    chosen, trial = found
                continue
            before = dict(chosen)
            chosen[pick.name] = safer
            _drop_shadowing(chosen, pick.name, safer)
            tried = self._tried(chosen, scale)
            if isinstance(tried, str):  # (it cannot move alone: on to the next finding)
                chosen = before
                exhausted.add(pick.name)
                alone.append(f"{pick.display_name} cannot move alone ({tried})")
                log.append(f"{pick.display_name} -> {safer.name}: {alone[-1]}")
                continue
            trial = tried
            log.append(
                f"{pick.display_name} -> {safer.name}{self._with(chosen, pick.name)}: "
                + ("the run passes" if trial.passes(tolerance) else _why_not(trial, tolerance))
            )
        else:
            raise PrecisionError(f"recommend did not converge after {len(chosen)} fixes")
        chosen, trial = self._drop_unneeded(chosen, trial, scale, tolerance, log)
        changed = scale if scale != self.loss_scale else None
        return Recommendation(self._map(chosen), trial, tuple(log), tolerance, changed)

    def _upstream(
        self,
        pick: ModuleReport,
        trial: Diagnosis,
        chosen: dict[str, Policy],
        scale: float,
        tolerance: float,
        exhausted: set[str],
        log: list[str],
    ) -> tuple[dict[str, Policy], Diagnosis] | None:
        """For a module still broken in its safest precision: the modules its input came
        from, nearest first, through those without parameters of their own (an activation
        passes its input's rounding on), each moved to its next safer precision in turn
        until one leaves ``pick`` no longer broken; the moves and that run, or None."""
        if pick.verdict != BROKEN or pick.name not in chosen:
            return None
        modules = dict(self._session.model.named_modules())
        seen, queue = {pick.name}, list(trial._producers.get(pick.name, []))
        while queue and len(seen) < _UPSTREAM_TRIES:
            name = queue.pop(0)
            if name in seen or not name:  # (never the model itself: that is every module)
                continue
            seen.add(name)
            m, module = trial.modules.get(name), modules.get(name)
            if m is None or module is None or not m.calls:
                continue
            if next(module.parameters(recurse=False), None) is None:
                queue.extend(trial._producers.get(name, []))  # (it passes its input on)
                continue
            policy = self._safer(m, chosen.get(name))
            if policy is None or name in exhausted:
                continue
            moved = {**chosen, name: policy}
            _drop_shadowing(moved, name, policy)
            found = self._tried(moved, scale)
            if isinstance(found, str):
                continue  # (it shares a weight or a submodule: it cannot move alone)
            still = found.modules.get(pick.name)
            if found.passes(tolerance) or still is None or still.verdict != BROKEN:
                log.append(
                    f"{pick.display_name} is still broken in {chosen[pick.name].name}: its "
                    f"input comes from {m.display_name} -> {policy.name}"
                    f"{self._with(moved, name)}: "
                    + ("the run passes" if found.passes(tolerance) else _why_not(found, tolerance))
                )
                return moved, found
        return None

    def _fix_output(
        self,
        trial: Diagnosis,
        chosen: dict[str, Policy],
        scale: float,
        tolerance: float,
        exhausted: set[str],
        log: list[str],
    ) -> tuple[dict[str, Policy], Diagnosis] | None:
        """For a run that misses the tolerance with no module at risk: the last layers to
        run that own parameters (the loss most likely reads one of their outputs), latest
        first, each in every safer precision in turn until the run passes; the moves and
        that run, or None (nothing kept) when none passes."""
        modules = dict(self._session.model.named_modules())
        owning = [
            m
            for m in trial.modules.values()
            if m.name
            and m.calls
            and m.name not in exhausted
            and m.name in modules
            and next(modules[m.name].parameters(recurse=False), None) is not None
        ]
        for m in sorted(owning, key=lambda m: -m.order)[:_OUTPUT_TRIES]:
            policy = self._safer(m, chosen.get(m.name))
            while policy is not None:
                moved = {**chosen, m.name: policy}
                _drop_shadowing(moved, m.name, policy)
                found = self._tried(moved, scale)
                if isinstance(found, str):
                    break  # (it shares a weight or a submodule: it cannot move alone)
                passes = found.passes(tolerance)
                log.append(
                    f"no module at risk, yet not within tolerance: {m.display_name} (a last "
                    f"layer, whose output the loss may read) -> {policy.name}"
                    f"{self._with(moved, m.name)}: "
                    + ("the run passes" if passes else _why_not(found, tolerance))
                )
                if passes:
                    return moved, found
                policy = self._safer(m, policy)
        return None

    def _stuck(
        self,
        trial: Diagnosis,
        tolerance: float,
        exhausted: set[str],
        chosen: dict[str, Policy],
        alone: list[str] = (),  # type: ignore[assignment]
    ) -> PrecisionError:
        """Why `recommend` found no module left to move while `trial` still fails: no module
        was (or, after the moves in `chosen`, is still) at risk, so the error builds up over
        many layers; or every one was tried."""
        if not exhausted:
            moved = ", ".join(f"{n} to {p.name}" for n, p in sorted(chosen.items()))
            after = f" after moving {moved}" if chosen else ""
            root = trial.modules.get("")
            if root is not None and root.verdict != OK:  # (its own code or parameters)
                own = (
                    f" but the model itself ({root.verdict}: {root.reason}), so there is no "
                    "layer to move: a rule for the model itself would put the whole model in "
                    "another precision"
                )
            else:
                own = ", so there is no layer to move: " + (
                    _backward_only(trial, tolerance) or "the error builds up over many layers"
                )
            return PrecisionError(
                f"{self.precision.default.name}{after} is not within tolerance {tolerance:g} "
                f"of {self.reference.default.name} (loss error {trial.loss_rel_error:.3g}, "
                f"gradient error {trial.grad_rel_error:.3g}) although no module is "
                f"{'left ' if chosen else ''}at risk or broken{own}. Use a larger tolerance or "
                f"train in the reference precision.{self._reference_noise(tolerance)}"
            )
        hint = (  # (not where a move was refused: a mixed policy shares modules alike)
            " Under a 'true' policy a layer's output is cast back to the policy's "
            "output dtype, so an activation beyond its range cannot be kept per layer: "
            "try a mixed policy."
            if not self.precision.default.is_mixed and not alone
            else ""
        )
        why = _why_not(trial, tolerance)
        if "loss error" not in why:  # (a broken module or a non-finite run: the errors too)
            why += f" (loss error {trial.loss_rel_error:.3g}, gradient error "
            why += f"{trial.grad_rel_error:.3g})"
        refused = f" ({'; '.join(alone)}: give the modules sharing it one rule)" if alone else ""
        return PrecisionError(
            f"no per-module policy brings {self.precision.default.name} within "
            f"tolerance {tolerance:g} of {self.reference.default.name}: after trying "
            f"{', '.join(sorted(n or '<root>' for n in exhausted))} in every safer "
            f"precision{refused}, {why}.{hint} Use a larger tolerance or train in the "
            "reference precision."
        )

    def _reference_noise(self, tolerance: float) -> str:
        """Where the reference is float32: how far float32 itself is from float64 on this
        batch, said when it is near the tolerance (an ill-conditioned model, a saturated
        softmax: then no precision can be judged against float32); '' otherwise, or where
        float64 cannot run (a device without it, a model refusing it)."""
        if self.reference.default.name != "32-true" or self.device.type == "mps":
            return ""
        wide = as_map("64-true")
        try:
            ref64 = self._session.run(wide, None, 1.0)
            run32 = self._session.run(self.reference, ref64, 1.0)
        except Exception:  # (a hint only: the error it joins is raised either way)
            return ""
        own = Diagnosis(self._session, self.reference, wide, ref64, run32, 1.0, 1.0)
        if max(own.loss_rel_error, own.grad_rel_error) < tolerance / 2:
            return ""
        return (
            f" The reference itself is noisy here: 32-true against 64-true gives loss error "
            f"{own.loss_rel_error:.3g}, gradient error {own.grad_rel_error:.3g}, so no "
            "precision can be judged against it within this tolerance (an ill-conditioned "
            "model or batch, such as a saturated softmax)."
        )

    def _drop_unneeded(
        self,
        chosen: dict[str, Policy],
        trial: Diagnosis,
        scale: float,
        tolerance: float,
        log: list[str],
    ) -> tuple[dict[str, Policy], Diagnosis]:
        """`chosen` without each fix (latest first) the run passes without; the last
        passing trial. Each drop is logged."""
        for name in reversed(list(chosen)):
            fewer = {k: v for k, v in chosen.items() if k != name}
            without = self._tried(fewer, scale)
            if isinstance(without, str):
                continue
            if without.passes(tolerance):
                chosen, trial = fewer, without
                log.append(f"{name or '<root>'}: not needed after all, dropped")
        return chosen, trial

    # -- printing ----------------------------------------------------------------------------

    def summary(self) -> str:
        """Two lines: what was compared, the losses, the loss scale."""
        from mixprec.doctor.report import summary

        return summary(self)

    def to_markdown(
        self,
        plots: dict[str, str] | None = None,
        recommendation: Recommendation | None = None,
        *,
        unrecommended: str | None = None,
        check: str | None = None,
    ) -> str:
        """The report as markdown; `plots` maps a caption to an image path to link; with a
        `recommendation` (from `recommend`) it shows the policy and its verified run (and
        `check`, a command checking it again), and without one `unrecommended` (why
        `recommend` found none) is said."""
        from mixprec.doctor.report import to_markdown

        return to_markdown(self, plots, recommendation, unrecommended, check)

    def save(
        self,
        directory: str | Path,
        recommendation: Recommendation | None = None,
        *,
        unrecommended: str | None = None,
        check: str | None = None,
    ) -> Path:
        """Write report.md and PNG plots (per-layer error, per-layer range) to `directory`;
        returns the report's path. With a `recommendation` they include the recommended
        policy and its verified run, and policy.json holds the policy unless the fix is a
        loss scale alone (the report then says the scale it needs); `check`: the command
        that checks the fix again, shown there. Without one, `unrecommended` (why
        `recommend` found none: its error) is said there. Needs matplotlib."""
        from mixprec.doctor.report import save

        return save(self, directory, recommendation, unrecommended, check)

    def __rich__(self) -> Any:
        from mixprec.doctor.report import rich_view

        return rich_view(self)

    def __str__(self) -> str:
        from mixprec.doctor.report import as_text

        return as_text(self)

    def __repr__(self) -> str:
        return (
            f"Diagnosis({self.precision.name} vs {self.reference.name}: "
            f"{sum(m.verdict == BROKEN for m in self.modules.values())} broken, "
            f"{sum(m.verdict == AT_RISK for m in self.modules.values())} at risk)"
        )


@dataclass(frozen=True)
class Recommendation:
    """What `Diagnosis.recommend` found: the policy, its verified run, and how it got there.

    Attributes:
        policy: the target policy with the fewest modules moved to a safer precision.
        verified: the diagnosis of a run under `policy` (it passes at `tolerance`).
        log: step by step, which module was moved and what the run then showed.
        tolerance: the relative loss and gradient error the fix had to reach.
        loss_scale: the loss scale the fix needs when the diagnosed one overflowed or
            underflowed (None: keep it, or, where none was given, let a dynamic scaler
            back off as it does); `verified` ran at it.
    """

    policy: PolicyMap
    verified: Diagnosis
    log: tuple[str, ...]
    tolerance: float
    loss_scale: float | None = None

    def to_code(self) -> str:
        """The policy as Python to paste into a training script."""
        return self.policy.to_code()

    def scaler_advice(self) -> str | None:
        """What to do about the loss scale, in a sentence; None when it is fine as it is."""
        if self.loss_scale is None:
            return None
        scale = scale_text(self.loss_scale)
        return (
            f"train at loss scale {scale}: mixprec.Precision(policy, "
            f"scaler=mixprec.DynamicLossScaler(init_scale={scale})) (a dynamic scaler halves "
            "its scale on an overflow by itself, skipping that step, but doubles it only after "
            "growth_interval clean steps)"
        )


def _to_fix(
    m: ModuleReport, trial: Diagnosis, tolerance: float, exhausted: set[str], rescale: bool
) -> bool:
    """Whether `recommend` acts on a finding: not a module tried in every precision, nor a
    loss at risk whose error is within the tolerance (nothing outside the modules needs a
    fix then, and a module's finding may), nor one of the model itself ("") that a rule
    would fix: a rule for it puts the whole model in another precision (its loss finding
    is said as it is, its loss scale changed where `rescale`: the scale is not the
    recommended one yet)."""
    if m.name in exhausted:
        return False
    if m.name == "" and not (
        m.kind == FindingKind.LOSS or (m.kind == FindingKind.SCALE and rescale)
    ):
        return False
    quiet_loss = m.kind == FindingKind.LOSS and m.verdict != BROKEN
    return not (quiet_loss and trial.loss_rel_error <= tolerance)


def _drop_shadowing(chosen: dict[str, Policy], name: str, policy: Policy) -> None:
    """Drop the rules of modules below `name` that compute narrower than `policy`, which
    `name` was just moved to: a path rule below it outranks its rule, so those modules kept
    the narrower dtype and the move changed nothing (they inherit `policy` now, and a
    finding there is moved again on its own)."""
    bits = format_info(policy.compute_dtype).bits
    below = f"{name}." if name else ""
    for other in [n for n in chosen if n != name and n.startswith(below)]:
        if format_info(chosen[other].compute_dtype).bits < bits:
            del chosen[other]


def _why_not(d: Diagnosis, tolerance: float) -> str:
    """Why a trial run does not pass yet, in a few words."""
    broken = [m for m in d.findings if m.verdict == BROKEN]
    if broken:
        b = broken[0]
        return f"run again, {b.display_name} ({b.type}) is broken: {b.reason}"
    if not d.finite:
        return "the loss or a gradient is still not finite"
    return (
        f"loss error {d.loss_rel_error:.3g}, gradient error {d.grad_rel_error:.3g} "
        f"(tolerance {tolerance:g})"
    )


def _given_scale(loss_scale: Any) -> float:
    """A loss scale given as a number, as a float; TypeError / ValueError saying what is
    accepted otherwise."""
    try:
        scale = float(loss_scale)
    except (TypeError, ValueError):
        raise TypeError(
            "loss_scale must be a positive number, a LossScaler or None (where a dynamic "
            f"scaler runs the batch), got {loss_scale!r}"
        ) from None
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"loss_scale must be a positive finite number, got {loss_scale}")
    return scale


def diagnose(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., Tensor] | None = None,
    precision: Any = "16-mixed",
    reference: Any = "32-true",
    *,
    loss_scale: float | LossScaler | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    lr: float | None = None,
    optimizer: str = "adam",
    master_weights: bool | None = None,
    compensation: str | None = None,
) -> Diagnosis:
    """Run `model` forward and backward once in `reference` and once in `precision` on
    copies of the same weights, and compare them module by module.

    As in the Trainer, a batch `(inputs..., target)` gives `loss_fn(model(*inputs), target)`;
    without `loss_fn`, a Hugging Face model is called with the batch (a dict with labels) as
    keyword arguments and its output's `.loss` taken; a TrainingModule or Lightning
    LightningModule (any model with `training_step(batch, batch_idx)`) is asked for its
    loss; and any other model must return the loss (or a dict with "loss") from
    `model(batch)` (`mixprec.step.batch_loss`).

    `loss_scale` is the scale the target's backward runs at: a number, a LossScaler (its
    current scale), or None for the one a dynamic scaler starting at 2^16 runs this batch
    at: halved until the gradients are finite, to the recommended scale at most (1 when
    no scaling is needed; at most 32768 for a float16 loss, whose gradient is the scale).

    With `lr`, weights stored in 16 bits (a "true" policy) are also checked for vanishing
    updates: the share of one optimizer step (`optimizer="adam"`: about `lr` per weight;
    `"sgd"`: `lr` x gradient) that rounds away because it is below half a unit in the last
    place of the weight. A module losing most of its updates is flagged (it stops learning):
    the fix is compensated updates, float32 master weights, or a float32 rule. Weights with
    masters or compensated lose none: `master_weights` and `compensation` as `Precision`
    takes them (docs/doctor.md).

    Dropout is off in both runs so they see the same network, and both start from the same
    RNG seed; the caller's RNG state is restored afterwards. The model itself is not
    touched: every run works on a deep copy (no hooks, no dtype, value or gradient changes
    on yours). `recommend` copies it again, so do not change it in between (it checks).
    A slow or unsupported precision only warns: numerics can be studied anywhere, so keep
    the batch small.
    """
    seed = _checked_arguments(model, loss_fn, seed)
    # a bad loss scale is refused before any run
    given = loss_scale.loss_scale if isinstance(loss_scale, LossScaler) else loss_scale
    given = _given_scale(given) if given is not None else None
    where = parse_device(device) if device is not None else device_of(model)
    detect(where)  # a device this torch cannot use is a clear error before any copy
    # "auto" means the fastest stable precision of the device the runs happen on
    target_map, ref_map = resolve_policy(precision, where), resolve_policy(reference, where)
    if device is not None and where != device_of(model):
        model = copy.deepcopy(model).to(where)  # the runs copy this one, not the caller's
    if device is not None:
        batch = map_tensors(lambda t: t.to(where), batch)
    UpdateModel.check_flags(master_weights, compensation)  # (refused without lr too)
    update = UpdateModel(lr, optimizer, master_weights, compensation) if lr is not None else None
    session = Session(model, batch, loss_fn, where, seed, update)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference may be slow here too: it is a probe
        ref = session.run(ref_map, None, 1.0)
    if not math.isfinite(ref.loss):
        raise ReferenceRunError(
            f"the reference run ({ref_map.name}) already gives a non-finite loss "
            f"({ref.loss}): the problem is not the precision; check the data and the model"
        )
    bad = ref.nonfinite_grads  # (in their own dtype: a float64 reference's are float64)
    if bad:  # (a low precision would be blamed for what the reference does too)
        raise ReferenceRunError(
            f"the reference run ({ref_map.name}) already gives inf/NaN gradients (of "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}) with a finite loss: the "
            "problem is not the precision; check the model's ops (sqrt or a division at 0, "
            "log of 0) and the data"
        )
    dynamic = loss_scale is None
    target, scale, recommended, start = _target_run(session, target_map, ref, given, dynamic)
    diagnosis = Diagnosis(session, target_map, ref_map, ref, target, scale, recommended)
    diagnosis._start = start if dynamic else None
    return diagnosis


def _checked_arguments(model: Any, loss_fn: Any, seed: Any) -> int:
    """Refuse what `diagnose` cannot run (naming what it takes); the seed as an int."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"diagnose needs an nn.Module, got {type(model).__name__}")
    lazy = [
        name
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if isinstance(t, nn.parameter.UninitializedTensorMixin)
    ]
    if lazy:
        raise ValueError(
            f"the model has uninitialized (lazy) parameters or buffers ({', '.join(lazy)}): run "
            "it once on a batch (model(inputs)) to give them their shapes, then diagnose it"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            "loss_fn must be callable as loss_fn(outputs, target) (e.g. "
            f"torch.nn.functional.cross_entropy), or None; got {type(loss_fn).__name__}"
        )
    if not isinstance(seed, Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return int(seed)  # torch's generators take no numpy integer


def _target_run(
    session: Session, target_map: PolicyMap, ref: Recording, given: float | None, dynamic: bool
) -> tuple[Recording, float, float, float]:
    """The target run at the `given` loss scale, or (None) at the scale a dynamic scaler
    starting at 2^16 runs this batch at: 2^16 halved until the gradients are finite, and
    no higher than the loss's own dtype holds (`dynamic`: no scale was given); the
    recording, its scale, the recommended scale and the scale it started at."""
    narrow = range_dtype(target_map)
    peak = grad_amax(ref)
    recommended = loss_scale_for(peak, narrow) if target_map.needs_loss_scaling else 1.0
    if given is not None:
        scale = given
    elif target_map.needs_loss_scaling:
        # a scaler halves only on an overflow: start where the reference's gradients fit
        # (none does where they hold inf/NaN themselves: the recommended scale, 1, then)
        if 0 < peak < math.inf:
            fits = largest_loss_scale(peak, narrow)
        else:
            fits = DEFAULT_LOSS_SCALE if peak == 0 else recommended
        scale = max(min(DEFAULT_LOSS_SCALE, fits), min(DEFAULT_LOSS_SCALE, recommended))
    else:
        scale = 1.0
    start = scale
    target = session.run(target_map, ref, scale)
    # a 16-bit loss's own gradient is the loss scale, so the scale must fit the loss's dtype
    recommended = min(recommended, largest_loss_scale(1.0, target.loss_dtype))
    target, scale = _scaled_run(session, target_map, ref, scale, recommended, dynamic, target)
    return target, scale, recommended, start


def _scaled_run(
    session: Session,
    target_map: PolicyMap,
    ref: Recording,
    scale: float,
    recommended: float,
    dynamic: bool,
    target: Recording | None = None,
) -> tuple[Recording, float]:
    """The run of `target_map` at `scale` (`target`: already made), and (`dynamic`) as a
    dynamic scaler starting there goes on: below what the loss's own dtype holds, then
    halved while the backward overflows, down to `recommended` at most; the run and its
    scale."""
    if target is None:
        target = session.run(target_map, ref, scale)
    held = largest_loss_scale(1.0, target.loss_dtype)
    if dynamic and scale > held:
        scale = held  # where a dynamic scaler backs off to after one overflow
        target = session.run(target_map, ref, scale)
    # not below the recommended scale: an overflow there, with `LOSS_SCALE_MARGIN`
    # headroom over the reference's gradients, is the run's to report, not the scale's
    floor = min(DEFAULT_LOSS_SCALE, recommended)
    while dynamic and scale > floor and _backward_overflows(target):
        scale /= 2  # as the scaler backs off on the overflow it sees
        target = session.run(target_map, ref, scale)
    return target, scale


def _backward_only(trial: Diagnosis, tolerance: float) -> str | None:
    """Where every module's output and the loss equal the reference's (within
    `_AGREE_ULPS` of the reference's own rounding: a forward run in the reference's
    precision) but parameter gradients are not within `tolerance`: the error is made in
    the backward (saved activations kept lossily, a custom backward), which no layer's
    forward precision changes. Says so, naming the worst parameters and where the error
    enters; else None (a forward that rounds, however little, may make the error in the
    backward of the ops it rounds, over many layers)."""
    called = [m for m in trial.modules.values() if m.calls]
    agree = _AGREE_ULPS * format_info(trial.reference.default.compute_dtype).eps
    if not trial.loss_rel_error <= agree or any(not m.rel_error <= agree for m in called):
        return None
    params = [p for p in trial.params.values() if math.isfinite(p.rel_error)]
    erring = sorted((p for p in params if p.rel_error > tolerance), key=lambda p: -p.rel_error)
    if not erring:
        return None
    worst = ", ".join(f"{p.name} ({p.rel_error:.2g})" for p in erring[:5])
    text = (
        "every module's output agrees with the reference (the loss too), but the parameters' "
        f"gradients do not: {worst}{' ...' if len(erring) > 5 else ''}; the error is made "
        "in the backward, which no layer's forward precision changes"
    )
    # the backward runs the forward reversed: the error enters before the backward of the
    # last module (in the forward) whose parameters' gradients err, and after that of the
    # first one past it whose are right
    order = {m.name: m.order for m in called}
    bad = {p.module for p in erring if p.module in order}
    good = {p.module for p in params if p.module in order} - bad
    if bad:
        last = max(bad, key=order.__getitem__)
        after = min(
            (g for g in good if order[g] > order[last]), key=order.__getitem__, default=None
        )
        top = order[after] if after is not None else math.inf
        between = [
            m.display_name
            for m in called
            if m.name
            and order[last] < m.order < top
            and not any(n.startswith(m.name + ".") for n in (last, after or ""))
        ]
        shown = "the loss" if after is None else after or "<root>"
        text += f"; it enters the backward after {shown} and before {last or '<root>'}"
        text += f": in {', '.join(between)}, or in code between them" if between else ""
    if trial.precision.activations is not None:
        text += (
            " (the policy's activation rules, which keep the tensors layers save for the "
            "backward, act there)"
        )
    return text


def _backward_overflows(target: Recording) -> bool:
    """The run's forward is finite and some gradient is not: an overflow a lower loss scale
    may avoid (after a forward inf/NaN no scale makes the gradients finite)."""
    values, params = target.rows()
    if not math.isfinite(target.loss) or any(v.nonfinite for v in values.values()):
        return False
    grads = any(slot.grad_nonfinite for slot in target.slots.values())
    return grads or any(p.nonfinite for p in params.values())
