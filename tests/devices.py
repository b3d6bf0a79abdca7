"""Devices the tests describe rather than probe (`mixprec.hardware.assume(info)`, or
`device_info=`), so a test says "on an H100" or "on an AVX2-only CPU" and passes on any
machine."""

from __future__ import annotations

from mixprec.hardware import DeviceInfo

# Described CPUs state the GEMM ratios their class measures (`DeviceInfo.gemm_ratios`) or,
# without them, are rated by their flags alone: nothing is measured on the host.

# no bf16/fp16 matrix instructions: bfloat16 and float16 are far slower than float32 there
AVX2_CPU = DeviceInfo("cpu", "AVX2-only x86", cpu_flags=frozenset({"avx2", "fma"}))
# AVX-512 and VNNI but no avx512_bf16 or AMX (Skylake-SP to Ice Lake Xeons): bfloat16 is
# converted in software, its GEMMs measured at 0.42x float32's speed
AVX512_CPU = DeviceInfo(
    "cpu",
    "Intel Xeon (AVX-512, no bf16)",
    cpu_flags=frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"}),
    gemm_ratios={"bfloat16": 0.42, "float16": 0.05},
)
# avx512_bf16 without fp16 hardware: bfloat16 fast, float16 slow
ZEN4 = DeviceInfo(
    "cpu", "AMD Zen 4", cpu_flags=frozenset({"avx512bw", "avx512_bf16", "avx512_vnni"})
)
# AMX tiles for bfloat16 and int8, avx512_fp16, no amx_fp16 (Sapphire Rapids): one thread's
# bfloat16 GEMMs ran 8-12x float32's at 1024x1024 (4.5x at 256, 1.2x at 128, where the
# tiles' setup is most of the work); float16 GEMMs near float32's, its convolutions slow
AMX_CPU = DeviceInfo(
    "cpu",
    "Intel Xeon (Sapphire Rapids)",
    cpu_flags=frozenset(
        {"avx2", "avx512bw", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8"}
    ),
    gemm_ratios={"bfloat16": 8.0, "float16": 0.9},
    gemm_note="bfloat16 at 1024x1024, float16 at 1024x1024, against float32 on one thread",
)
# compute capability 9.0: bfloat16, float16 and float8 fast
H100 = DeviceInfo("cuda", "H100", 0, capability=(9, 0))
# compute capability 7.0: float16 fast, no bfloat16
V100 = DeviceInfo("cuda", "Tesla V100", 0, capability=(7, 0))
