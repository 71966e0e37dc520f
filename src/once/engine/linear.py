"""The engine's matmul: a bandwidth-bound C kernel for a few rows, torch (MKL) otherwise.

A decode step at batch 1-8 is a pass over all the weights; there the C kernel streams
them about 3x faster than MKL's sgemv on this CPU. From 8 rows up the matmul becomes
compute-bound and MKL's blocked GEMM wins, so larger batches and prefills use F.linear.
"""

import torch
import torch.nn.functional as F

from once.engine.kernels import load_cpu_kernels

SMALL_BATCH_MAX_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, use_kernel: bool = True):
    rows = x.shape[0]
    if (
        use_kernel
        and rows <= SMALL_BATCH_MAX_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
    ):
        lib = load_cpu_kernels()
        if lib is not None:
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
    return F.linear(x, weight, bias)
