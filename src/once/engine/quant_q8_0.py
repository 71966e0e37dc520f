"""Q8_0 weights: llama.cpp's 8-bit format, as a WeightFormat for the engine's matmuls.

A weight (N, K) is cut into blocks of 32 along K; each block keeps 32 int8 values and one
fp16 scale, 8.5 bits a weight against fp32's 32. Quantization is ggml's reference
(`quantize_row_q8_0_ref`), step for step in fp32, so the weights once dequantizes are
the ones llama.cpp's Q8_0 file of the same fp32 weights holds:

    d = max |x| / 127,  id = 1 / d (0 when d = 0),  q = roundf(x * id),  scale = fp16(d)

Only the int8 values and the scales are kept (no fp32 copy), and a decode step reads a
quarter of fp32's bytes. Matmuls, by rows of x (SmolLM2-135M's, 2 threads, this VM):
- up to KERNEL_MAX_ROWS: the C kernel (kernels/q8_0.c) widens each weight block to fp32
  in registers and FMAs it into up to 8 rows of x at a time. All matmuls of a step at 1
  row: ~8 ms against fp32's ~18; at 128 rows 187 ms against dequantize + oneDNN's 211.
- more rows (prefill): the weight is dequantized into an fp32 scratch by one C pass and
  multiplied by oneDNN's GEMM (512 rows: 547-611 ms against fp32's packed 517-582; the
  kernel: 750).
- no kernels (no compiler, ONCE_DISABLE_KERNELS=1, CUDA): dequantize in torch, F.linear.
A weight whose in_features is not a multiple of 32 stays in the fallback format (fp32).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from once.engine.kernels import load_cpu_kernels
from once.engine.memory import empty_huge
from once.engine.ops import Fp32Weights, LinearLayer, WeightFormat, onednn_available

BLOCK = 32
# Up to this many rows the C kernel beats dequantize + oneDNN (measured: 128 rows yes,
# 256 no: 357 against 324 ms for a step's matmuls).
KERNEL_MAX_ROWS = 128
# Rows of a weight quantized at a time: bounds the fp32 temporaries at load.
_QUANTIZE_ROWS = 4096


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 (N, K), scales fp16 (N, K / 32)) of an (N, K) weight, K % 32 == 0."""
    num_rows, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"Q8_0 needs in_features divisible by {BLOCK}, got {in_features}")
    values = empty_huge((num_rows, in_features), torch.int8)
    scales = empty_huge((num_rows, in_features // BLOCK), torch.float16)
    for start in range(0, num_rows, _QUANTIZE_ROWS):
        rows = slice(start, start + _QUANTIZE_ROWS)
        blocks = weight[rows].to(device="cpu", dtype=torch.float32)
        blocks = blocks.reshape(blocks.shape[0], -1, BLOCK)  # (n, K / 32, 32)
        d = blocks.abs().amax(dim=-1, keepdim=True) / torch.tensor(127.0)
        inverse = torch.where(d == 0, torch.zeros_like(d), torch.tensor(1.0) / d)
        scaled = blocks * inverse
        # roundf (halves away from zero) exactly: floor(|v|) plus 1 when the fraction is
        # at least a half. (floor(|v| + 0.5) would round 0.49999997 up: the sum rounds.)
        magnitude = scaled.abs()
        whole = magnitude.floor()
        rounded = torch.copysign(whole + (2 * (magnitude - whole)).floor(), scaled)
        values[rows] = rounded.to(torch.int8).reshape(blocks.shape[0], in_features)
        scales[rows] = d.squeeze(-1).to(torch.float16)
    return values, scales


def dequantize_q8_0(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight (N, K) that Q8_0 values and scales stand for (torch only)."""
    num_rows, in_features = values.shape
    blocks = values.reshape(num_rows, -1, BLOCK).to(torch.float32)
    return (blocks * scales.to(torch.float32).unsqueeze(-1)).reshape(num_rows, in_features)


@dataclass(frozen=True)
class Q8_0Linear:
    """One matmul's weight in Q8_0: values int8 (N, K), scales fp16 (N, K / 32)."""

    values: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = None

    @classmethod
    def prepare(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Q8_0Linear":
        values, scales = quantize_q8_0(weight)
        return cls(values, scales, bias)

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    def dequantize(self) -> torch.Tensor:
        lib = load_cpu_kernels()
        if lib is None:
            return dequantize_q8_0(self.values, self.scales)
        num_rows, in_features = self.values.shape
        weight = torch.empty(num_rows, in_features, dtype=torch.float32)
        lib.q8_0_dequantize(
            self.values.data_ptr(), self.scales.data_ptr(), weight.data_ptr(),
            num_rows, in_features, torch.get_num_threads(),
        )  # fmt: skip
        return weight

    def apply(self, x: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
        usable = use_kernel and x.dtype == torch.float32 and x.device.type == "cpu"
        lib = load_cpu_kernels() if usable else None
        if lib is None:
            weight = dequantize_q8_0(self.values, self.scales).to(x.device, x.dtype)
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
        if x.shape[0] > KERNEL_MAX_ROWS:
            return _gemm(x, self.dequantize(), self.bias)
        x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        lib.q8_0_linear(
            x.data_ptr(), self.values.data_ptr(), self.scales.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
            rows, self.out_features, self.values.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        return y


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # oneDNN takes a plain weight too (it reorders it inside the call); see ops.py for
    # why oneDNN rather than torch's MKL GEMM on this kind of CPU.
    if onednn_available():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class Q8_0Weights:
    """Every matmul weight in Q8_0 (in_features divisible by 32), else in `fallback`."""

    fallback: WeightFormat = field(default_factory=Fp32Weights)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearLayer:
        if weight.shape[1] % BLOCK or weight.device.type != "cpu":
            return self.fallback.prepare(weight, bias)
        return Q8_0Linear.prepare(weight, bias)
