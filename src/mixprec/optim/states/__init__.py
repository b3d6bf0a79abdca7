"""Optimizer states in 8 and 4 bits: AdamW, Adam and SGD keeping their moments block-wise
quantized (``int8``, ``int4``, ``float8``, or any registered format) or in float32, per
parameter.

- `codecs`: the registry of state formats, one `StateCodec` per kind
  (`register_state_format`, `state_codec`, `state_codecs`) and the builtin ones.
- `formats`: `StateFormat`, `parse_state_format`, the code maps, `quantize` /
  `dequantize` (any tensor stored block-wise in a format and read back), `moment_error`.
- `kernels`: the per-tensor update (decode, float32 math, encode), compiled or eager.
- `optimizers`: `LowBitAdamW`, `LowBitAdam`, `LowBitSGD`, the drop-in `AdamW8bit`,
  `AdamW4bit`, `AdamWFp8`, `state_bytes`; the step, in buckets (`buckets`).
- `checkpoint`: their checkpoint half (`StateCheckpoint`, the base class): saving, the
  checked loads, states converted between formats; `moments`: a moment made zero, stored
  from float32 and read back, and the layouts of a sharded parameter's states.
- `assign`: which format each parameter of a model gets and why (`assign_formats`,
  `explain_formats`), `from_model`, `from_optimizer`.
"""

from __future__ import annotations

from mixprec.optim.states.assign import (
    Assignment,
    assign_formats,
    explain_formats,
    format_groups,
    from_model,
    from_optimizer,
)
from mixprec.optim.states.codecs import (
    StateCodec,
    register_state_format,
    state_codec,
    state_codecs,
    unregister_state_format,
)
from mixprec.optim.states.formats import (
    KINDS,
    StateFormat,
    code_map,
    dequantize,
    moment_error,
    parse_state_format,
    quantize,
    state_kinds,
)
from mixprec.optim.states.optimizers import (
    MIN_SIZE,
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    LowBitAdam,
    LowBitAdamW,
    LowBitOptimizer,
    LowBitSGD,
    fitted_format,
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
    "StateCodec",
    "StateFormat",
    "assign_formats",
    "code_map",
    "dequantize",
    "explain_formats",
    "fitted_format",
    "format_groups",
    "from_model",
    "from_optimizer",
    "moment_error",
    "parse_state_format",
    "quantize",
    "register_state_format",
    "state_bytes",
    "state_codec",
    "state_codecs",
    "state_kinds",
    "unregister_state_format",
]
