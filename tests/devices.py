"""Devices the tests describe rather than probe (`mixprec.hardware.assume(info)`, or
`device_info=`), so a test says "on an H100" or "on an AVX2-only CPU" and passes on any
machine."""

from __future__ import annotations

from mixprec.hardware import DeviceInfo

# no bf16/fp16 matrix instructions: bfloat16 and float16 are far slower than float32 there
AVX2_CPU = DeviceInfo("cpu", "AVX2-only x86", cpu_flags=frozenset({"avx2", "fma"}))
# avx512_bf16 without fp16 hardware: bfloat16 fast, float16 slow
ZEN4 = DeviceInfo(
    "cpu", "AMD Zen 4", cpu_flags=frozenset({"avx512bw", "avx512_bf16", "avx512_vnni"})
)
# compute capability 9.0: bfloat16, float16 and float8 fast
H100 = DeviceInfo("cuda", "H100", 0, capability=(9, 0))
# compute capability 7.0: float16 fast, no bfloat16
V100 = DeviceInfo("cuda", "Tesla V100", 0, capability=(7, 0))
