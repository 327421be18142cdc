"""Triton kernels of OasisKV (imported as ``oasis_sglang.kernels``).

Planned (the kernel milestone): key-summary update, block scoring +
top-K, sparse decode attention over head-wise working sets, and the zero-copy host-to-device
block gather. Each kernel will sit beside its torch reference in ``oasis_sglang.core``.
Empty for now: the foundation uses the torch references on every device.
"""
