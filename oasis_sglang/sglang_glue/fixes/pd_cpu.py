"""SGLang's PD disaggregation (NIXL transfer backend) on the CPU engine: two gaps, not OasisKV.

Found by running ``--disaggregation-mode prefill|decode --disaggregation-transfer-backend nixl``
with ``--device cpu`` (SGLang 0.5.17, nixl 1.5.1 over UCX loopback, behind sglang-router):

- the KV pool is registered with NIXL as ``VRAM`` (``disaggregation/decode.py`` and the prefill
  side default ``kv_data_mem_kinds`` to VRAM; ``nixl/conn.py NixlKVManager``), which UCX cannot
  register for host memory: on the CPU engine the pool is ``DRAM``;
- the prefill's early send of a cached prefix records a ``torch.cuda.Event`` on the forward
  stream under the overlap scheduler (``prefill.py maybe_send_cached_prefix_chunk``), which
  fails without CUDA. The early send is optional (SGLang's final send covers the range), so on
  CPU it is skipped, as SGLang itself skips it for DCP pages.

- nixl's Python API makes every agent's progress thread spin a core (``pthrDelay = 0``); a PD
  pair on one 2-core machine has four agents. On CPU the agents pause 100 us between polls
  (``disagg.transport.set_progress_delay``).

The hooks are listed in ``hooks.HOOKS`` and act only when the server runs on the CPU (the
progress delay also wherever ``$OASIS_NIXL_PROGRESS_DELAY_US`` is set).
"""

from __future__ import annotations


def _on_cpu(server_args) -> bool:
    return str(getattr(server_args, "device", "") or "") == "cpu"


def nixl_manager_init_hook(self, args, disaggregation_mode, server_args, *rest, **kwargs):
    """BEFORE ``NixlKVManager.__init__(args: KVArgs, mode, server_args, ...)``: on CPU the KV
    buffers (``args.kv_data_ptrs``) are registered as ``DRAM``, and the NIXL agent it creates
    pauses between progress polls instead of spinning a core (``disagg.transport.progress_delay_us``;
    ``$OASIS_NIXL_PROGRESS_DELAY_US`` sets it on a GPU host too)."""
    from oasis_sglang.disagg.transport import progress_delay_us, set_progress_delay

    if _on_cpu(server_args):
        args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
    set_progress_delay(progress_delay_us(cpu=_on_cpu(server_args)))
    return None


def early_send_hook(original, self, req, *args, **kwargs):
    """AROUND ``SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk``: skipped on
    CPU (its CUDA event has no CPU equivalent; the final send covers the prefix)."""
    if _on_cpu(self.server_args):
        return None
    return original(self, req, *args, **kwargs)
