"""oasis-sglang: OasisKV (host-tier KV cache with a bounded device working set) for SGLang 0.5.17.

Kept import-light: the interpreter-start hook (``oasis_sglang.cpu.finder``) imports it only when ``sgl_kernel`` is imported on a host without CUDA.
"""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.17"
