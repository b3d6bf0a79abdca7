"""A low-bit optimizer's moments as tensors: a parameter's local part (the shard of an
FSDP2 DTensor) and real view (a complex one's pairs), a moment made zero, stored in a state
format from float32 or read back to float32, and the DTensor layouts a sharded parameter's
states take (every rank's codes padded to the largest shard's blocks, so that
`torch.distributed.checkpoint` saves each rank's part)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from mixprec.optim.states.formats import StateFormat, code_tables, decode, encode

__all__ = ["shards_of"]

# tensor types that are never a DTensor
PLAIN = (torch.Tensor, torch.nn.Parameter)
# the per-parameter moments of each algorithm and whether each is signed
MOMENTS = {"adam": (("exp_avg", True), ("exp_avg_sq", False)), "sgd": (("momentum_buffer", True),)}


def dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (the tensor itself otherwise)."""
    if type(t) in PLAIN:  # (the common case, asked dozens of times a step)
        return t
    dtensor = dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def real_view(t: torch.Tensor) -> torch.Tensor:
    """The local part of ``t``, a complex one viewed as its real pairs (as torch's
    optimizers step a complex parameter, its gradient and its moments)."""
    local = local_part(t)
    return torch.view_as_real(local) if local.is_complex() else local


def elements_of(p: torch.Tensor) -> int:
    """Real elements of the largest local shard of ``p`` (two per complex element): those
    its low-bit moments hold, in blocks."""
    return largest_shard(p) * (2 if p.is_complex() else 1)


def describe(value: Any) -> str:
    """A saved state value in words: a tensor's dtype and shape, else its type."""
    if torch.is_tensor(value):
        return f"{value.dtype} of shape {list(value.shape)}"
    return "missing" if value is None else f"a {type(value).__name__}"


def moment_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of a float32 moment of ``p``: float32, complex64 for a complex ``p`` (as
    torch keeps a complex parameter's moments)."""
    return torch.complex64 if p.is_complex() else torch.float32


def zero_moment(name: str, p: torch.Tensor, fmt: StateFormat) -> dict[str, torch.Tensor]:
    """A zero moment of ``p`` in ``fmt``."""
    local = local_part(p)
    if not fmt.quantized:
        zero = torch.zeros(local.shape, dtype=moment_dtype(p), device=local.device)
        return {name: shard_like(zero, p)}
    codes, scales = fmt.codec.zeros(fmt.blocks(elements_of(p)), fmt.block, local.device)
    return {f"{name}_codes": flat_shard(codes, p), f"{name}_scales": flat_shard(scales, p)}


def stored_moment(
    name: str, value: torch.Tensor, p: torch.Tensor, fmt: StateFormat, signed: bool
) -> dict[str, torch.Tensor]:
    """A float32 moment ``value`` of ``p`` stored in ``fmt``."""
    local = local_part(p)
    value = local_part(value).to(device=local.device, dtype=moment_dtype(p))
    if not fmt.quantized:
        # (contiguous: a torch optimizer's moment of a channels-last or transposed weight
        # keeps the weight's strides, and the step reads moments as flat views)
        value = value.reshape(local.shape).clone(memory_format=torch.contiguous_format)
        return {name: shard_like(value, p)}
    zero = zero_moment(name, p, fmt)
    codes, scales = local_part(zero[f"{name}_codes"]), local_part(zero[f"{name}_scales"])
    flat = torch.zeros(scales.numel() * fmt.block, dtype=torch.float32, device=local.device)  # type: ignore[operator]
    real = torch.view_as_real(value) if value.is_complex() else value
    flat[: real.numel()] = real.reshape(-1)
    tables = code_tables(fmt, signed, local.device)
    new_codes, new_scales = encode(flat.view(-1, fmt.block), fmt, signed, tables)
    codes.copy_(new_codes)
    scales.copy_(new_scales)
    return zero


def float32_moment(
    state: Mapping[str, Any], name: str, p: torch.Tensor, fmt: StateFormat, signed: bool
) -> torch.Tensor:
    """The moment ``name`` of ``p`` in float32 (complex64 for a complex ``p``), of ``p``'s
    shape (a DTensor for one)."""
    local = local_part(p)
    if not fmt.quantized:
        return state[name].clone()
    tables = code_tables(fmt, signed, local.device)
    codes, scales = local_part(state[f"{name}_codes"]), local_part(state[f"{name}_scales"])
    values = decode(codes, scales, fmt, signed, tables).reshape(-1)[: real_view(p).numel()]
    if p.is_complex():
        values = torch.view_as_complex(values.view(-1, 2))
    return shard_like(values.reshape(local.shape).clone(), p)


def like_saved(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A saved state tensor as it was saved: its dtype, on ``p``'s device (a copy)."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return value.to(device=local_part(p).device).clone()
    return value.to(device=local_part(p).device, copy=True, memory_format=torch.contiguous_format)


def _sharding(p: torch.Tensor) -> tuple[int, list[Any]] | None:
    """For a DTensor ``p``: (the ranks its dim 0 is cut over, the placements of its flat
    states: cut alike where ``p`` is cut, replicated where it is: FSDP2 on one mesh
    dimension, HSDP's replicas beside it). None for a tensor. A layout whose blocks would
    not follow its local parts (another dim cut, dim 0 cut on two mesh dimensions) is
    refused before any state is made."""
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(p, dtensor):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = list(p.placements)
    cut = [i for i, pl in enumerate(placements) if pl.is_shard()]
    if len(cut) > 1 or any(not (pl.is_shard(0) or pl.is_replicate()) for pl in placements):
        raise ValueError(
            f"a parameter of shape {list(p.shape)} is placed {tuple(placements)} on a "
            f"{p.device_mesh.ndim}-D mesh: low-bit states follow a parameter cut on dim 0 over "
            "one mesh dimension (FSDP2's default, HSDP's replicas beside it); keep this one's "
            "states in float32 (keep_float32 or a 'float32' state rule), or shard it on dim 0"
        )
    ranks = p.device_mesh.size(cut[0]) if cut else 1
    return ranks, [Shard(0) if pl.is_shard() else Replicate() for pl in placements]


def shards_of(p: torch.Tensor) -> int:
    """How many parts ``p``'s low-bit moments are cut into, each in blocks of its own: the
    processes its dim 0 is cut over for an FSDP2 DTensor, 1 for a tensor."""
    sharding = _sharding(p)
    return 1 if sharding is None else sharding[0]


def shard_offset(p: torch.Tensor) -> int:
    """The flat position in the whole of ``p`` (real elements: two per complex one) of this
    rank's local part's first element: 0 for a tensor. A sharded step's random bits start
    there, so each element draws what it would in the whole, not its shard-mates' bits."""
    sharding = _sharding(p)
    if sharding is None or not p.dim() or not p.shape[0]:
        return 0
    ranks = sharding[0]
    cut = next((i for i, pl in enumerate(p.placements) if pl.is_shard()), None)  # type: ignore[attr-defined]
    if cut is None:
        return 0
    rows = -(-p.shape[0] // ranks)  # torch's chunks: the first ones full
    first = min(p.device_mesh.get_local_rank(cut) * rows, p.shape[0])  # type: ignore[attr-defined]
    return first * (p.numel() // p.shape[0]) * (2 if p.is_complex() else 1)


def largest_shard(p: torch.Tensor) -> int:
    """Elements of the largest local shard of ``p`` (its own size if not a DTensor)."""
    sharding = _sharding(p)
    if sharding is None:
        return p.numel()
    ranks = sharding[0]
    rows = -(-p.shape[0] // ranks) if p.dim() else 1
    return rows * (p.numel() // p.shape[0] if p.dim() and p.shape[0] else 1)


def flat_shard(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` (one rank's flat state) as a DTensor laid out over ``p``'s mesh as ``p`` is
    (cut on dim 0 where ``p`` is, every rank's part the same size; replicated where ``p``
    is) when ``p`` is a DTensor, else ``local``."""
    sharding = _sharding(p)
    if sharding is None:
        return local
    return dtensor_type().from_local(local, p.device_mesh, sharding[1], run_check=False)  # type: ignore[union-attr]


def shard_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` (of ``p``'s local shape) as a DTensor laid out as ``p`` when it is one."""
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(p, dtensor):
        return local
    return dtensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
