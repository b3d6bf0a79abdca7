"""Optimizer states in 8 and 4 bits: AdamW, Adam and SGD keeping their moments block-wise
quantized (``int8``, ``int4``, ``fp8``) or in float32, per parameter.

- `formats`: `StateFormat`, `parse_state_format`, the code maps, `quantize` /
  `dequantize`, `moment_error`.
- `kernels`: the per-tensor update (decode, float32 math, encode), compiled or eager.
- `optimizers`: `LowBitAdamW`, `LowBitAdam`, `LowBitSGD`, the drop-in `AdamW8bit`,
  `AdamW4bit`, `AdamWFp8`, `state_bytes`.
- `assign`: which format each parameter of a model gets and why (`assign_formats`,
  `explain_formats`), `from_model`, `from_optimizer`.
"""

from __future__ import annotations

from mixprec.states.assign import (
    Assignment,
    assign_formats,
    explain_formats,
    format_groups,
    from_model,
    from_optimizer,
)
from mixprec.states.formats import (
    KINDS,
    StateFormat,
    code_map,
    dequantize,
    moment_error,
    parse_state_format,
    quantize,
)
from mixprec.states.optimizers import (
    MIN_SIZE,
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    LowBitAdam,
    LowBitAdamW,
    LowBitOptimizer,
    LowBitSGD,
    state_bytes,
)

__all__ = [
    "KINDS",
    "MIN_SIZE",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWFp8",
    "Assignment",
    "LowBitAdam",
    "LowBitAdamW",
    "LowBitOptimizer",
    "LowBitSGD",
    "StateFormat",
    "assign_formats",
    "code_map",
    "dequantize",
    "explain_formats",
    "format_groups",
    "from_model",
    "from_optimizer",
    "moment_error",
    "parse_state_format",
    "quantize",
    "state_bytes",
]
