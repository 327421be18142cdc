"""PredictionRecord: for which context each request row's working set was last predicted.

An asynchronous predictor (``previous``, ``lookahead``; ``core/prefetch.py``) prefetches step
``t+1``'s working set during step ``t`` (or, for a request's first decode step, at the end of
its prefill). A step may use that working set only when every row of its batch was predicted
for exactly the step's context length; otherwise the step selects synchronously with its own
query (paper: Methodology, Asynchronous Prefetch Pipeline; a request resumed after retraction,
or a batch whose rows changed, is such a case).

The record is kept twice:

* on the device (``seq``, ``[R]`` int64, ``-1`` = never predicted), written by the first
  sparse layer's prediction in stream order, so it is always right;
* as a host mirror ``{row: context}`` updated from host integers the caller passes (SGLang's
  ``req_pool_indices`` from the scheduler, ``seq_lens_cpu``), so the per-step check and the
  CUDA-graph replay decision read no device memory. A prediction made without host values
  makes the mirror untrusted (``host is None``) until ``confirm`` rebuilds it from the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .devcopy import to_device

logger = logging.getLogger(__name__)


class PredictionRecord:
    """Context length each request row was last predicted for.

    Args:
        num_rows: request rows ``R`` (SGLang ``ReqToTokenPool`` size).
        device: where the device record lives.
    """

    def __init__(self, num_rows: int, device: torch.device | str):
        self.seq = torch.full((num_rows,), -1, dtype=torch.int64, device=device)   # [R] device record
        self.host: dict[int, int] | None = {}                                     # host mirror, None = untrusted

    @property
    def trusted(self) -> bool:
        """True while the host mirror is known to equal the device record."""
        return self.host is not None

    def mark(self, rows: torch.Tensor, seq_next: torch.Tensor) -> None:
        """Device record: ``rows [B]`` are predicted for context ``seq_next [B]`` (stream order,
        no host sync; graph-recordable)."""
        self.seq[rows] = seq_next

    def mirror(self, rows_host: Sequence[int] | None, seq_next_host: Sequence[int] | None) -> None:
        """Host mirror of ``mark``; ``rows_host=None`` (no host values) stops trusting it."""
        if self.host is None:
            return
        if rows_host is None or seq_next_host is None:
            self.host = None
            return
        self.host.update(zip(rows_host, seq_next_host))

    def all_predicted_host(self, rows_host: Sequence[int], seq_host: Sequence[int]) -> bool:
        """Every row was predicted for exactly its context, from the host mirror (no device
        read). Call only while ``trusted``."""
        return all(self.host.get(r) == x for r, x in zip(rows_host, seq_host))

    def lengths_host(self, rows_host: Sequence[int]) -> list[int] | None:
        """The context each of ``rows_host`` was last predicted for, from the host mirror (host
        integers, batch order), or ``None`` when the mirror is untrusted or a row has no
        prediction. With a draft that is never accepted (``sglang_glue.spec_probe``) every
        decode step adds exactly one token per request, so this is the step's context without a
        host read of SGLang's lengths (``sglang_glue.batch_info.host_lengths``)."""
        if self.host is None:
            return None
        out = [None if r is None else self.host.get(int(r)) for r in rows_host]
        return None if any(x is None for x in out) else out

    def all_predicted_device(self, rows: torch.Tensor, seq: torch.Tensor) -> bool:
        """The same check against the device record (one host read: a sync)."""
        return not bool((self.seq[rows] != seq).any())

    def can_replay(self, rows_host: Sequence[int] | None, seq_host: Sequence[int] | None) -> bool:
        """Host-only: every row of the batch was predicted for its context (``rows_host`` /
        ``seq_host``: host integers, batch order). False for missing or mismatched lists, a
        ``None`` row, or an untrusted mirror."""
        if rows_host is None or seq_host is None or len(rows_host) != len(seq_host) \
                or any(r is None for r in rows_host) or self.host is None:
            return False
        return all(self.host.get(int(r)) == int(x) for r, x in zip(rows_host, seq_host))

    def forget(self, rows) -> None:
        """Rows freed (or reallocated): nothing is predicted for them any more."""
        self.seq.index_fill_(0, to_device(rows, self.seq.device).reshape(-1), -1)   # no wait (devcopy)
        if self.host is not None:
            for r in torch.as_tensor(rows).reshape(-1).tolist():
                self.host.pop(int(r), None)

    def clear(self) -> None:
        """Nothing is predicted for any row (device and host; no wait). The mirror is trusted
        again (it equals the cleared device record)."""
        self.seq.fill_(-1)
        self.host = {}

    def confirm(self) -> None:
        """Compare the host mirror with the device record (a host read: call when reporting).

        A mismatch is logged as an error; either way, and when the mirror was untrusted, it is
        rebuilt from the device record, so the per-step check stays on the host."""
        dev = self.seq.tolist()
        if self.host is None:
            logger.info("OasisKV: rebuilding the host record of predictions from the device (a decode step "
                        "came without host rows, or a report found it wrong)")
        else:
            bad = _disagreeing(self.host, dev)
            if bad:
                logger.error("OasisKV: host record of predictions disagrees with the device for rows %s (host, "
                             "device); rebuilt from the device", bad)
        self.host = {r: s for r, s in enumerate(dev) if s >= 0}

    def confirm_copy(self, host: dict[int, int], dev: Sequence[int]) -> bool:
        """``confirm`` on copies taken at one point of the stream (``core.report.snapshot``: the
        mirror as it was when the device record's copy was queued), with no host read now.

        A mismatch is logged as an error and the live mirror is distrusted (the copy is too old
        to rebuild from; ``core.report.finish`` rebuilds it at once with ``confirm``). Returns
        True when the copies agree."""
        bad = _disagreeing(host, dev)
        if bad:
            logger.error("OasisKV: host record of predictions disagreed with the device for rows %s (host, "
                         "device); rebuilt from the device", bad)
            self.distrust()
        return not bad

    def distrust(self) -> None:
        """Stop trusting the mirror (every later step reads the device until ``confirm``)."""
        self.host = None


def _disagreeing(host: dict[int, int], dev: Sequence[int]) -> dict[int, tuple[int, int]]:
    """The first 8 rows of ``host`` whose context differs from ``dev``: ``{row: (host, device)}``."""
    bad = {r: (s, dev[r]) for r, s in host.items() if dev[r] != s}
    return dict(list(bad.items())[:8])
