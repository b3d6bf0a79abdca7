"""`shard`: a mixprec policy (or map) carried over to FSDP2 (`fully_shard`) for any loop.

FSDP2 does its own casting: each sharded unit all-gathers its parameters in `param_dtype`,
casts its inputs to it and reduce-scatters gradients in `reduce_dtype`. `shard` derives those
settings per unit from the policy `PolicyMap.resolve` gives the unit, so a mixed policy keeps
float32 masters (the sharded parameters) and computes in 16 bit, and float32 islands stay in
float32. Quantized rules swap their layers first, as `apply` does; FSDP2 then shards what
stays float (biases, LoRA adapters, float8 weights) and replicates the quantized buffers.
It also refuses the set-ups that would fail late or silently (see `shard`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mixprec.activations import check as check_activations
from mixprec.activations import check_device
from mixprec.activations import install as install_activations
from mixprec.activations import wrapped as wrapped_activations
from mixprec.convert import (
    applied_policy,
    cast_buffer,
    cast_floating,
    check_scales,
    device_slow_attention,
    hook_loads,
    install_attention_islands,
    sharded_units,
    warn_unmatched,
)
from mixprec.eager import compiled_wrapper
from mixprec.errors import PolicySpecError, PrecisionError
from mixprec.hardware import check, device_of
from mixprec.optim import check_sharded_masters
from mixprec.optim.scaling import LossScaler
from mixprec.policy import Policy
from mixprec.policy.map import ISLAND_TYPES, as_map, check_bypassed, island_policy
from mixprec.quantize import QuantizeResult, quantize_modules
from mixprec.quantize.int8 import CodeCasts
from mixprec.quantize.rules import weights_read_by_parents

__all__ = [
    "quantize_for",
    "shard",
    "units",
]

WrapFn = Callable[[str, nn.Module], bool]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _default_units(model: nn.Module) -> list[str]:
    """Transformer-block-like units: the children holding parameters of the root (when it is
    a ModuleList/Sequential) and of its ModuleList/Sequential children."""
    containers = [("", model)] if isinstance(model, (nn.ModuleList, nn.Sequential)) else []
    containers += [
        (name, child)
        for name, child in model.named_children()
        if isinstance(child, (nn.ModuleList, nn.Sequential))
    ]
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, container in containers
        for name, child in container.named_children()
        if _has_params(child)
    ]


def quantize_for(model: nn.Module, policy: Any) -> QuantizeResult:
    """Swap the modules whose rule under `policy` is quantized for quantized layers, in
    place, as `apply` does (what a sharded run's model holds); a no-op without such rules."""
    resolved = as_map(policy).resolve(model)
    to_quantize = {name: r.policy for name, r in resolved.items() if r.quantized}
    return quantize_modules(model, to_quantize)  # type: ignore[arg-type]


def _dequantizes_in_its_storage(module: nn.Module) -> bool:
    """A quantized embedding: its rows come out in its scales' dtype (the param dtype), as
    nothing tells it the compute dtype when FSDP2 rather than autocast does the casting."""
    return isinstance(getattr(module, "quantization_mode", None), str) and issubclass(
        getattr(module, "float_type", type(None)), nn.Embedding
    )


def units(model: nn.Module, policy: Any, wrap: WrapFn | None = None) -> dict[str, Policy]:
    """The modules `shard` shards on their own, innermost first and the root ("") last, with
    the policy each is sharded under.

    Units are the `wrap(name, module)` hits (default: the blocks of top-level ModuleLists and
    Sequentials), plus every module whose policy computes in another dtype than its parent's
    (float32 islands, rules): FSDP2 casts per unit, so a different compute dtype needs one,
    as does a different storage dtype (a unit's parameters are stored in one dtype); a
    container without a forward (a ModuleList a rule names) stands for its children.
    A quantized embedding under a mixed policy computes in its param dtype (its scales'), so
    it is such a unit too, and hands its rows back in its parent's compute dtype. Call it on
    the model as `shard` sees it: quantized by `quantize_for`."""
    resolved = as_map(policy).resolve(model)
    chosen = (
        {name for name, m in model.named_modules() if name and wrap(name, m)}
        if wrap is not None
        else set(_default_units(model))
    )
    policies = {name: r.policy for name, r in resolved.items()}
    for name, module in model.named_modules():
        here = policies[name]
        if (
            isinstance(module, nn.modules.batchnorm._BatchNorm)
            and here.is_mixed
            and here.compute_dtype != torch.float32
        ):
            # under autocast a BatchNorm takes 16-bit inputs beside its float32 weight and
            # statistics; FSDP2 would gather its weight in 16 bits beside float32 statistics,
            # which its kernel refuses: a float32 unit of its own
            policies[name] = island_policy(here)
            continue
        if _dequantizes_in_its_storage(module) and here.compute_dtype != here.param_dtype:
            policies[name] = Policy(
                param_dtype=here.param_dtype,
                compute_dtype=here.param_dtype,
                output_dtype=here.output_dtype,
            )
    for name, _ in model.named_modules():
        parent = name.rpartition(".")[0]
        here, there = policies[name], policies[parent]
        # (a unit's parameters are stored in one dtype: FSDP2 refuses a mix at the first
        # forward, so a rule changing only the storage dtype makes a unit too)
        if name and (
            here.compute_dtype != there.compute_dtype or here.param_dtype != there.param_dtype
        ):
            chosen.add(name)
    # a container without a forward of its own (ModuleList, ModuleDict) is not a unit FSDP2
    # can shard (its parent calls its children): its children are, each under its policy
    modules = dict(model.named_modules())
    containers = [n for n in chosen if type(modules[n]).forward is nn.Module.forward]
    while containers:
        name = containers.pop()
        chosen.discard(name)
        held = [key for key, p in modules[name]._parameters.items() if p is not None]
        if held and policies[name].param_dtype != policies[name.rpartition(".")[0]].param_dtype:
            raise PolicySpecError(
                f"the rule on {name!r} ({type(modules[name]).__name__}) stores its parameters "
                f"({', '.join(held)}) in {policies[name].param_dtype}, apart from its parent's, "
                "but it has no forward of its own to shard as a unit (its parent's forward "
                "uses them, and FSDP2 keeps one storage dtype a unit): put the rule on the "
                "parent"
            )
        for child, module in modules[name].named_children():
            path = f"{name}.{child}"
            chosen.add(path)
            if type(module).forward is nn.Module.forward:
                containers.append(path)
    in_model_order = [name for name in resolved if name in chosen]
    ordered = sorted(in_model_order, key=lambda n: -n.count("."))  # stable: deepest first
    return {name: policies[name] for name in [*ordered, ""]}


class _UnitAutocast:
    """Stands in for an FSDP2 unit's `forward`. FSDP2 casts the unit's parameters and inputs
    to its compute dtype, with no autocast of its own; but a caller may run the model under
    autocast (the Trainer's step, a loop written for one device), which would compute a
    float32 unit's matmuls (a rule's head, an island) in 16 bits over FSDP2's casts. Under
    such an autocast the unit runs in its own compute dtype: autocast off for a float32
    unit, autocast in its dtype for a 16-bit one (whose float32 buffers it still casts);
    without one, as it is."""

    mixprec_wrapper = True  # (keeps the forward it replaced as `original`)

    def __init__(self, module: nn.Module, dtype: torch.dtype, device_type: str, original: Any):
        self.module = module
        self.dtype = dtype
        self.low = dtype in (torch.bfloat16, torch.float16)
        self.device_type = device_type
        self.original = original

    @property
    def __signature__(self) -> inspect.Signature:
        if self.original is not None:
            return inspect.signature(self.original)
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.original is None:  # the class's function, as mixprec's regions call it
            args = (self.module, *args)
            forward = type(self.module).forward
        else:
            forward = self.original
        device = self.device_type
        if not torch.is_autocast_enabled(device) or (
            self.low and torch.get_autocast_dtype(device) == self.dtype
        ):
            return forward(*args, **kwargs)
        if self.low:
            with torch.autocast(device, dtype=self.dtype):
                return forward(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return forward(*args, **kwargs)


def default_reduce_dtype(policy: Policy) -> torch.dtype:
    """The dtype a unit stored under `policy` reduce-scatters its gradients in when none is
    given: float32, or the parameters' dtype where it is wider (float64 under "64-true",
    whose gradients float32 would round)."""
    stored = policy.param_dtype
    if stored.is_floating_point and torch.finfo(stored).bits > 32:
        return stored
    return torch.float32


def mixed_precision_policy(
    policy: Policy, *, enclosing: Policy | None, reduce_dtype: torch.dtype | None = None
) -> MixedPrecisionPolicy:
    """FSDP2's settings for one unit computing under `policy` inside a unit computing under
    `enclosing` (None: the root); gradients reduced in `reduce_dtype` (None:
    `default_reduce_dtype`).

    Parameters are all-gathered in the compute dtype; inputs are cast to it by `shard`'s own
    hook (`_cast_inputs`), not FSDP2's plain cast, which made a mask's float32 lowest value an
    infinity (a padded row's softmax NaN). Only the root casts its
    output to the policy's output dtype; an inner unit hands its output back in the dtype its
    enclosing unit computes in (nothing, when that is its own), since the enclosing unit's own
    layers take it uncast: a float32 output there fails as "mixed dtype (CPU)"."""
    if enclosing is None:
        output = policy.output_dtype
    elif enclosing.compute_dtype != policy.compute_dtype:
        output = enclosing.compute_dtype
    else:
        output = None
    return MixedPrecisionPolicy(
        param_dtype=policy.compute_dtype,
        reduce_dtype=default_reduce_dtype(policy) if reduce_dtype is None else reduce_dtype,
        output_dtype=output,
        cast_forward_inputs=False,
    )


def _cast_inputs(dtype: torch.dtype) -> Any:
    """A forward pre-hook casting a unit's floating inputs to `dtype` as FSDP2 would, but a
    mask's lowest value to `dtype`'s lowest, not an infinity (`convert.cast_floating`)."""

    def hook(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return hook


def _check_ready(
    model: nn.Module,
    pmap: Any,
    optimizer: torch.optim.Optimizer | None,
    scaler: LossScaler | None,
    mesh: DeviceMesh | None,
    master_weights: bool | None,
    reduce_dtype: Any,
) -> None:
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be None (the default process group) or a torch DeviceMesh, got "
            f"{type(mesh).__name__}"
        )
    if reduce_dtype is not None and (
        not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point
    ):
        raise TypeError(
            f"reduce_dtype must be None (the default) or a floating torch.dtype "
            f"(torch.float32, torch.bfloat16), got {reduce_dtype!r}"
        )
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    if isinstance(model, wrappers) or compiled_wrapper(model):
        raise PrecisionError(
            f"shard got a {type(model).__name__} wrapper: its rules would see paths under "
            "'module.'/'_orig_mod.' and its blocks would not be units. Pass the plain model "
            "(model.module): FSDP2 replaces DDP, and torch.compile goes after sharding"
        )
    sharded = sharded_units(model)
    if sharded:
        raise PrecisionError(
            f"the model is already sharded by FSDP2 ({', '.join(sharded)}): FSDP2 shards a "
            "module once; build a fresh model and shard it once, under the policy you want"
        )
    converted = [
        name or "<root>" for name, m in model.named_modules() if applied_policy(m) is not None
    ]
    if converted:
        raise PrecisionError(
            f"the model was converted by mixprec.apply ({', '.join(converted)}): FSDP2 casts "
            "per unit from the policy shard gives it; pass the unconverted model, or call "
            "mixprec.remove(model) first"
        )
    if optimizer is not None:
        mine = {id(p) for p in model.parameters()}
        if any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            raise PrecisionError(
                f"this {type(optimizer).__name__} was built before sharding: it holds the "
                "model's unsharded parameters, which fully_shard replaces, so it would never "
                "train the model. Build it after: model, optimizer = shard(model, policy, "
                "optimizer_factory=lambda params: torch.optim.AdamW(params, lr=...))"
            )
    check_sharded_masters(
        {r.policy.param_dtype for r in pmap.resolve(model).values()},
        master_weights=master_weights,
        compensation=None,
        setup=f"shard(model, {pmap.name!r})",
    )
    if pmap.needs_loss_scaling and (not isinstance(scaler, LossScaler) or not scaler.enabled):
        raise PrecisionError(
            f"precision {pmap.name!r} computes in float16 and needs loss scaling whose "
            "overflow flag is all-reduced, so that every rank skips a step together: pass "
            "scaler=DynamicLossScaler() (mixprec.optim.scaling; synchronize() all-reduces the "
            "flag) "
            "and step through LossScaleOptimizer(optimizer, scaler), or pass "
            "scaler=Precision('16-mixed').scaler"
        )
    if reduce_dtype == torch.float16 and (not isinstance(scaler, LossScaler) or not scaler.enabled):
        raise PrecisionError(
            "reduce_dtype=torch.float16 sums gradients in float16, where they overflow past "
            "65504 and flush to zero under 6e-8, and without a loss scaler nothing checks or "
            "scales them: reduce in torch.float32 or torch.bfloat16, or pass "
            "scaler=DynamicLossScaler() (mixprec.optim.scaling) and step through "
            "LossScaleOptimizer(optimizer, scaler)"
        )
    if mesh is None and not (dist.is_available() and dist.is_initialized()):
        raise PrecisionError(
            "shard needs torch.distributed: call dist.init_process_group(...) first (gloo on "
            "CPU, nccl on GPUs; torchrun sets the rank and world size), or pass mesh=..."
        )
    if mesh is not None and dist.is_initialized() and mesh.get_coordinate() is None:
        raise PrecisionError(
            f"rank {dist.get_rank()} is not in the mesh given ({mesh.size()} of the "
            f"{dist.get_world_size()} processes): it would shard over nothing. Give every "
            "process a mesh it belongs to (init_device_mesh(device, (world_size,)), or a "
            "sub-mesh of its own data-parallel group)"
        )


def _unit_of(name: str, plan: dict[str, Policy]) -> str:
    """The unit `name` is sharded in: itself or its nearest enclosing unit ("" the root)."""
    while name and name not in plan:
        name = name.rpartition(".")[0]
    return name


def _check_units_apart(model: nn.Module, plan: dict[str, Policy]) -> None:
    """Refuse, before the model changes, what FSDP2 cannot shard in separate units: one
    parameter held by modules of two units (tied weights whose modules the map rules apart:
    FSDP2 manages a parameter in one unit), and a layer sharded apart from the parent whose
    forward reads its weight itself (the parent would see the sharded parameter)."""
    owners: dict[int, tuple[str, str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for key, param in module._parameters.items():
            if param is None:
                continue
            where = (_unit_of(name, plan), f"{name}.{key}" if name else key)
            first = owners.setdefault(id(param), where)
            if first[0] != where[0]:
                units = f"{first[0] or '<root>'!r} and {where[0] or '<root>'!r}"
                if plan[first[0]] == plan[where[0]]:  # (units, not rules, split them)
                    why = (
                        f"{units}, of one policy: the units chosen, by `wrap=` or by default "
                        "the blocks of top-level ModuleLists and Sequentials); FSDP2 keeps a "
                        "parameter in one unit. Give `wrap=` units that hold both modules (or "
                        "neither: they then shard with their common parent)"
                    )
                else:
                    why = (
                        f"{units}: their rules differ); FSDP2 keeps a parameter in one unit. "
                        "Give both modules the same rule, or rule the module holding both"
                    )
                raise PolicySpecError(
                    f"{first[1]!r} and {where[1]!r} are one parameter (tied), but shard in "
                    f"different units ({why}"
                )
    read = weights_read_by_parents(model)
    for name, module in model.named_modules():
        if name and id(module) in read and name in plan:
            parent = name.rpartition(".")[0]
            if _unit_of(parent, plan) != name:
                raise PolicySpecError(
                    f"{name!r} shards in a unit of its own, but its parent "
                    f"{parent or '<root>'!r} ({read[id(module)]}) reads its weight in its own "
                    "forward, where that weight would be a shard; give it its parent's rule "
                    f"(or rule the parent instead){_island_hint(module)}"
                )


def _island_hint(module: nn.Module) -> str:
    """What to add to a refusal naming a module that may be a float32 island no rule of the
    user's made: how to keep it in its parent's policy."""
    if not isinstance(module, ISLAND_TYPES):
        return ""
    return (
        f" (a {type(module).__name__} is a float32 island under a mixed policy by default: "
        "PolicyMap(..., float32_islands=False), or a rule giving it its parent's policy)"
    )


def _check_selective_apart(choices: dict[str, Any], plan: dict[str, Policy]) -> None:
    """Refuse, before the model changes, `selective` on a module holding two FSDP2 units or
    more below it (a block holding two float32 islands, the root holding the blocks): the
    units' profiler records in its recomputation do not line up with its forward's, and the
    first backward failed inside torch's selective checkpoint ("invocation index ... not
    found in storage"). One unit below (a block with one island) recomputes exactly."""
    for name, (option, _) in choices.items():
        parent = name.rpartition(".")[0] if name else None
        if option != "selective" or (parent is not None and choices[parent][0] == "selective"):
            continue
        inside = [u for u in plan if u != name and (not name or u.startswith(name + "."))]
        if len(inside) > 1:
            raise PolicySpecError(
                f"activation option 'selective' on {name or '<root>'!r} would recompute "
                f"{len(inside)} FSDP2 units inside it ({', '.join(map(repr, inside))}), "
                "which torch's selective checkpoint cannot replay under FSDP2 (the first "
                "backward fails): use 'checkpoint' there, or 'selective' on modules holding "
                "one unit or none (each block, the layers below its islands)"
            )


def _check_ranks_agree(
    pmap: Any, plan: dict[str, Policy], reduce_dtype: torch.dtype, mesh: DeviceMesh | None
) -> None:
    """Refuse a run whose ranks shard under different policies: their collectives would
    exchange tensors of different dtypes and sizes (gloo aborts the process, NCCL may hang or
    mix bytes). One all-gather of a small description per rank, at set-up only."""
    group = mesh.get_group() if mesh is not None and mesh.ndim == 1 else None
    mine = (pmap.name, {unit: policy.name for unit, policy in plan.items()}, str(reduce_dtype))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    differ = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        raise PrecisionError(
            f"the ranks shard under different policies: rank 0 has {everyone[0][0]!r} "
            f"(units {everyone[0][1]}), rank {differ[0]} has {everyone[differ[0]][0]!r} "
            f"(units {everyone[differ[0]][1]}); every rank must shard the same model under "
            "the same policy"
        )


def shard(
    model: nn.Module,
    policy: Any,
    *,
    mesh: DeviceMesh | None = None,
    wrap: WrapFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    scaler: LossScaler | None = None,
    reduce_dtype: torch.dtype | None = None,
    master_weights: bool | None = None,
    allow_slow: bool = False,
) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Shard `model` in place with FSDP2 under `policy` (a spec, Policy or PolicyMap) and
    return it, or `(model, optimizer)` when `optimizer_factory` is given.

    Quantized rules (int8, int4, float8) first swap their layers (`quantize_for`, as `apply`
    does), and the map's activation options go on the model (as `apply` puts them; refused
    first as it refuses them); then each unit (see `units`) is sharded with
    `mixed_precision_policy`, then the root. A mixed policy keeps the sharded parameters in
    their param dtype (float32 masters) and computes in its compute dtype; a "true" policy's
    storage (parameters, floating buffers but float8's float32 delayed scales) is cast
    before sharding, as FSDP2 keeps the dtype it finds. Gradients are reduced in
    `reduce_dtype`; by default float32, or a unit's parameter dtype where wider (float64).

    Raises `PrecisionError` before touching the model when torch.distributed is not
    initialised (and no `mesh` is given); when `optimizer` holds the model's unsharded
    parameters (build it after sharding: `optimizer_factory(params)` does); when the policy
    computes in float16 and `scaler` is not an enabled mixprec `LossScaler`, whose
    `synchronize` all-reduces the overflow flag; when the policy stores parameters that the
    `LossScaleOptimizer` to step them would give float32 masters (`master_weights` is its
    setting: by default float16 ones, so "16-true" is refused unless
    ``master_weights=False``; `optim.check_sharded_masters`); and, as `Precision` does, when
    the policy is slow on the model's device unless `allow_slow` (or
    ``MIXPREC_ALLOW_SLOW=1``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard needs an nn.Module first, got {type(model).__name__}")
    if master_weights not in (None, True, False):
        raise TypeError(f"master_weights must be None, True or False, got {master_weights!r}")
    pmap = as_map(policy)
    _check_ready(model, pmap, optimizer, scaler, mesh, master_weights, reduce_dtype)
    check(pmap, device_of(model), allow_slow=allow_slow)
    warn_unmatched(pmap, model)
    if pmap.activations is not None:  # (refused before the model changes)
        check_activations(model, pmap.activation_choices(model))
        check_device(pmap.activations.options, device_of(model).type)
    carried = wrapped_activations(model)
    if carried:  # (shard would wrap them again: every recomputation done twice)
        raise PolicySpecError(
            f"the model carries activation options already ({carried}, put on by "
            "mixprec.activations.install); shard puts on those of its policy: give it a "
            "model without them, and the options as the policy map's activations"
        )
    before = pmap.resolve(model)
    check_bypassed(model, before)  # (MultiheadAttention's out_proj, as apply)
    check_scales(model, before)  # (scales of layers quantized already: as apply)
    _check_units_apart(model, units(model, pmap, wrap))
    if pmap.activations is not None:
        _check_selective_apart(pmap.activation_choices(model), units(model, pmap, wrap))
    quantize_for(model, pmap)
    plan = units(model, pmap, wrap)
    _check_ranks_agree(pmap, plan, reduce_dtype, mesh)
    device = device_of(model)
    resolved = pmap.resolve(
        model, slow_attention=device_slow_attention(device), device_type=device.type
    )
    casts, done = CodeCasts(), {}  # (codes and buffers shared by two layers stay shared)
    with torch.no_grad():  # FSDP2 keeps the storage dtype it finds: cast it first
        for name, module in model.named_modules():
            stored = resolved[name].policy.param_dtype
            for p in module.parameters(recurse=False):
                if p.is_floating_point() and p.dtype != stored:
                    p.data = p.data.to(stored)
            stored = resolved[name].policy.buffer_dtype
            fixed = getattr(module, "fixed_dtype_buffers", ())  # float8 delayed scales
            for key, b in module._buffers.items():
                if b is None or not b.is_floating_point() or key in fixed:
                    continue
                if b.dtype != stored:
                    cast_buffer(module, key, stored, casts, done)
    hook_loads(model)  # (a full checkpoint loaded after: cast as these were, masks finite)
    # each unit in its own compute dtype under an autocast its caller enters (innermost)
    modules = dict(model.named_modules())
    for name, unit_policy in plan.items():
        unit = modules[name]
        unit.__dict__["forward"] = _UnitAutocast(
            unit, unit_policy.compute_dtype, device.type, unit.__dict__.get("forward")
        )
        unit.register_forward_pre_hook(_cast_inputs(unit_policy.compute_dtype), with_kwargs=True)
    # attention in float32 where the map (or, left to it, the device) asks: FSDP2 casts
    # parameters and inputs, and the caller may run autocast or not
    install_attention_islands(model, resolved, either=True)
    if pmap.activations is not None:  # inside FSDP2's hooks, which gather a recomputed unit
        install_activations(model, pmap.activation_choices(model))
    for name, unit_policy in plan.items():
        enclosing = None
        if name:
            up = name.rpartition(".")[0]
            while up and up not in plan:
                up = up.rpartition(".")[0]
            enclosing = plan[up]
        fully_shard(
            modules[name],
            mesh=mesh,
            mp_policy=mixed_precision_policy(
                unit_policy, enclosing=enclosing, reduce_dtype=reduce_dtype
            ),
        )
    if optimizer_factory is not None:
        return model, optimizer_factory(model.parameters())
    return model
