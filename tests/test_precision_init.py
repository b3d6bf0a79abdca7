"""`Precision.init_module` (build a model in its storage dtype) and `device_info` (check
against a described device instead of the host): the same outcome on every host."""

import pytest
import torch
from devices import AVX2_CPU, H100
from nets import mlp
from torch import nn

from mixprec import Precision, SlowPrecisionError

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def test_init_module_builds_in_the_storage_dtype_and_restores_the_default():
    with Precision("bf16-true").init_module():
        assert nn.Linear(2, 2).weight.dtype == bf16
    assert torch.get_default_dtype() == f32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Precision("bf16-mixed").init_module():
            assert nn.Linear(2, 2).weight.dtype == f32
        assert torch.get_default_dtype() == torch.float64
        with pytest.raises(RuntimeError, match="boom"), Precision("16-true").init_module():
            assert torch.get_default_dtype() == f16
            raise RuntimeError("boom")
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)


def test_precision_checks_against_a_described_device():
    assert Precision("auto", device_info=H100).policy.name == "bf16-mixed"
    assert Precision("auto", device_info=AVX2_CPU).policy.name == "32-true"
    with pytest.raises(SlowPrecisionError, match=AVX2_CPU.name):
        Precision("bf16-mixed", device_info=AVX2_CPU).setup(mlp())
    model = Precision("16-mixed", device_info=H100).setup(mlp())  # fast on an H100
    assert isinstance(model, nn.Module)
    with pytest.raises(TypeError, match="DeviceInfo"):
        Precision("32-true", device_info="h100")
