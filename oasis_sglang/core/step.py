"""One decode step as the engine sees it: ``StepMode`` and ``DecodeStep``.

SGLang prepares each forward batch through its attention backend's metadata hooks
(``layers/attention/base_attn_backend.py``): ``init_forward_metadata`` (eager),
``init_forward_metadata_out_graph`` (host side, before a CUDA-graph capture or replay) and
``init_forward_metadata_in_graph`` (device side, recorded in the graph). The glue maps them
onto ``OasisSparseKV.begin_decode_step`` (host) and ``prepare_step_device`` (device); every
sparse layer's ``decode_attention`` then reads the step from here, so no layer infers that a
new step began and no value is cached by tensor identity.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class StepMode(str, enum.Enum):
    """How the decode step runs.

    EAGER: run now, layer by layer (host bookkeeping and device work both happen).
    CAPTURE: SGLang captures (or warms up) a decode CUDA graph: nothing may read the host or
        the device's values; the top-K candidates span ``req_to_token``'s width.
    REPLAY: a captured step is about to be replayed: host bookkeeping only (the graph does
        the device work, including the LRU clock).
    """

    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


@dataclass
class DecodeStep:
    """The batch of one decode step.

    Attributes:
        mode: ``StepMode``.
        rows: ``[B]`` int64 request rows (device). seq: ``[B]`` int64 context lengths including
            the new token (device). req_to_token: SGLang's ``[R, max_len]`` int32 table (device).
        nb_max: blocks a row's context can span this step (``ceil(max_seq / block_size)``).
        max_seq: bound on ``seq`` (tokens): the host maximum (eager) or ``req_to_token``'s
            width (capture).
        rows_host, seq_host: the same rows and lengths as host integers, or ``None``.
        sync: select synchronously with this step's query (the predicted working set is not
            valid for every row, or the predictor is ``current``).
        timed: the exposed wait on transfers is timed (eager steps on CUDA).
        seq_m1, seq_p1, clock_next: ``seq - 1``, ``seq + 1`` and the LRU clock of the next step
            (device), set by ``OasisSparseKV.prepare_step_device`` (inside a captured graph).
        seq_offset: tokens ``prepare_step_device`` adds to ``seq_lens`` to make ``seq`` (a
            captured paired verify step: 1; eager steps add it at once and keep 0).
        seq_lens: the lengths as the caller passed them (``seq`` before ``seq_offset``).
        dense: the dense path for short contexts (``OasisConfig.dense_short_contexts``): every
            row's working set holds its whole context, so no sparse layer selects or copies. A
            ``capture`` step records the dense-path graph; a ``replay`` step says the caller
            must replay that graph (``sglang_glue/graph_hooks.py``).
    """

    mode: StepMode
    rows: torch.Tensor
    seq: torch.Tensor
    req_to_token: torch.Tensor
    nb_max: int
    max_seq: int
    rows_host: Sequence[int] | None = None
    seq_host: Sequence[int] | None = None
    sync: bool = False
    timed: bool = False
    seq_m1: torch.Tensor | None = None
    seq_p1: torch.Tensor | None = None
    clock_next: torch.Tensor | None = None
    seq_offset: int = 0
    seq_lens: torch.Tensor | None = None
    dense: bool = False

    def __post_init__(self):
        if self.seq_lens is None:
            self.seq_lens = self.seq

    @property
    def batch_size(self) -> int:
        """Rows in the batch (padding rows of a captured batch included)."""
        return self.rows.shape[0]
