"""Large host tensors backed by transparent huge pages where the OS allows it.

A decode step streams every weight and the whole KV of each sequence from memory. With
4 KiB pages that stream takes a TLB miss every few rows; with 2 MiB pages it does not, so
the stream gets closer to the memory's bandwidth. THP is usually in "madvise" mode, so
the engine asks for it on its own big allocations (before first touch, so the faults that
populate them take huge pages). Elsewhere, or on failure, the tensor is simply normal.

The step's transient tensors (activations, logits) are the other half: glibc serves each
one above its mmap threshold with a fresh mapping and trims freed heap back to the OS,
so every step page-faults its activations in again. `keep_freed_memory` (once.heap, shared
with the gateway) tells malloc to keep and reuse that memory instead.
"""

import ctypes
import sys

import torch

from once.heap import keep_freed_memory

__all__ = ["copy_to_huge", "empty_huge", "keep_freed_memory", "zeros_huge"]
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 1 << 21
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            _libc = False
    return _libc


def _madvise_huge(tensor: torch.Tensor) -> None:
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return
    libc = _glibc()
    if not libc:
        return
    addr = tensor.data_ptr()
    size = tensor.numel() * tensor.element_size()
    start = (addr + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)  # only whole huge pages inside
    end = (addr + size) & ~(_HUGE_PAGE - 1)
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


def empty_huge(shape, dtype, device="cpu") -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=device)
    _madvise_huge(tensor)
    return tensor


def zeros_huge(shape, dtype, device="cpu") -> torch.Tensor:
    return empty_huge(shape, dtype, device).zero_()


def copy_to_huge(source: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `source` in its own (huge-page) memory."""
    return empty_huge(source.shape, source.dtype, source.device).copy_(source)
