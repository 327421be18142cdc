"""Block predictors and the asynchronous predict / select / transfer pipeline.

Paper: Methodology — Look-ahead Attention (the draft token's query predicts the next step's
top-K blocks) and Asynchronous Prefetch Pipeline (three stages on their own CUDA streams, one
task per layer, ordered by CUDA events; layer ``l`` of step ``t+1`` waits only on layer ``l``'s
transfer).

Predictors say which query selects the blocks the *next* decode step will attend over:

============  =====================================================================  ========
name          query                                                                  async
============  =====================================================================  ========
lookahead     the draft token's query (paired forward: normal row + draft row)       yes
previous      this step's normal query (no draft model needed)                       yes
current       the next step's own query, on the critical path (the foundation path)  no
============  =====================================================================  ========

A prediction made at step ``t`` covers step ``t+1``'s context (one more token), so its forced
sink / recent blocks include the block the next token will be written into. A request's first
decode step is predicted at the end of its prefill from the last prompt token's query.

``PrefetchPipeline`` runs a layer's stages on three streams (CUDA) or inline in order (CPU, so
CI tests the same logic). Tensors crossing streams are kept referenced until the main stream
has waited on the layer's final event, so the caching allocator cannot hand their memory to new
work while a stage still reads it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class BasePredictor:
    """Which query row predicts the next step's working set.

    Attributes:
        name: registry name (the ``predictor`` key of ``--kv-sparse-config``).
        asynchronous: ``True`` when the prediction for step ``t+1`` is made at step ``t`` and
            runs off the critical path; ``False`` selects synchronously with the current query.
    """

    name = "base"
    asynchronous = True

    def query(self, q: torch.Tensor, q_draft: torch.Tensor | None) -> torch.Tensor:
        """The predicting query ``[B, Hq, D]`` from the normal ``q`` and the draft ``q_draft`` rows."""
        raise NotImplementedError


class CurrentPredictor(BasePredictor):
    """Synchronous selection with the step's own query (critical path; kept for measurement)."""

    name = "current"
    asynchronous = False

    def query(self, q, q_draft):
        return q


class PreviousPredictor(BasePredictor):
    """Step ``t``'s normal query predicts step ``t+1`` (no draft model)."""

    name = "previous"

    def query(self, q, q_draft):
        return q


class LookaheadPredictor(BasePredictor):
    """Step ``t``'s draft-token query (position ``t+1``) predicts step ``t+1``.

    Falls back to the normal query on a step without a draft row (e.g. a plain decode batch).
    """

    name = "lookahead"

    def query(self, q, q_draft):
        return q_draft if q_draft is not None else q


PREDICTORS: dict[str, type[BasePredictor]] = {
    p.name: p for p in (LookaheadPredictor, PreviousPredictor, CurrentPredictor)}


def get_predictor(name: str) -> BasePredictor:
    """The predictor registered under ``name``.

    Raises:
        KeyError: unknown name (the config validates names before this is called).
    """
    return PREDICTORS[name]()


class PrefetchPipeline:
    """Per-layer predict -> select -> transfer tasks on their own streams.

    Args:
        num_layers: sparse layers ``L`` (one task slot and one ready event each).
        device: CUDA runs the stages on three streams; any other device runs them inline.
    """

    STAGES = ("predict", "select", "transfer")

    def __init__(self, num_layers: int, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.L = num_layers
        self.timing = True       # record the exposed-wait timing events (off inside CUDA-graph capture)
        self._forked = False     # stage streams used since the last drain
        self.ready: list = [None] * num_layers          # last transfer event of each layer
        self._refs: list[list] = [[] for _ in range(num_layers)]
        self._wait_events: list = [None] * num_layers   # (before, after) timing events of the last wait
        if self.cuda:
            self.streams = [torch.cuda.Stream(self.device) for _ in self.STAGES]

    def launch(self, layer: int, stages: Sequence[Callable], keep: Sequence = ()) -> None:
        """Run ``stages`` for ``layer`` after the work already queued on the current stream.

        Stage ``i`` receives the value stage ``i-1`` returned (the first gets ``None``). On CUDA
        stage ``i`` runs on stream ``i`` and starts once stage ``i-1`` of the same layer is done;
        the layer's ready event is recorded after the last stage. ``keep`` (and every stage's
        return value) stays referenced until ``wait(layer)``.
        """
        assert len(stages) == len(self.STAGES)
        refs = self._refs[layer]
        refs.extend(keep)
        self._forked = True
        if not self.cuda:
            x = None
            for fn in stages:
                x = fn(x)
                refs.append(x)
            return
        prev = torch.cuda.current_stream(self.device)
        x = None
        for fn, s in zip(stages, self.streams):
            s.wait_stream(prev)
            with torch.cuda.stream(s):
                x = fn(x)
            refs.append(x)
            prev = s
        ev = torch.cuda.Event()
        ev.record(prev)
        self.ready[layer] = ev

    def wait(self, layer: int) -> None:
        """Make the current stream wait for ``layer``'s pending prefetch (no host sync)."""
        ev = self.ready[layer]
        if ev is None:
            self._refs[layer].clear()
            return
        cur = torch.cuda.current_stream(self.device)
        if self.timing:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(cur)
            cur.wait_event(ev)
            after.record(cur)
            self._wait_events[layer] = (before, after)
        else:
            cur.wait_event(ev)
        self.ready[layer] = None
        self._refs[layer].clear()    # safe: later allocations on this stream run after the wait

    def drain(self) -> None:
        """Make the current stream wait for every stage stream (before freeing request rows)."""
        if self.cuda and self._forked:    # (joining unused streams would break a CUDA-graph capture)
            cur = torch.cuda.current_stream(self.device)
            for s in self.streams:
                cur.wait_stream(s)
        self._forked = False

    def join(self) -> None:
        """``drain`` and forget every layer's pending event: the current stream now orders
        after all queued stages, so no later wait is needed (a CUDA-graph step ends with this,
        and a replay starts with it so it orders after eager prefetches)."""
        self.drain()
        self.ready = [None] * self.L
        for r in self._refs:
            r.clear()

    def forget_waits(self) -> None:
        """Drop the recorded wait timings (a replayed CUDA-graph step records none)."""
        self._wait_events = [None] * self.L

    def wait_events(self) -> list:
        """Each layer's last timed wait as recorded now: ``(before, after)`` CUDA events, or
        ``None`` (``core.report.snapshot`` keeps them; each wait records fresh events)."""
        return list(self._wait_events)

    def exposed_wait_ms(self) -> list[float]:
        """Milliseconds the compute stream stalled on each layer's transfer at its last wait.

        Synchronises on the timing events (call when reporting, not on the decode path).
        ``0.0`` on CPU (the stages run inline, so their time is on the critical path) and for
        layers that never waited.
        """
        out = []
        for ev in self._wait_events:
            if ev is None:
                out.append(0.0)
                continue
            ev[1].synchronize()
            out.append(ev[0].elapsed_time(ev[1]))
        return out
