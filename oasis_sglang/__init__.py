"""oasis-sglang: OasisKV (host-tier KV cache with a bounded device working set) for SGLang 0.5.17.

Kept import-light: the interpreter-start hook (``_sgl_kernel_finder``) imports this package.
"""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.17"
