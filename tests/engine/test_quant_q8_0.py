"""Q8_0 weights: ggml's quantization bit for bit, and every matmul path over them agrees.

The reference is the gguf package (llama.cpp's own Python quantizer): the bytes once
keeps are the bytes of a llama.cpp Q8_0 file of the same weights.
"""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from once.engine import quant_q8_0
from once.engine.attention import AttentionMetadata, PrefillChunk
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.kernels import load_cpu_kernels
from once.engine.ops import Fp32Weights, Linear
from once.engine.quant_q8_0 import Q8_0Linear, Q8_0Weights, dequantize_q8_0, quantize_q8_0
from once.engine.weight_formats import weight_format
from once.protocol.engine import GenerateRequest, SamplingParams

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C compiler")
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen)
    weight[1, 32:64] = 0  # a zero block: d = 0, its inverse must be 0, not inf
    # d = 127 / 127 = 1 exactly, so x * id = x lands on halves: roundf takes them away
    # from zero (torch.round would take them to even).
    weight[2, :32] = torch.arange(32) - 15.5
    weight[2, 0] = 127.0
    return weight


def _ggml_bytes(values: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    # ggml's block_q8_0: the fp16 scale, then the 32 int8 values, 34 bytes a block.
    rows = values.shape[0]
    d = scales.numpy().view(np.uint8).reshape(rows, -1, 2)
    qs = values.numpy().view(np.uint8).reshape(rows, -1, 32)
    return np.concatenate([d, qs], axis=2).reshape(rows, -1)


def test_quantization_is_ggml_reference_bit_for_bit():
    weight = _weight(37, 192, seed=1)
    values, scales = quantize_q8_0(weight)
    assert values.dtype == torch.int8 and scales.dtype == torch.float16
    expected = gguf.quants.quantize(weight.numpy(), Q8_0)
    np.testing.assert_array_equal(_ggml_bytes(values, scales), expected)
    dequantized = gguf.quants.dequantize(expected, Q8_0)
    np.testing.assert_array_equal(dequantize_q8_0(values, scales).numpy(), dequantized)
    assert torch.all(dequantize_q8_0(values, scales)[1, 32:64] == 0)


def test_quantization_in_row_chunks_matches_one_pass(monkeypatch):
    weight = _weight(50, 64, seed=2)
    whole = quantize_q8_0(weight)
    monkeypatch.setattr(quant_q8_0, "_QUANTIZE_ROWS", 7)
    chunked = quantize_q8_0(weight)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))


def test_in_features_off_the_block_size_are_refused_or_kept_in_fallback():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q8_0(torch.randn(4, 40))
    assert isinstance(Q8_0Weights().prepare(torch.randn(4, 40)), Linear)
    assert isinstance(Q8_0Weights().prepare(torch.randn(4, 64)), Q8_0Linear)


@needs_kernels
def test_c_dequantization_matches_torch():
    layer = Q8_0Linear.prepare(_weight(33, 96, seed=3))
    assert torch.equal(layer.dequantize(), dequantize_q8_0(layer.values, layer.scales))


# 1 and 3 rows (decode, one chunk of x), 11 (two chunks), and past KERNEL_MAX_ROWS
# (dequantize + GEMM); 67 output rows: not a multiple of the kernel's 4 or its 32-row tile.
@pytest.mark.parametrize("rows", [1, 3, 11, quant_q8_0.KERNEL_MAX_ROWS + 5])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_every_path_matches_the_dequantized_matmul(rows, with_bias, use_kernel):
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(67, generator=gen) if with_bias else None
    layer = Q8_0Linear.prepare(_weight(67, 160, seed=4), bias)
    x = torch.randn(rows, 160, generator=gen)
    weight = dequantize_q8_0(layer.values, layer.scales).double()
    expected = F.linear(x.double(), weight, None if bias is None else bias.double())
    got = layer.apply(x, use_kernel)
    assert got.shape == (rows, 67) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


def test_the_torch_fallback_runs_without_kernels(monkeypatch):
    monkeypatch.setattr(quant_q8_0, "load_cpu_kernels", lambda: None)
    layer = Q8_0Linear.prepare(_weight(9, 64, seed=5))
    x = torch.randn(2, 64)
    expected = F.linear(x, dequantize_q8_0(layer.values, layer.scales))
    torch.testing.assert_close(layer.apply(x), expected)
    torch.testing.assert_close(layer.dequantize(), dequantize_q8_0(layer.values, layer.scales))


def test_weight_formats_by_name():
    assert weight_format("fp32", pack=False) == Fp32Weights(pack=False)
    assert isinstance(weight_format("q8_0"), Q8_0Weights)
    with pytest.raises(ValueError, match="weights"):
        weight_format("q4_1")
    with pytest.raises(ValueError, match="weights"):
        EngineConfig(weights="int8")


def _engine(folder, weights: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64, weights=weights))


def _logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    # One prefill chunk at position 0 over fresh blocks: every row's logits.
    num_tokens, block_size = len(ids), engine.kv_cache.block_size
    table = torch.arange(-(-num_tokens // block_size), dtype=torch.int32)
    chunk = PrefillChunk(0, num_tokens, 0, table, block_size)
    meta = AttentionMetadata(torch.arange(num_tokens), prefills=[chunk])
    rows = torch.arange(num_tokens)
    return engine.model.forward(torch.tensor(ids), rows, engine.kv_cache, meta, rows)


def test_a_q8_0_model_is_close_to_fp32_and_generates(tiny_model_dir):
    fp32, q8 = _engine(tiny_model_dir, "fp32"), _engine(tiny_model_dir, "q8_0")
    model = q8.model
    layers = [model.lm_head] + [
        m for layer in model.layers for m in (layer.qkv, layer.o_proj, layer.gate_up)
    ]
    assert all(isinstance(m, Q8_0Linear) for m in layers + [model.layers[0].down_proj])
    assert isinstance(fp32.model.lm_head, Linear)
    ids = [5, 17, 99, 3, 250, 42, 7, 128]
    want, got = _logits(fp32, ids), _logits(q8, ids)
    # 8-bit weights: close, not equal (the tiny model's logits span about +-5).
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert not torch.equal(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for name, engine in (("fp32", fp32), ("q8_0", q8)):
        deltas = engine.generate([GenerateRequest("r", tuple(ids), params)])["r"]
        outputs[name] = [t for delta in deltas for t in delta.token_ids]
    assert len(outputs["q8_0"]) == 12
    assert outputs["q8_0"][:4] == outputs["fp32"][:4]
