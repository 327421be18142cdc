"""Fixes for SGLang 0.5.17 bugs and CPU gaps that are not OasisKV (each hook listed in ``hooks.HOOKS``).

  spec_cpu             EAGLE / n-gram speculative decoding on the CPU engine: the intel_amx
                       verify lengths (``intel_amx_backend.py:216`` / ``:262``), the backend's
                       platform fallback, the n-gram corpus build include
  cpu_paged_allocator  ``--page-size > 1`` on CPU: SGLang's paged allocator is Triton-only
  input_ids            out-of-vocabulary ``input_ids`` get a 400 instead of killing the scheduler
  pd_cpu               SGLang's PD mode with NIXL on the CPU engine: the pool registered as DRAM,
                       the early send of a cached prefix skipped
"""
