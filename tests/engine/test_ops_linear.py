"""The engine's matmul paths (C kernel, oneDNN over packed weights, torch) agree.

Each path is checked against a float64 matmul of the same operands, at the row counts
where `ops.linear` switches between them, with and without a bias.
"""

import pytest
import torch

from once.engine import ops
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.ops import Linear, linear, onednn_available

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def _operands(rows: int, in_features: int, out_features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    return x, weight, bias


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 33, 512])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("pack", [False, True])
def test_every_path_matches_a_float64_matmul(rows, with_bias, pack):
    x, weight, bias = _operands(rows, 96, 200, seed=rows)
    bias = bias if with_bias else None
    layer = Linear.prepare(weight, bias, pack=pack)
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    for use_kernel in (True, False):
        got = linear(x, layer, use_kernel)
        assert got.shape == (rows, 200) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


@needs_onednn
def test_packed_weights_take_the_onednn_path_above_the_kernel_rows(monkeypatch):
    x, weight, _ = _operands(16, 64, 48, seed=0)
    layer = Linear.prepare(weight)
    assert layer.packed is not None
    calls = []
    real = ops._onednn_linear

    def counting(rows, packed, bias):
        calls.append(rows.shape[0])
        return real(rows, packed, bias)

    monkeypatch.setattr(ops, "_onednn_linear", counting)
    for rows in (1, ops.SMALL_BATCH_MATMUL_MAX_ROWS, ops.SMALL_BATCH_MATMUL_MAX_ROWS + 1, 16):
        linear(x[:rows], layer)
    linear(x, layer, use_kernel=False)  # the reference path is torch's own
    assert calls == [ops.SMALL_BATCH_MATMUL_MAX_ROWS + 1, 16]


def test_a_float64_weight_is_not_packed():
    assert Linear.prepare(torch.randn(8, 4, dtype=torch.float64)).packed is None


@needs_onednn
def test_engine_packs_weights_unless_told_otherwise(tiny_model_dir):
    packed = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16)).model
    plain = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, cpu_gemm="torch")
    ).model
    for model, expect_packed in ((packed, True), (plain, False)):
        layers = [model.lm_head] + [
            m for layer in model.layers for m in (layer.qkv, layer.o_proj, layer.gate_up)
        ]
        assert all((m.packed is not None) is expect_packed for m in layers)


def test_an_unknown_cpu_gemm_is_refused():
    with pytest.raises(ValueError, match="cpu_gemm"):
        EngineConfig(cpu_gemm="blas")
