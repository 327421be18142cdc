"""``TritonKVOps``: the ``core.ops.BaseKVOps`` interface served by the Triton kernels."""

from __future__ import annotations

import logging

from oasis_sglang.core.ops import BaseKVOps, TorchKVOps

from .append_tokens import append_tokens
from .copy_blocks import copy_blocks
from .dense_plan import dense_plan
from .paged_attention import paged_attention
from .plan_transfer import budget_candidates, plan_transfer
from .replay_churn import replay_churn
from .share_budget import share_budget
from .sparse_decode import sparse_decode_attention
from .topk import select_topk
from .write_kv import write_kv


# largest working set (blocks per request, layer and KV head) the one-program-per-(request, KV head)
# kernels take; larger budgets run the torch references of the same operations (more launches).
# plan_transfer holds [K, K] tiles in registers: K = 256 is a 4,096-token budget of 16-token blocks
MAX_FUSED_PLAN_K = 256
MAX_FUSED_APPEND_K = 4096

logger = logging.getLogger(__name__)


class TritonKVOps(BaseKVOps):
    """Triton kernels for the OasisKV operations (CUDA; CPU under ``TRITON_INTERPRET=1``).

    ``plan_transfer`` (and the step budget's and churn replay's kernels) fall back to the torch
    references (``TorchKVOps``, also capturable: no host sync) above ``MAX_FUSED_PLAN_K`` blocks,
    ``append_tokens`` and ``dense_plan`` above ``MAX_FUSED_APPEND_K``.
    """

    name = "triton"

    def __init__(self, copy_programs: int | None = None):
        import os

        # grid of copy_blocks (-1: one per two SMs, 0: one program per piece); env OASIS_COPY_PROGRAMS
        if copy_programs is None:
            raw = os.environ.get("OASIS_COPY_PROGRAMS", "").strip() or "-1"
            try:
                copy_programs = int(raw)
            except ValueError:
                raise ValueError(f"OASIS_COPY_PROGRAMS={raw!r}: want an integer (0: one program per piece; "
                                 f"unset: the default grid)") from None
        self.copy_programs = copy_programs
        # kernel 9 was exact-tested under the interpreter only when it landed (no GPU that session):
        # None until its first launch worked; False after a first launch failed (the reference then)
        self.dense_plan_kernel_ok: bool | None = None

    def write_kv(self, host_k, host_v, kmin, kmax, loc, k, v, block_size, one_token_each=False, write_host=True,
                 slots=None, dropped=None):
        """See :meth:`BaseKVOps.write_kv`; ``one_token_each`` skips segmenting (decode)."""
        write_kv(host_k, host_v, kmin, kmax, loc, k, v, block_size, one_token_each, write_host,
                 slots=slots, dropped=dropped)

    def select_topk(self, q, kmin, kmax, req_to_token, rows, seq_lens, block_size, sink_blocks,
                    recent_blocks, nb_max, k):
        """See :meth:`BaseKVOps.select_topk`."""
        return select_topk(q, kmin, kmax, req_to_token, rows, seq_lens, block_size, sink_blocks,
                           recent_blocks, nb_max, k)

    def copy_blocks(self, dst_k, dst_v, dst_idx, src_k, src_v, src_idx, counts=None):
        """See :meth:`BaseKVOps.copy_blocks`; the grid is ``copy_programs`` (``kernels.copy_blocks``)."""
        copy_blocks(dst_k, dst_v, dst_idx, src_k, src_v, src_idx, self.copy_programs, counts=counts)

    def budget_candidates(self, ids, rows, wanted, forced, fetch_cap, budget=None):
        """See :meth:`BaseKVOps.budget_candidates` (``kernels.plan_transfer.budget_candidates``)."""
        if ids.shape[-1] > MAX_FUSED_PLAN_K:
            return TorchKVOps.budget_candidates(self, ids, rows, wanted, forced, fetch_cap, budget)
        return budget_candidates(ids, rows, wanted, forced, fetch_cap, budget)

    def share_budget(self, cand_pos, budget, clock, k):
        """See :meth:`BaseKVOps.share_budget` (``kernels.share_budget``: one program)."""
        return share_budget(cand_pos, budget, clock, k)

    def replay_churn(self, wanted, forced, ids, rows, mean, seq, salt, nb_max):
        """See :meth:`BaseKVOps.replay_churn` (``kernels.replay_churn``: one launch per layer)."""
        if ids.shape[-1] > MAX_FUSED_PLAN_K:
            return TorchKVOps.replay_churn(self, wanted, forced, ids, rows, mean, seq, salt, nb_max)
        return replay_churn(wanted.contiguous(), forced.contiguous(), ids, rows, mean, seq, salt=salt)

    def plan_transfer(self, ids, last_used, rows, wanted, forced, step, fetch_cap, seq, req_to_token,
                      block_size, num_pages, counters, skip_row=None, allow=None, slots=None, dropped=None):
        """See :meth:`BaseKVOps.plan_transfer` (``kernels.plan_transfer``: one launch)."""
        if ids.shape[-1] > MAX_FUSED_PLAN_K:
            return TorchKVOps.plan_transfer(self, ids, last_used, rows, wanted, forced, step, fetch_cap, seq,
                                            req_to_token, block_size, num_pages, counters, skip_row, allow,
                                            slots=slots, dropped=dropped)
        return plan_transfer(ids, last_used, rows, wanted, forced, step, fetch_cap, seq, req_to_token, block_size,
                             num_pages, counters, skip_row, allow, slots=slots, dropped=dropped)

    def append_tokens(self, ws_k, ws_v, ids, rows, pos, k, v, host_k, host_v, req_to_token, violations,
                      counters, skip_row=None, fold=None, slots=None, dropped=None):
        """See :meth:`BaseKVOps.append_tokens` (``kernels.append_tokens``: one launch, the fold included)."""
        if ids.shape[-1] > MAX_FUSED_APPEND_K:
            return TorchKVOps.append_tokens(self, ws_k, ws_v, ids, rows, pos, k, v, host_k, host_v, req_to_token,
                                            violations, counters, skip_row, fold, slots=slots, dropped=dropped)
        append_tokens(ws_k, ws_v, ids, rows, pos, k, v, host_k, host_v, req_to_token, violations, counters, skip_row,
                      fold, slots=slots, dropped=dropped)

    def dense_plan(self, ids, last_used, rows, seq, block_size, pipelined, clock_next, counters, skip_row=None):
        """See :meth:`BaseKVOps.dense_plan` (``kernels.dense_plan``: one launch for every layer).

        If the kernel's first launch fails (a Triton compile or launch error: it had not run on
        every GPU when it landed), the error is logged once and the torch reference serves from
        then on (same effect, about 25 launches); a failure after a first success is raised."""
        if ids.shape[-1] > MAX_FUSED_APPEND_K or self.dense_plan_kernel_ok is False:
            return TorchKVOps.dense_plan(self, ids, last_used, rows, seq, block_size, pipelined, clock_next,
                                         counters, skip_row)
        if self.dense_plan_kernel_ok:
            return dense_plan(ids, last_used, rows, seq, block_size, pipelined, clock_next, counters, skip_row)
        try:                      # the first launch compiles; nothing is written before the launch
            dense_plan(ids, last_used, rows, seq, block_size, pipelined, clock_next, counters, skip_row)
        except AssertionError:
            raise                 # bad arguments (shape / dtype asserts): the caller's error
        except Exception as e:  # noqa: BLE001 - a kernel that cannot compile here: the reference does the same
            self.dense_plan_kernel_ok = False
            logger.error("OasisKV: kernel 9 (dense_plan) failed at its first launch (%s: %s); the dense path's "
                         "update runs the torch reference instead (same result, more launches)", type(e).__name__, e)
            return TorchKVOps.dense_plan(self, ids, last_used, rows, seq, block_size, pipelined, clock_next,
                                         counters, skip_row)
        self.dense_plan_kernel_ok = True

    def sparse_decode_attention(self, q, ws_k, ws_v, ids, rows, seq_lens, scale, k_extra=None,
                                v_extra=None, return_lse=False):
        """See :meth:`BaseKVOps.sparse_decode_attention`."""
        return sparse_decode_attention(q, ws_k, ws_v, ids, rows, seq_lens, scale, k_extra, v_extra, return_lse)

    def paged_attention(self, q, k_buf, v_buf, req_to_token, rows, kv_lens, scale, max_kv_len=None):
        """See :meth:`BaseKVOps.paged_attention`."""
        return paged_attention(q, k_buf, v_buf, req_to_token, rows, kv_lens, scale, max_kv_len)
