"""The FP8 codec shared by the wire's ``wire_dtype="fp8"`` and the cache's FP8 storage."""

import pytest
import torch

from spec_serve.supervision import fp8


def test_round_trip_is_within_e4m3s_rounding_per_element():
    x = torch.randn(3, 17, 64, dtype=torch.float32) * torch.logspace(-3, 3, 17).view(1, 17, 1)
    q, scale = fp8.quantize(x)
    assert q.dtype == fp8.FP8_DTYPE and scale.shape == (3, 17, 1) and scale.dtype == torch.float32
    back = fp8.dequantize(q, scale, torch.float32)
    # 3 mantissa bits: |err| <= 2**-4 |x| for normals, plus half a subnormal step (2**-10 x scale).
    bound = x.abs() * 2**-4 + scale * 2**-10
    assert bool(((back - x).abs() <= bound).all())
    assert fp8.relative_error(x) < 2**-4


def test_values_on_the_grid_and_zero_rows_come_back_exactly():
    x = torch.tensor([[0.0, 0.0, 0.0], [448.0, -2.0, 0.5]]).to(torch.bfloat16)
    back = fp8.dequantize(*fp8.quantize(x), torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)


def test_the_scale_is_per_token_so_a_swapped_scale_is_seen():
    x = torch.stack([torch.randn(32), 1000 * torch.randn(32)])
    q, scale = fp8.quantize(x)
    swapped = fp8.dequantize(q, scale.flip(0), torch.float32)
    assert (swapped - x).norm() / x.norm() > 0.5
    assert (fp8.dequantize(q, scale, torch.float32) - x).norm() / x.norm() < 2**-4


@pytest.mark.parametrize("bad", [torch.tensor([[1.0, float("nan")]]), torch.tensor([[float("inf"), 1.0]]),
                                 torch.ones(2, 2, dtype=torch.int64), torch.tensor(1.0)])
def test_what_no_scale_represents_is_refused(bad):
    with pytest.raises(ValueError, match="fp8"):
        fp8.quantize(bad)


def test_dequantize_checks_its_inputs():
    q, scale = fp8.quantize(torch.randn(2, 4))
    with pytest.raises(ValueError, match="scale"):
        fp8.dequantize(q, scale.view(2), torch.float32)
    with pytest.raises(ValueError, match="float8"):
        fp8.dequantize(q.float(), scale, torch.float32)
