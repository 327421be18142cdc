"""The one OasisKV configuration: a frozen dataclass validated on creation.

Parsed from ``--kv-sparse-config JSON`` (the style of SGLang's ``--hisparse-config``).
Every error is an :class:`OasisConfigError` (a ``ValueError``) whose message names the
offending key, so a bad flag fails at start-up with a readable line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union


MAX_BUDGET_TOKENS = 1 << 20   # beyond any context SGLang serves; the model check is tighter
KERNEL_CHOICES = ("auto", "triton", "torch")
PREDICTOR_CHOICES = ("auto", "lookahead", "previous", "current")   # core.prefetch.PREDICTORS + auto
PD_READ_MODES = ("deferred", "wait")


class OasisConfigError(ValueError):
    """A ``--kv-sparse-config`` key is unknown, mistyped or out of range."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _no_repeated_keys(pairs: list) -> dict:
    """``json.loads`` hook: a key given twice in one object is an error, not "the last one wins"."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise OasisConfigError(f"kv_sparse_config: key '{k}' is given twice")
        d[k] = v
    return d


@dataclass(frozen=True)
class OasisConfig:
    """OasisKV settings (paper: Methodology; Quest for the block summaries).

    Attributes:
        budget_tokens: working set per request, layer and KV head, in tokens. The device
            holds at most ``budget_tokens // block_size`` blocks for each (request, sparse
            layer, KV head). Default 2048. Must be a multiple of ``block_size``.
        block_size: tokens per block (the unit of selection, summary and transfer), equal
            to SGLang's ``--page-size``. Default 16; a power of two in [1, 256].
        fetch_cap: most blocks admitted per step per (request, layer, KV head) that each
            evict a resident block (paper: capped eviction). Filling a free slot is not
            capped. ``None`` means unbounded. Default 8.
        sink_blocks: leading blocks always resident (attention sinks). Default 1.
        recent_blocks: trailing blocks always resident, counting the block that holds the
            token being decoded. Default 2; at least 1.
        dense_layers: layers that keep the full KV cache on the device and use SGLang's
            attention backend unchanged (Quest keeps the first two dense). Default (0, 1).
        kernels: implementation of the OasisKV operations: ``"triton"`` (the kernels in
            ``oasis_sglang.kernels``; CUDA only), ``"torch"`` (the references in
            ``core.ops``) or ``"auto"`` (triton on CUDA, torch otherwise). Default "auto".
        predictor: which query predicts the next step's working set (``core.prefetch``):
            ``"lookahead"`` (the speculative draft token's query; needs
            ``--speculative-algorithm``), ``"previous"`` (this step's query), ``"current"``
            (synchronous, on the critical path) or ``"auto"`` (lookahead with a draft, else
            current: without a draft, the one-step-late ``previous`` query loses needles that
            ``current`` finds at budget 512 on SmolLM2, docs/benchmarks.md). Default "auto".
        transfer_budget: admissions per decode step over all (request, sparse layer, KV head),
            shared by score rank (``core.budget``; paper eq. 3, ``C = B_link x T_step``):
            ``"auto"`` (0.8 of what the host link moves in a step: its rate measured at
            start-up times the decode step time measured while serving), a number in (0, 1]
            with a decimal point (that fraction instead of 0.8), an integer (bytes per step), or
            ``null`` (no step budget: ``fetch_cap`` alone). ``fetch_cap`` stays the per-head
            ceiling; free-slot fills and sink / recent blocks are never refused. Default "auto"
            (on CPU, where nothing crosses a link, it stays unlimited).
        pd_lease_s: PD: seconds a prefill node keeps a transferred request's KV pages (its
            host-tier blocks are the decode node's staging pool, read on demand) without a
            release (request finished) or a renewal (sent every quarter to three eighths of the
            lease while the request is admitted, by a thread of the decode node's process) from its decode node:
            the longest a decode node that died holds its requests' pages there. Default 60; 1..86400.
        pd_read_timeout_s: PD decode node: deadline in seconds of one NIXL read of blocks from
            a prefill node; a read that fails or runs past it marks that node lost and ends its
            requests with an error (``disagg/serving.py``). Default 10; > 0.
        pd_read_mode: PD decode node: what a predicted (prefetched) step does with a block its
            plan wants that has not been read from the prefill node yet (``core/remote.py``):
            ``"deferred"`` (the plan leaves it out and keeps the resident set for that step;
            the read is made once per step, at the next step's start, for every layer and
            request together, and the block can be admitted from the step after: no host read
            inside a step) or ``"wait"`` (each layer's transfer
            stage reads it before copying: outputs equal colocated decoding, one host read of
            the plan per layer and step). A request's first decode step after admission always
            waits, and so does every step with ``predictor: current`` (it selects with its own
            query). Default "deferred".
        pd_host_slots: PD decode node: ``null`` (default) keeps a host tier of every block
            (page-locked whole at start-up on a GPU); an integer ``S`` gives it a *compact* tier
            instead: one pool of ``S`` (sparse layer, KV head, block) pieces per TP rank
            (``S * block_size * (head_dim + v_head_dim) * dtype bytes`` of host memory), which
            holds only the pieces read from prefill nodes or decoded there and gives them back
            when their request ends. When it is full, reads wait for a later step (counted and
            warned about) and decoded blocks without a slot are not written back (counted).
            Ignored on other nodes. 1 .. 2**31 - 1.
        measure_agreement: also score each step's own query and record, per layer, how much of
            its top-K the prediction held (costs the synchronous scoring; measurement only).
            Default false.
        dense_short_contexts: a decode step whose every request's context (the next token's
            included) fits the working set, and whose working sets already hold every block of
            it, runs the dense path: no scoring, top-K, plan or host-to-device copy in any
            sparse layer; the new token's block gets a free slot once per step for all layers
            (``OasisSparseKV.begin_decode_step``). Attention is over all of each context, as
            the full path's selection would pick, and the outputs are bitwise the full path's.
            With CUDA graphs the dense path is a second decode graph of each batch size, replayed
            when the step qualifies (``OasisSparseKV.can_capture_dense``; not with
            ``measure_agreement``, on a PD decode node or under the benchmarks' prefetch hooks,
            which replay the full path). Default true.

    Raises:
        OasisConfigError: on any invalid value, naming the key.
    """

    budget_tokens: int = 2048
    block_size: int = 16
    fetch_cap: Optional[int] = 8
    sink_blocks: int = 1
    recent_blocks: int = 2
    dense_layers: tuple[int, ...] = field(default=(0, 1))
    kernels: str = "auto"
    predictor: str = "auto"
    measure_agreement: bool = False
    dense_short_contexts: bool = True
    transfer_budget: Union[str, int, float, None] = "auto"
    pd_lease_s: float = 60.0
    pd_read_timeout_s: float = 10.0
    pd_read_mode: str = "deferred"
    pd_host_slots: Optional[int] = None

    def __post_init__(self) -> None:
        for key in ("budget_tokens", "block_size", "sink_blocks", "recent_blocks"):
            if not _is_int(getattr(self, key)):
                raise OasisConfigError(
                    f"kv_sparse_config: '{key}' must be an integer, got {getattr(self, key)!r}")
        bs = self.block_size
        if bs < 1 or bs > 256 or bs & (bs - 1):
            raise OasisConfigError(
                f"kv_sparse_config: 'block_size' must be a power of two in [1, 256], got {bs}")
        if self.sink_blocks < 0:
            raise OasisConfigError(f"kv_sparse_config: 'sink_blocks' must be >= 0, got {self.sink_blocks}")
        if self.recent_blocks < 1:
            raise OasisConfigError(
                f"kv_sparse_config: 'recent_blocks' must be >= 1 (the block being decoded is "
                f"always resident), got {self.recent_blocks}")
        if self.budget_tokens <= 0 or self.budget_tokens % bs or self.budget_tokens > MAX_BUDGET_TOKENS:
            raise OasisConfigError(
                f"kv_sparse_config: 'budget_tokens' must be a positive multiple of block_size "
                f"({bs}) and at most {MAX_BUDGET_TOKENS}, got {self.budget_tokens}")
        if self.budget_blocks <= self.sink_blocks + self.recent_blocks:
            raise OasisConfigError(
                f"kv_sparse_config: 'budget_tokens' ({self.budget_tokens}) leaves no room for top-K "
                f"blocks beside sink_blocks={self.sink_blocks} and recent_blocks={self.recent_blocks} "
                f"(needs more than {(self.sink_blocks + self.recent_blocks) * bs} tokens)")
        if self.fetch_cap is not None and (not _is_int(self.fetch_cap) or self.fetch_cap < 1):
            raise OasisConfigError(
                f"kv_sparse_config: 'fetch_cap' must be a positive integer or null, got {self.fetch_cap!r}")
        layers = self.dense_layers
        if isinstance(layers, list):
            layers = tuple(layers)
            object.__setattr__(self, "dense_layers", layers)
        if not isinstance(layers, tuple) or not all(_is_int(x) and x >= 0 for x in layers):
            raise OasisConfigError(
                f"kv_sparse_config: 'dense_layers' must be a list of layer indices >= 0, got "
                f"{list(layers) if isinstance(layers, tuple) else layers!r}")
        if len(set(layers)) != len(layers):
            raise OasisConfigError(f"kv_sparse_config: 'dense_layers' has duplicates: {list(layers)}")
        object.__setattr__(self, "dense_layers", tuple(sorted(layers)))
        if self.kernels not in KERNEL_CHOICES:
            raise OasisConfigError(
                f"kv_sparse_config: 'kernels' must be one of {list(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.predictor not in PREDICTOR_CHOICES:
            raise OasisConfigError(
                f"kv_sparse_config: 'predictor' must be one of {list(PREDICTOR_CHOICES)}, got {self.predictor!r}")
        tb = self.transfer_budget
        if not (tb is None or tb == "auto" or (_is_int(tb) and 1 <= tb <= 2**62)
                or (isinstance(tb, float) and 0.0 < tb <= 1.0)):
            raise OasisConfigError(
                f"kv_sparse_config: 'transfer_budget' must be \"auto\", a link fraction in (0, 1] (e.g. 0.5), "
                f"a positive integer of bytes per decode step (at most 2**62), or null; got {tb!r}")
        for key in ("pd_lease_s", "pd_read_timeout_s"):
            val = getattr(self, key)
            try:
                ok = not isinstance(val, bool) and isinstance(val, (int, float)) and 0 < float(val) < math.inf
            except OverflowError:
                ok = False
            if not ok:
                raise OasisConfigError(f"kv_sparse_config: '{key}' must be a positive number of seconds, got {val!r}")
            object.__setattr__(self, key, float(val))
        if not 1.0 <= self.pd_lease_s <= 86400.0:
            # renewed every quarter to three eighths of a lease by a thread: below a second it would mostly spin, and a
            # lease would lapse on any hiccup of the decode node; above a day a dead node's pages stay held
            raise OasisConfigError(f"kv_sparse_config: 'pd_lease_s' must be at least 1 second and at most 86400 "
                                   f"(a day), got {self.pd_lease_s!r}")
        if not 0.01 <= self.pd_read_timeout_s <= 3600.0:
            # below 10 ms a READ of one step's blocks over a real link would always be late (the node lost); above
            # an hour a stopped prefill node would hold its requests that long (and Thread.join overflows past ~1e11)
            raise OasisConfigError(f"kv_sparse_config: 'pd_read_timeout_s' must be at least 0.01 and at most 3600 "
                                   f"seconds, got {self.pd_read_timeout_s!r}")
        if self.pd_read_mode not in PD_READ_MODES:
            raise OasisConfigError(
                f"kv_sparse_config: 'pd_read_mode' must be one of {list(PD_READ_MODES)}, got {self.pd_read_mode!r}")
        hs = self.pd_host_slots
        if hs is not None and not (_is_int(hs) and 1 <= hs < 2**31):
            raise OasisConfigError(f"kv_sparse_config: 'pd_host_slots' must be null (the whole host tier) or a "
                                   f"positive integer of pieces below 2**31, got {hs!r}")
        for key in ("measure_agreement", "dense_short_contexts"):
            if not isinstance(getattr(self, key), bool):
                raise OasisConfigError(f"kv_sparse_config: '{key}' must be true or false, got {getattr(self, key)!r}")

    def predictor_for(self, has_draft: bool, model_free_draft: bool = False) -> str:
        """The predictor name for a server with (``has_draft``) or without speculative decoding.

        ``"auto"`` is ``"lookahead"`` with a draft model (EAGLE-3, EAGLE, STANDALONE) and
        ``"current"`` without one, including SGLang's model-free n-gram drafter
        (``model_free_draft``): its drafts rarely match on prose (~11% in the simulation), so its
        look-ahead predicts about as well as ``"previous"``, which lost needles at budget 512 that
        ``"current"`` answers (docs/benchmarks.md). ``"lookahead"`` with NGRAM stays available.

        Raises:
            OasisConfigError: ``predictor="lookahead"`` without a draft source, or
                ``measure_agreement`` with the synchronous ``current`` predictor.
        """
        name = self.predictor
        if name == "auto":
            name = "lookahead" if has_draft and not model_free_draft else "current"
        if name == "lookahead" and not has_draft:
            raise OasisConfigError(
                "kv_sparse_config: 'predictor' is \"lookahead\" but no draft runs beside the normal "
                "token; add --speculative-algorithm EAGLE3 (or EAGLE, or STANDALONE with a small "
                "draft model), or use \"previous\"")
        if self.measure_agreement and name == "current":
            raise OasisConfigError(
                "kv_sparse_config: 'measure_agreement' compares a prediction made a step ahead with the "
                "step's own top-K; the \"current\" predictor makes none (use \"previous\" or a draft "
                "with \"lookahead\")")
        return name

    def kernel_backend(self, device_type: str) -> str:
        """The ops backend for a device type (``"cuda"``, ``"cpu"``): resolves ``"auto"``.

        Raises:
            OasisConfigError: ``kernels="triton"`` on a device other than CUDA.
        """
        device_type = str(device_type).split(":")[0]
        if self.kernels == "auto":
            return "triton" if device_type == "cuda" else "torch"
        if self.kernels == "triton" and device_type != "cuda":
            raise OasisConfigError(
                f"kv_sparse_config: 'kernels' is \"triton\" but the device is {device_type}; "
                f"the Triton kernels need CUDA (use \"torch\" or \"auto\")")
        return self.kernels

    @property
    def budget_blocks(self) -> int:
        """Working-set slots per (request, layer, KV head), in blocks."""
        return self.budget_tokens // self.block_size

    @classmethod
    def keys(cls) -> list[str]:
        """Names of the valid ``--kv-sparse-config`` keys."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: dict) -> "OasisConfig":
        """Build from a mapping; unknown keys raise :class:`OasisConfigError`."""
        if not isinstance(d, dict):
            raise OasisConfigError(f"kv_sparse_config must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(cls.keys()))
        if unknown:
            raise OasisConfigError(
                f"kv_sparse_config: unknown key '{unknown[0]}' (valid keys: {', '.join(cls.keys())})")
        return cls(**d)

    @classmethod
    def from_json(cls, text: Optional[str]) -> "OasisConfig":
        """Parse ``--kv-sparse-config``; ``None`` or empty gives the defaults.

        Raises:
            OasisConfigError: not JSON, a key given twice, not an object, or a bad key / value.
        """
        if text is None or not str(text).strip():
            return cls()
        shown = text if len(str(text)) <= 200 else str(text)[:200] + f"... ({len(str(text))} characters)"
        try:
            d = json.loads(text, object_pairs_hook=_no_repeated_keys)
        except OasisConfigError:
            raise
        except (json.JSONDecodeError, ValueError) as e:
            raise OasisConfigError(f"kv_sparse_config is not valid JSON ({e}): {shown!r}") from None
        except RecursionError:
            raise OasisConfigError(f"kv_sparse_config is nested too deeply to parse: {shown!r}") from None
        return cls.from_dict(d)

    def check_model(self, num_layers: int) -> None:
        """Check the layer indices against the model.

        Raises:
            OasisConfigError: a dense layer index is >= ``num_layers``.
        """
        bad = [x for x in self.dense_layers if x >= num_layers]
        if bad:
            raise OasisConfigError(
                f"kv_sparse_config: 'dense_layers' index {bad[0]} is out of range: the model has "
                f"{num_layers} layers")

    def to_json(self) -> str:
        """Normalised JSON of this config (round-trips through ``from_json``)."""
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        return json.dumps(d)
