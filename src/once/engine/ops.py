"""The engine's per-layer ops: C kernels at decode batch sizes, torch otherwise.

A decode step at batch 1-8 is a pass over all the weights; there the C matmul streams
them about 3x faster than MKL's sgemv on this CPU. From 8 rows up the matmul becomes
compute-bound and MKL's blocked GEMM wins, so larger batches and prefills use torch.
At those small batches each torch op also costs more in dispatch than in arithmetic,
so the residual add + RMSNorm and the rotary embedding run as single C calls too.
"""

import torch
import torch.nn.functional as F

from once.engine.kernels import load_cpu_kernels

SMALL_BATCH_MAX_ROWS = 8


def _small_batch_kernels(x: torch.Tensor, use_kernel: bool):
    if (
        use_kernel
        and x.shape[0] <= SMALL_BATCH_MAX_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    ):
        return load_cpu_kernels()
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, use_kernel: bool = True):
    lib = _small_batch_kernels(x, use_kernel)
    if lib is None:
        return F.linear(x, weight, bias)
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


def add_rms_norm(x, delta, weight, eps: float, use_kernel: bool = True):
    """(x + delta, rms_norm(x + delta)); delta may be None. May update x in place."""
    lib = _small_batch_kernels(x, use_kernel)
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
    lib = _small_batch_kernels(qkv, use_kernel)
    if lib is None or not qkv.is_contiguous():
        heads = qkv[:, :width].view(num_tokens, num_heads, head_dim)
        return rotate_half_pairs(heads, cos, sin)
    lib.rope_in_place(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), num_tokens, qkv.shape[1], num_heads,
        head_dim,
    )  # fmt: skip
    return qkv[:, :width].view(num_tokens, num_heads, head_dim)
