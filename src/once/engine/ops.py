"""The engine's per-layer ops: C kernels at decode batch sizes, oneDNN or torch otherwise.

Matmuls, by rows in the step's flat batch (CPU, fp32):
- 1-2 rows: a pass over the weights, bound by memory bandwidth; the C matmul streams each
  weight row once, dotting it with every input row (kept in L1), and comes closer to
  that bandwidth than MKL's sgemv.
- more rows: oneDNN's GEMM over a copy of the weight packed once, at load, into its
  blocked layout. torch's own fp32 matmul is MKL's, which takes its AVX2 path on AMD CPUs
  even where they have AVX-512; oneDNN picks its kernels from the CPU's features.
  (DESIGN.md, "CPU kernels", has the rates measured for each.)
Where torch has no oneDNN, or on CUDA, every matmul is torch's. The residual add + RMSNorm,
the rotary embedding and the SwiGLU gate run as single C calls at every batch size: at
decode sizes each torch op costs more in dispatch than in arithmetic, and at prefill sizes
one pass over memory beats torch's several.

Weight formats. A matmul's weight is a `LinearLayer` that applies itself; the model is
given a `WeightFormat` that turns each fp32 weight into one at load (`Fp32Weights` here:
the plain weight and its oneDNN-packed copy; `quant_q8_0.Q8_0Weights`: llama.cpp's 8-bit
blocks; `weight_formats.weight_format` picks one by name). `linear()` only delegates, so
a format adds no branch to this module.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from once.engine.kernels import load_cpu_kernels

# Up to this many rows the C matmul beats the packed oneDNN GEMM (it reads the plain
# weight in one stream); without a packed weight it beats MKL up to UNPACKED_MAX_ROWS.
SMALL_BATCH_MATMUL_MAX_ROWS = 2
UNPACKED_MATMUL_MAX_ROWS = 8


class LinearLayer(Protocol):
    """One matmul's weight in some format: x (rows, in_features) -> (rows, out_features).
    use_kernel False is the reference path: torch alone."""

    def apply(self, x: torch.Tensor, use_kernel: bool = True) -> torch.Tensor: ...


class WeightFormat(Protocol):
    """How a model stores its matmul weights: each (out_features, in_features) fp32 weight
    (and bias) becomes a LinearLayer once, at load."""

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearLayer: ...


@dataclass(frozen=True)
class Linear:
    """One matmul's weight (out_features, in_features), its bias, and on CPU fp32 the
    oneDNN-packed copy of the weight (None where oneDNN is off or not available)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    @classmethod
    def prepare(cls, weight: torch.Tensor, bias=None, pack: bool = True) -> "Linear":
        return cls(weight, bias, pack_for_onednn(weight) if pack else None)

    def apply(self, x: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
        packed = self.packed if use_kernel else None
        max_rows = SMALL_BATCH_MATMUL_MAX_ROWS if packed is not None else UNPACKED_MATMUL_MAX_ROWS
        lib = _cpu_kernels(x, use_kernel, max_rows)
        if lib is None:
            if packed is not None:
                return _onednn_linear(x, packed, self.bias)
            return F.linear(x, self.weight, self.bias)
        weight, bias = self.weight, self.bias
        rows = x.shape[0]
        x = x.contiguous()
        y = torch.empty(rows, weight.shape[0], dtype=x.dtype)
        lib.small_batch_linear(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            rows,
            weight.shape[0],
            weight.shape[1],
            torch.get_num_threads(),
        )
        return y


@dataclass(frozen=True)
class Fp32Weights:
    """The default format: weights as loaded, plus the oneDNN-packed copy when pack."""

    pack: bool = True

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return Linear.prepare(weight, bias, self.pack)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout for fp32 GEMM, or None where that is not
    available (CUDA, other dtypes, a torch built without oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not onednn_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:
        return None


def _cpu_kernels(x: torch.Tensor, use_kernel: bool, max_rows: int | None = None):
    if (
        use_kernel
        and (max_rows is None or x.shape[0] <= max_rows)
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    ):
        return load_cpu_kernels()
    return None


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, layer: LinearLayer, use_kernel: bool = True) -> torch.Tensor:
    """x @ weight^T + bias, in whatever format the layer keeps its weight."""
    return layer.apply(x, use_kernel)


def add_rms_norm(x, delta, weight, eps: float, use_kernel: bool = True):
    """(x + delta, rms_norm(x + delta)); delta may be None. May update x in place."""
    lib = _cpu_kernels(x, use_kernel)
    if lib is None or not x.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        if delta is not None:
            x = x + delta
        return x, F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty_like(x)
    lib.add_rms_norm(
        x.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
    )
    return x, out


def silu_mul(gate_up: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    lib = _cpu_kernels(gate_up, use_kernel)
    if lib is None or not gate_up.is_contiguous():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, n_heads, head_dim); rotate pairs (i, i + head_dim/2); cos, sin: (T, 1, dim/2).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_leading_heads(qkv, cos, sin, num_heads: int, head_dim: int, use_kernel: bool = True):
    """Rotate the first `num_heads` heads of each row of the fused q|k|v output.

    Returns those heads as (T, num_heads, head_dim); the kernel path rotates in place.
    """
    num_tokens = qkv.shape[0]
    width = num_heads * head_dim
    lib = _cpu_kernels(qkv, use_kernel)
    if lib is None or not qkv.is_contiguous():
        heads = qkv[:, :width].view(num_tokens, num_heads, head_dim)
        return rotate_half_pairs(heads, cos, sin)
    lib.rope_in_place(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), num_tokens, qkv.shape[1], num_heads,
        head_dim,
    )  # fmt: skip
    return qkv[:, :width].view(num_tokens, num_heads, head_dim)
