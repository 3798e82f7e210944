"""ULP distance definition and tensor statistics (fp32, bf16, fp16, fp64; +-0, NaN, subnormals)."""
import math

import pytest
import torch

from harness.judging.ulp import tensor_stats, ulp_distance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_adjacent_values_are_one_ulp_apart(dtype):
    x = torch.tensor([1.0, -3.5, 1e-3, 100.0], dtype=dtype)
    up = torch.nextafter(x, torch.full_like(x, math.inf)) if dtype != torch.bfloat16 else \
        (x.view(torch.int16) + torch.where(x > 0, 1, -1).to(torch.int16)).view(torch.bfloat16)
    s = tensor_stats(x, up)
    assert s["differing"] == 4 and s["max_ulp"] == 1 and s["median_ulp"] == 1


def test_signed_zero_subnormal_and_nan():
    z = torch.tensor([0.0, 0.0, float("nan"), 1.0])
    w = torch.tensor([-0.0, 1e-45, float("nan"), float("nan")])      # 1e-45 = smallest fp32 subnormal
    s = tensor_stats(z, w)
    assert s["differing"] == 3                 # -0 vs +0 differ in bits, subnormal, nan vs 1.0
    assert s["nan_mismatch"] == 1
    assert s["max_ulp"] == 1                   # +0 -> smallest subnormal is one step; -0 vs +0 is 0 steps
    assert ulp_distance("0x00000000", "0x80000000") == 0
    assert ulp_distance("0x80000001", "0x00000001") == 2          # across zero
    assert ulp_distance("0x3f800000", "0x3f800003") == 3


def test_histogram_and_errors():
    a = torch.ones(1000)
    b = a.clone()
    bits = b.view(torch.int32)
    bits[:10] += 1
    bits[10:12] += 100
    s = tensor_stats(a, b)
    assert s["differing"] == 12 and s["fraction"] == pytest.approx(0.012)
    assert s["max_ulp"] == 100 and s["median_ulp"] == 1
    assert dict((u, n) for u, n in s["histogram"]) == {1: 10, 256: 2}
    assert s["max_abs_err"] == pytest.approx(100 * 2 ** -23)


def test_mismatched_inputs_raise():
    with pytest.raises(ValueError):
        tensor_stats(torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError):
        tensor_stats(torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
