"""The activation option of each block, chosen by the search beside the formats: with
``batch_size`` (under ``count="training"``) a search counts the activations a training
step saves at that batch and lets each block keep them, store them in fewer bits or
recompute them (`mixprec.activations`).

A *block* is a child of the model (the children of an ``nn.Sequential`` or
``nn.ModuleList`` child, or of a model that is one, in its place) whose forward saves
something. Each block's options, and what each is measured to cost:

- bytes: what the block's forward saves at batch ``batch_size`` with ``keep`` (measured by
  `mixprec.activations.measure.saved_bytes_of` on the model converted to the baseline, a
  batch repeating the first search batch's rows); with another option, that plus what giving
  the block alone the option changes in the whole step's bytes (docs/doctor.md: a tensor two
  blocks save is counted as the step holds it, never below). Bytes outside the blocks are
  a fixed cost;
- damage (``bf16``, ``fp8``): the lossy storage changes the gradients, not the loss, so its
  damage is the loss change of one SGD step of size ``lr`` it causes, to first order:
  ``lr * |g . (g' - g)|`` with ``g`` float32's gradients and ``g'`` those with only this
  block's saved tensors stored so, averaged over the search batches (recompute and
  ``keep`` are exact: zero);
- seconds: the block's forward and backward alone on the inputs it saw in the first search
  batch, with the option (median of ``reps``); its extra time over ``keep`` (`extra_seconds`)
  breaks ties between plans of equal damage (`tie_costs`: noise alone tells none apart), so
  a budget with room keeps.

Searched: ``keep``, ``bf16``, ``fp8``, ``checkpoint``, and ``offload`` on CUDA; not
``selective``, whose saved matmul outputs torch's checkpointing holds out of the count's
sight (give it by hand). A block that cannot take an option (`activations.refusal`) is
not offered it; a module reached at several paths (used twice) is no block: it keeps.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.activations import ActivationForward, ActivationRules, install, refusal
from mixprec.activations.measure import saved_bytes_of
from mixprec.convert import apply
from mixprec.plan.inputs import SearchInputs
from mixprec.plan.report import BlockRow, Option, UnitRow
from mixprec.plan.units import path_rule
from mixprec.policy import Policy
from mixprec.policy.map import PolicyMap
from mixprec.precision import Precision
from mixprec.step import backward, batch_loss, fresh, seeded

__all__: list[str] = []

# the least extra seconds an option other than keep counts in a tie (`extra_seconds`)
TIE_FLOOR = 1e-6
# noise thresholds of `tie_costs`: an option counts slower than keep only when its extra
# seconds exceed this fraction of keep's (a tiny block's step timed twice on a shared CPU
# differs by tens of percent), and slower than another option only when more than this
# factor slower (two timings of one step never differ so much)
TIE_NOISE = 0.5
TIE_RATIO = 2.0
# the option left out of the search, and why
NOT_SEARCHED = {
    "selective": "its saved matmul outputs are held by torch's checkpointing, out of the "
    "saved-bytes count's sight; give it by hand (activations=...)"
}


def searched_options(device: torch.device) -> tuple[str, ...]:
    """The activation options a search offers on `device`."""
    return ("keep", "bf16", "fp8", "checkpoint", *(("offload",) if device.type == "cuda" else ()))


def _containers(module: nn.Module) -> bool:
    return isinstance(module, (nn.Sequential, nn.ModuleList))


def find_blocks(model: nn.Module) -> list[str]:
    """The paths of the model's blocks (see the module's docstring), in order."""
    found: list[str] = []
    seen: set[int] = set()
    # modules reached at several paths (a block used twice): an option must name them all
    paths: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        paths[id(module)] = paths.get(id(module), 0) + 1

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if id(child) in seen or paths[id(child)] > 1:
                continue
            seen.add(id(child))
            if _containers(child):
                walk(f"{path}.", child)
            else:
                found.append(path)

    walk("", model)  # a Sequential model's children are its blocks, as any model's are
    return found


def batch_at(batch: Any, size: int) -> Any:
    """`batch` with `size` rows: every tensor whose first dimension is the batch's (the first
    tensor's, ``n``) takes rows ``0, 1, ..., n-1, 0, 1, ...`` of it, and so, per row, does a
    flat one of ``n * T`` elements beside integer ids ``[n, T]`` (per-token targets), ``n``
    above 1; other values stay (`batch_left`): a mask ``[T, T]``, position ids ``[T]``."""
    leading = batch_rows(batch)
    if leading is None:
        raise ValueError(
            "batch_size needs a batch holding a tensor with a batch dimension to repeat, got "
            f"{type(batch).__name__}"
        )
    index = torch.arange(size) % leading
    per_row = _per_row(batch, leading)

    def resized(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dim() and value.shape[0] == leading:
            return value[index.to(value.device)]
        if isinstance(value, Tensor) and value.dim() == 1 and value.shape[0] in per_row:
            k, rest = value.shape[0] // leading, value.shape[1:]
            rows = value.reshape(leading, k, *rest)[index.to(value.device)]
            return rows.reshape(size * k, *rest)
        if isinstance(value, Mapping):
            return type(value)({k: resized(v) for k, v in value.items()})
        if isinstance(value, (tuple, list)):
            return type(value)(resized(v) for v in value)
        return value

    return resized(batch)


def _tensors(value: Any, where: str = "batch") -> list[tuple[str, Tensor]]:
    """Every tensor of a batch, each with where it is (``batch[1]``, ``batch['labels']``)."""
    if isinstance(value, Tensor):
        return [(where, value)]
    if isinstance(value, Mapping):
        return [t for k, v in value.items() for t in _tensors(v, f"{where}[{k!r}]")]
    if isinstance(value, (tuple, list)):
        return [t for i, v in enumerate(value) for t in _tensors(v, f"{where}[{i}]")]
    return []


def _per_row(batch: Any, leading: int) -> set[int]:
    """The sizes of flat per-token tensors beside integer ids ``[leading, T]``: ``leading *
    T``. None with one row (then ``[T]`` may as well be position ids, shared by the rows)
    nor beside other tensors (``[2, 3, 8, 8]`` images beside a bias of 6)."""
    if leading < 2:
        return set()
    return {
        leading * t.shape[1]
        for _, t in _tensors(batch)
        if t.dim() == 2
        and t.shape[0] == leading
        and not t.is_floating_point()
        and not t.is_complex()
        and t.shape[1] > 1
    }


def batch_left(batch: Any, size: int) -> str | None:
    """Why a step at `size` rows (`batch_at`) may fail in the loss: which of `batch`'s
    tensors were resized and which were left as they are; None when none was left."""
    leading = batch_rows(batch)
    per_row = _per_row(batch, leading) if leading is not None else set()
    found = _tensors(batch)
    took = [w for w, t in found if t.dim() and (t.shape[0] == leading or t.shape[0] in per_row)]
    left = [f"{w} {tuple(t.shape)}" for w, t in found if t.dim() and w not in took]
    if not left:
        return None
    return (
        f"batch_size={size} resized the tensors leading with the batch's {leading} rows or "
        f"with a whole number of positions per row ({', '.join(took)}) and left "
        f"{', '.join(left)} as they are; give a batch whose tensors all lead with the batch "
        "dimension (or flatten per-row positions, [rows * T], beside a tensor [rows, T])"
    )


def batch_rows(value: Any) -> int | None:
    """The rows of a batch: its first tensor's first dimension (None: it holds none)."""
    if isinstance(value, Tensor):
        return value.shape[0] if value.dim() else None
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(value, (Mapping, tuple, list)):
        for v in items:
            found = batch_rows(v)
            if found is not None:
                return found
    return None


def _under(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def _rules(options: Mapping[str, str]) -> dict[str, str]:
    return {path_rule(path): option for path, option in options.items() if option != "keep"}


def plan_activations(options: Mapping[str, str]) -> ActivationRules | None:
    """The rules a plan carries for each block's option (None: every block keeps)."""
    rules = _rules(options)
    return ActivationRules(rules) if rules else None


def block_rows(s: SearchInputs, reference: nn.Module) -> tuple[list[BlockRow], int]:
    """A row per block with each option's bytes, damage and seconds at the search's
    ``batch_size`` (see the module's docstring; none without one), and the bytes saved
    outside the blocks (with ``keep``). `reference`: the float32 model the formats are
    scored on."""
    if s.batch_size is None:
        return [], 0
    model, base, batches, loss_fn = s.model, s.base, s.batches, s.loss_fn
    lr, reps, device, seed = s.lr, s.reps, s.device, s.seed
    modules = dict(model.named_modules())
    blocks = find_blocks(model)
    rows = [BlockRow(path=b, kind=type(modules[b]).__name__) for b in blocks]
    options = searched_options(device)
    shared = _shared_with_outside(model, blocks)
    for row in rows:
        for option in options:
            reason = refusal(modules[row.path], option)
            if reason is None and option != "keep" and row.path in shared:
                reason = shared[row.path]
            if reason is not None:
                row.not_applicable[option] = reason
        row.not_applicable.update(NOT_SEARCHED)
    big = batch_at(batches[0], s.batch_size)
    try:  # (the first step at the batch: a tensor left at its rows fails here)
        kept = _saved(model, base, {}, big, loss_fn, device, seed)
    except Exception as error:
        left = batch_left(batches[0], s.batch_size)
        if left is None:
            raise
        raise ValueError(f"{left}. The step at that batch raised: {error}") from error
    whole = sum(kept.values())
    outside = sum(n for p, n in kept.items() if not any(_under(p, b) for b in blocks))
    for r in rows:
        r.options["keep"] = Option(bytes=sum(n for p, n in kept.items() if _under(p, r.path)))
    rows = [r for r in rows if r.options["keep"].bytes > 0]
    for option in options:
        for r in rows:
            if option == "keep" or option in r.not_applicable:
                continue
            alone = sum(_saved(model, base, {r.path: option}, big, loss_fn, device, seed).values())
            r.options[option] = Option(bytes=max(0, r.options["keep"].bytes + alone - whole))
    _damages(reference, rows, batches, loss_fn, lr=lr, device=device, seed=seed)
    _times(reference, rows, batches[0], loss_fn, reps=reps, device=device, seed=seed)
    return rows, outside


def _shared_with_outside(model: nn.Module, blocks: list[str]) -> dict[str, str]:
    """Why each block holding a module also reachable outside it (a norm or a rotary table
    shared by all blocks) takes no option but keep: an option follows the module tree, and
    the shared module would take two."""
    paths: dict[int, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(path)
    out = {}
    for block in blocks:
        for where in paths.values():
            inside = [p for p in where if _under(p, block)]
            outside = [p for p in where if not _under(p, block)]
            if inside and outside:
                out[block] = (
                    f"holds {inside[0]}, also reachable at {outside[0]}: a shared module "
                    "would take two options"
                )
                break
    return out


def layer_activations(s: SearchInputs, rows: list[UnitRow], blocks: list[BlockRow]) -> None:
    """Each layer's `Option.activation_bytes` in each format (see `Option`): how much more
    the model saves at the search's batch with every layer that takes the format in it than
    in the baseline, each module's growth given to the layer it is or follows (a GELU after
    a Linear saves its input in the Linear's output dtype), from the modules' first calls in
    order, and a module holding layers (a block's own ops, the model's loss) to the last
    layer in it; a module saving less counts 0. The blocks' rows count in the baseline's
    dtypes, so a plan keeping a block whose layers moved to float32 is counted at about what
    it saves (exactly, for every layer in one format); a recomputed block's layers count
    their growth too, over what the block saves (never under)."""
    if s.batch_size is None or not rows:
        return
    big = batch_at(s.batches[0], s.batch_size)
    precision = Precision("32-true", device=s.device)
    with seeded(s.seed, s.device):  # (the caller's generators as they were)
        order = _first_calls(s.model, lambda m: batch_loss(precision, m, fresh(big), s.loss_fn))
    paths = [r.unit.paths + r.unit.aliases for r in rows]
    owner: dict[str, int] = {}  # module path -> the row its saved bytes are given to
    last = None
    for path in order:
        own = next((i for i, ps in enumerate(paths) if any(_under(path, p) for p in ps)), None)
        last = own if own is not None else last
        if last is not None:
            owner[path] = last
    # a module holding layers (a block, the model itself) saves what its own forward
    # computes around them, mostly after them: its growth goes to the last layer in it
    for path in order:
        inside = [
            owner[p] for p in order if p in owner and p != path and (not path or _under(p, path))
        ]
        mine = path in owner and any(_under(path, q) for q in paths[owner[path]])
        if inside and not mine:
            owner[path] = inside[-1]

    def saved(policy: PolicyMap) -> dict[str, int]:
        return saved_under(s.model, policy, big, s.loss_fn, s.device, s.seed)

    base = saved(PolicyMap(s.base))
    for name in s.names:
        if name == s.base.name or not any(name in r.options for r in rows):
            continue
        rules = {
            path_rule(p): name
            for r, ps in zip(rows, paths, strict=True)
            if name in r.options
            for p in ps
        }
        grown = [0] * len(rows)
        for path, n in saved(PolicyMap(s.base, rules)).items():
            if path in owner:  # (a module saving less gives nothing back: a block's option
                # may already count that saving, as a checkpoint's does)
                grown[owner[path]] += max(0, n - base.get(path, 0))
        for r, more in zip(rows, grown, strict=True):
            if name in r.options:
                r.options[name].activation_bytes = more


def _first_calls(model: nn.Module, run: Any) -> list[str]:
    """The paths of `model`'s modules in the order of their first call in ``run(model)``
    (a copy of it, without gradients)."""
    model = copy.deepcopy(model).train()
    order: list[str] = []
    handles = [
        m.register_forward_pre_hook(lambda *_, path=path: order.append(path))
        for path, m in model.named_modules()
    ]
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    return list(dict.fromkeys(order))


def _saved(
    model: nn.Module,
    base: Policy,
    options: dict[str, str],
    batch: Any,
    loss_fn: Any,
    device: torch.device,
    seed: int,
) -> dict[str, int]:
    """Bytes saved per module path in one training forward (and loss) of `model` in the
    baseline policy with `options` on its blocks."""
    policy = PolicyMap(base, activations=_rules(options) or None)
    return saved_under(model, policy, batch, loss_fn, device, seed)


def saved_under(
    model: nn.Module,
    policy: PolicyMap,
    batch: Any,
    loss_fn: Any,
    device: torch.device,
    seed: int,
) -> dict[str, int]:
    """Bytes saved per module path in one training forward (and loss) of `model` converted
    to `policy` (its formats and activation options): a plan's own count, in the dtypes its
    layers compute in."""
    converted = copy.deepcopy(model).train()
    apply(converted, policy, warn=False)
    precision = Precision(policy, device=device, allow_slow=True)
    given = fresh(batch)  # (alive outside the forward, as the batch is: not counted)
    with seeded(seed, device):
        return saved_bytes_of(
            converted, lambda: batch_loss(precision, converted, given, loss_fn), given
        )


def split_saved(saved: Mapping[str, int], blocks: Sequence[str]) -> tuple[int, int]:
    """The bytes of `saved` (per module path) under the `blocks`' paths, and outside them."""
    inside = sum(n for p, n in saved.items() if any(_under(p, b) for b in blocks))
    return inside, sum(saved.values()) - inside


def _grads(model: nn.Module, precision: Precision, batch: Any, loss_fn: Any) -> Tensor:
    """The gradients of every trainable parameter, flat, float64; a complex one over its
    real and imaginary parts (``.double()`` would drop the imaginary part)."""
    loss = batch_loss(precision, model, fresh(batch), loss_fn)
    backward(precision, loss)
    grads = (
        p.grad if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
        if p.requires_grad
    )
    flat = [(torch.view_as_real(g) if g.is_complex() else g).reshape(-1).double() for g in grads]
    model.zero_grad(set_to_none=True)
    return torch.cat(flat)


class _Installed:
    """`option` on `path` of `model` while inside: the wrappers `install` puts on, taken
    off again on leaving."""

    def __init__(self, model: nn.Module, path: str, option: str) -> None:
        self.model, self.path, self.option = model, path, option

    def __enter__(self) -> None:
        rules = ActivationRules({path_rule(self.path): self.option})
        install(self.model, rules.resolve(self.model))

    def __exit__(self, *exc: object) -> None:
        for module in self.model.modules():
            forward = module.__dict__.get("forward")
            if isinstance(forward, ActivationForward):
                if forward.original is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = forward.original


def _damages(
    reference: nn.Module,
    rows: list[BlockRow],
    batches: Sequence[Any],
    loss_fn: Any,
    *,
    lr: float,
    device: torch.device,
    seed: int,
) -> None:
    """Each lossy storage option's damage (the module's docstring), written into `rows`."""
    precision = Precision("32-true", device=device)
    totals: dict[tuple[int, str], float] = {}
    for batch in batches:
        with seeded(seed, device):
            exact = _grads(reference, precision, batch, loss_fn)
        for i, row in enumerate(rows):
            for option in ("bf16", "fp8"):
                if option not in row.options:
                    continue
                with _Installed(reference, row.path, option), seeded(seed, device):
                    stored = _grads(reference, precision, batch, loss_fn)
                change = lr * abs(float(torch.dot(exact, stored - exact)))
                totals[(i, option)] = totals.get((i, option), 0.0) + change
    for (i, option), total in totals.items():
        rows[i].options[option].damage = total / len(batches)


def _inputs(model: nn.Module, paths: list[str], run: Any) -> dict[str, tuple[tuple, dict]]:
    """The args and kwargs each block at `paths` is first called with in ``run()``."""
    modules = dict(model.named_modules())
    seen: dict[str, tuple[tuple, dict]] = {}
    handles = []

    def hook_for(path: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if path not in seen:
                seen[path] = (
                    tuple(a.detach().clone() if isinstance(a, Tensor) else a for a in args),
                    {
                        k: v.detach().clone() if isinstance(v, Tensor) else v
                        for k, v in kwargs.items()
                    },
                )

        return hook

    try:
        for path in paths:
            handles.append(
                modules[path].register_forward_pre_hook(hook_for(path), with_kwargs=True)
            )
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _floating(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value] if value.is_floating_point() and value.requires_grad else []
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _floating(v)]
    return []


def _step_seconds(block: nn.Module, args: tuple, kwargs: dict) -> float:
    args = tuple(
        a.detach().requires_grad_() if isinstance(a, Tensor) and a.is_floating_point() else a
        for a in args
    )
    start = time.perf_counter()
    outs = _floating(block(*args, **kwargs))
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    seconds = time.perf_counter() - start
    block.zero_grad(set_to_none=True)
    return seconds


def _times(
    reference: nn.Module,
    rows: list[BlockRow],
    batch: Any,
    loss_fn: Any,
    *,
    reps: int,
    device: torch.device,
    seed: int,
) -> None:
    """Each option's median seconds of its block's forward and backward alone (one untimed
    round first, the options taking turns), written into `rows`."""
    precision = Precision("32-true", device=device)
    with seeded(seed, device):
        inputs = _inputs(
            reference,
            [r.path for r in rows],
            lambda: batch_loss(precision, reference, fresh(batch), loss_fn),
        )
    modules = dict(reference.named_modules())
    for row in rows:
        if row.path not in inputs:
            continue
        args, kwargs = inputs[row.path]
        copies = {}
        for option in row.options:
            block = copy.deepcopy(modules[row.path]).train()
            install(block, ActivationRules(option).resolve(block))
            copies[option] = block
        times: dict[str, list[float]] = {o: [] for o in copies}
        with seeded(seed, device):
            for rep in range(reps + 1):
                for option, block in copies.items():
                    seconds = _step_seconds(block, args, kwargs)
                    if rep:
                        times[option].append(seconds)
        for option, t in times.items():
            row.options[option].seconds = statistics.median(t)


def extra_seconds(row: BlockRow, option: str) -> float:
    """What `option` adds to the block's step over ``keep``, as the tie between plans
    weighs it: the measured difference, and never less than `TIE_FLOOR` for an option other
    than ``keep`` (one measured as fast is noise, or free in time but not in risk: keeping
    wins a tie)."""
    if option == "keep":
        return 0.0
    return max(row.options[option].seconds - row.options["keep"].seconds, TIE_FLOOR)


def tie_costs(rows: Sequence[BlockRow], names: Sequence[Sequence[str]]) -> list[list[float]]:
    """What each option (``names[i]`` of ``rows[i]``) counts in a tie between plans of equal
    damage: 0 for keep; else the rank of its extra seconds among every block's options, with
    extras below `TIE_NOISE` of keep's counted as the least and extras within `TIE_RATIO` of
    the next smaller one as its rank. Noise decides nothing: equal ranks are equal costs,
    which the solver breaks in its fixed order."""
    extras = [
        [
            TIE_FLOOR
            if o != "keep" and extra_seconds(r, o) <= TIE_NOISE * r.options["keep"].seconds
            else extra_seconds(r, o)
            for o in opts
        ]
        for r, opts in zip(rows, names, strict=True)
    ]
    rank, ranks, previous = 0, {0.0: 0}, 0.0
    for e in sorted({e for row in extras for e in row} - {0.0}):
        if rank == 0 or e > TIE_RATIO * previous:
            rank += 1
        ranks[e], previous = rank, e
    return [[float(ranks[e]) for e in row] for row in extras]


def tie_weight(damages: Sequence[float], tie_costs: Sequence[float]) -> float:
    """The weight that turns tie costs (`tie_costs`, the largest of each block's) into
    damage: small enough that all of it together stays below a tenth of the least positive
    damage, so time decides only between plans of (nearly) equal damage; 1 when no damage
    is positive."""
    positive = [d for d in damages if d > 0]
    total = sum(s for s in tie_costs if s > 0)
    if not positive or total <= 0:
        return 1.0
    return min(positive) / (10 * total)
