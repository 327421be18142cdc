"""Index copies to the device that do not wait for the device.

SGLang's overlap scheduler keeps the GPU one step ahead of the host. Two common torch idioms
make the host wait for that step:

- a copy from pageable host memory to the device first waits for every kernel queued on the
  stream (CUDA's rule for pageable host-to-device copies): ``torch.tensor(rows, device=dev)``,
  ``cpu_tensor.to(dev)``;
- ``t[idx] = 0`` on a CUDA tensor turns the Python scalar into a host tensor and copies it
  the same way.

Measured on the H200 (2026-12-04, ``torch.cuda._sleep`` of 0.5 s queued first): ``x[idx] = True``
waited 524 ms, ``pin_memory()`` of a fresh size 1.6 ms and did not wait. So request-lifetime
bookkeeping (rows freed, pages admitted or released) stages indices through page-locked
memory (``to_device``) and fills with ``Tensor.index_fill_`` (the scalar rides as a kernel
argument).
"""

from __future__ import annotations

import torch


def to_device(x, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``x`` (a host tensor, list or int) as a ``dtype`` tensor on ``device``.

    On CUDA a host value is staged through page-locked memory and copied ``non_blocking``:
    PyTorch's caching host allocator keeps the staging buffer until the copy has run (it
    records an event on the stream), so the caller may drop or change ``x`` at once. A tensor already on
    ``device`` is returned as it is (cast to ``dtype``).

    Returns:
        a tensor of ``x``'s shape on ``device``.
    Raises:
        TypeError / ValueError: ``x`` is not numeric (``torch.as_tensor``'s errors).
    Source: CUDA's rules for host-to-device copies (pageable memory is staged synchronously);
    PyTorch's ``CachingHostAllocator`` (``record_event`` on a non-blocking copy).
    """
    device = torch.device(device)
    t = torch.as_tensor(x, dtype=dtype)
    if t.device.type != "cpu" or device.type != "cuda":
        return t.to(device, dtype)
    # always a new page-locked copy (``pin_memory()`` returns a tensor already page-locked
    # as it is: the device would then read the caller's buffer after this returns)
    staged = torch.empty(t.shape, dtype=dtype, pin_memory=True).copy_(t)
    return staged.to(device, non_blocking=True)
