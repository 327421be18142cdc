"""Launch helpers shared by the OasisKV Triton kernels."""

from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on CPU tensors, used by the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class MappedHost:
    """A pinned host tensor handed to a Triton kernel as a device pointer (zero-copy).

    With unified virtual addressing, page-locked memory from ``cudaHostAlloc`` (what
    ``pin_memory=True`` uses) is mapped into the GPU's address space at the same address, so a
    kernel can load and store it directly over PCIe. Triton's launcher accepts any object with
    ``data_ptr()`` and ``dtype``; it checks the pointer with ``cuPointerGetAttribute``, which
    succeeds for mapped pinned memory and fails (clear error) for pageable memory.
    """

    __slots__ = ("t", "dtype")

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        """Host address of the pinned buffer (also its device address under UVA)."""
        return self.t.data_ptr()


def kernel_arg(t: torch.Tensor, device: torch.device):
    """``t`` as a kernel argument for a launch on ``device``.

    Raises:
        ValueError: ``t`` is host memory that is not pinned while the launch is on CUDA.
    """
    if device.type == "cuda" and t.device.type == "cpu" and not interpreting():
        if not t.is_pinned():
            raise ValueError("OasisKV kernels: host tensors must be pinned (pin_memory=True) for zero-copy access")
        return MappedHost(t)
    return t


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes)."""
    return triton.next_power_of_2(max(1, int(n)))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 under the interpreter / on CPU)."""
    if device.type == "cuda" and not interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def checks_enabled() -> bool:
    """``OASIS_KERNEL_CHECKS=1``: validate index ranges before each launch (costs host syncs).

    Off by default: the engine only passes indices it built itself, and a check reads device
    memory back on every launch. Out-of-range indices are otherwise undefined behaviour (an
    illegal memory access on the GPU).
    """
    return os.environ.get("OASIS_KERNEL_CHECKS", "0") not in ("", "0")


def check_range(t: torch.Tensor, lo: int, hi: int, name: str) -> None:
    """Raise ``IndexError`` naming ``name`` unless every element of ``t`` is in ``[lo, hi)``."""
    if t.numel() and (int(t.min()) < lo or int(t.max()) >= hi):
        raise IndexError(f"OasisKV kernels: {name} must lie in [{lo}, {hi}), got values in "
                         f"[{int(t.min())}, {int(t.max())}]")


def pair_tile_warps(k: int) -> int:
    """Warps of a one-program-per-(request, KV head) kernel holding ``[K, K]`` comparison tiles
    (kernels 6, 6b and 8) for ``k`` slots: 4 up to 128 (64 tile elements per thread), 8 above.
    Measured on the H100 at 40 x 16K, ``K`` 128 (2026-12-06, CUDA graphs, us per layer;
    docs/benchmarks/2026-12-06_select-warps-h100.md): churn replay 12.2 with 4 warps vs 22.2
    with 8, candidates 7.9 vs 11.6, plan 25.5 vs 26.9."""
    return 4 if next_pow2(k) <= 128 else 8
