"""Teacher-forced simulation of OasisKV's block selection inside a Hugging Face model.

Used to measure accuracy the way long-context papers do (issue 4: teacher-forced decoding over
held-out text) and the agreement of block predictors, on CPU, without a server. One forward pass
over ``prefix + continuation`` stands for a prefill of the prefix followed by one decode step per
continuation token fed the true token. Registered as a transformers attention function
(``ALL_ATTENTION_FUNCTIONS``), it receives each layer's post-RoPE ``q [1, Hq, T, D]``,
``k / v [1, H, T, D]`` and:

- positions ``< prefix_len`` and dense layers attend causally to everything (prefill is dense);
- decode position ``t`` of a sparse layer attends, per KV head, only to the blocks OasisKV would
  hold: sink + recent blocks and the top-K complete blocks by Quest score
  (``core.selection.quest_scores`` / ``select_blocks``, the same functions the engine uses),
  ``K = budget_tokens // block_size`` in all;
- the query that selects the blocks is the predictor's: ``current`` = step ``t``'s own query (the
  synchronous foundation path, and the upper bound of look-ahead with a perfect draft),
  ``previous`` = step ``t-1``'s query (no draft model).

With ``fetch_cap=None`` the working set is exactly the predicted top-K each step. With a
``fetch_cap`` the working set of each (sparse layer, KV head) is carried from step to step
through the engine's own stage (b), ``core.working_set.plan_admissions``: the first decode step
fills the empty set, then each step admits missing predicted blocks, at most ``fetch_cap`` of
them evicting (LRU, forced sink / recent blocks always), and attention reads what is resident
(paper: Methodology, Delta Selection and Capped Eviction). ``admissions`` counts, per layer,
the predicted blocks that were missing and those admitted.
Per layer it records the agreement of ``previous`` with ``current`` on the non-forced top-K:
``|previous ∩ current| / |current|``.

Look-ahead agreement (paper: OasisKV, Methodology, Look-ahead Attention) takes two passes:

- pass 1 (``SimConfig(record=True)``, predictor ``current``): the teacher-forced run above; it
  records, per layer, the post-RoPE K/V of all true tokens and, per sparse layer and decode step
  ``t``, the selection ``S_t`` (``selected``) and the normal query ``q_t`` (``queries``);
- pass 2 (``pass1.for_drafts()``): all draft rows in one forward. Row ``i`` is the draft token
  ``d_{t+1}`` of step ``t = prefix_len + i``, at position ``t + 1`` (``position_ids``), run beside
  the normal token as in the paired forward of step ``t``: at a sparse layer it attends to the
  true tokens ``<= t`` of the blocks of ``S_t`` (forced sink/recent blocks of step ``t``
  included, so the normal token ``t`` too) and to itself; at a dense layer to all true tokens
  ``<= t`` and itself. The true tokens' K/V are pass 1's; the row's own k/v are computed in
  pass 2. Its post-RoPE query at each sparse layer selects ``P_{t+1}`` with Quest scores over
  the blocks complete at step ``t + 1`` and step ``t + 1``'s forced set (``select_blocks``, as
  in the engine).

Agreement of a predictor at a layer = mean over steps and KV heads of ``|P_{t+1} ∩ S_{t+1}| /
|S_{t+1}|`` on non-forced blocks (``lookahead_agreement``); ``previous`` predicts ``P_{t+1}``
with step ``t``'s normal query. Draft sources: ``oracle`` (the true next token) and ``ngram``
(``ngram_drafts``, model-free prompt lookup).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention

from ..core.selection import quest_scores, select_blocks
from ..core.summaries import SUMMARY_FORMATS, dequantize, quantize_outward
from ..core.budget import share_budget
from ..core.kv_dtype import as_stored
from ..core.working_set import budget_candidates, plan_admissions

NAME = "oasis_sim"
PREDICTORS = ("current", "previous")
LOOKAHEAD_PREDICTORS = ("lookahead-oracle", "lookahead-ngram", "previous")


@dataclass
class SimConfig:
    """What to simulate.

    Attributes:
        prefix_len: tokens of the prefill (decode steps start at this position).
        budget_tokens: working set per layer and KV head; ``None`` = dense everywhere.
        block_size, sink_blocks, recent_blocks, dense_layers: as in ``OasisConfig``.
        predictor: which query selects the blocks (``PREDICTORS``).
        chunk: decode positions scored at once (memory: ``chunk * blocks * H * D`` floats).
        agreement: ``{layer: [sum, count]}`` of ``previous``-vs-``current`` agreement (filled).
        record: pass 1 of the look-ahead measurement: fill ``kv``, ``selected`` and ``queries``.
        pass1: set (by ``for_drafts``) for pass 2: the forward is made of draft rows (see the
            module docstring) reading ``pass1``'s records; fills ``predicted`` and ``draft_queries``.
        on_layer: called with the layer index after each attention call (progress bars).
        kv: record: ``{layer: (k, v)}``, post-RoPE ``[H, T, D]`` of the true tokens, model dtype.
        selected: record: ``{sparse layer: (wanted, forced)}``, ``[N, H, K]`` int64 / bool as
            ``select_blocks`` returns them; row ``i`` = decode step ``t = prefix_len + i``
            (``N = T - prefix_len``), forced entries included.
        queries: record: ``{sparse layer: [N, Hq, D]}`` float32 post-RoPE normal queries ``q_t``.
        previous: record: ``{sparse layer: (wanted, forced)}`` ``[N, H, K]``: row ``i`` = the
            top-K of step ``t = prefix_len + i`` selected by step ``t - 1``'s query.
        predicted: pass 2: ``{sparse layer: (wanted, forced)}`` ``[M, H, K]``: the draft row's
            top-K for step ``t + 1``, row ``i`` = step ``t = prefix_len + i``.
        draft_queries: pass 2: ``{sparse layer: [M, Hq, D]}`` float32 post-RoPE draft queries.
        fetch_cap: evicting admissions per step and KV head (``None``: not simulated, the
            working set is the predicted top-K; ``>= budget_tokens // block_size``: unbounded,
            carried from step to step).
        step_budget: with ``fetch_cap``: candidates a layer may admit per step over its KV heads,
            shared by score rank (``core.budget.share_budget``; ``fetch_cap`` is the ceiling);
            ``None``: the cap alone.
        admissions: with ``fetch_cap``: ``{sparse layer: [missing, admitted, steps x KV heads]}``
            (filled): predicted non-resident blocks and blocks admitted, summed over decode steps
            after the first and KV heads.
        kv_dtype: the KV cache dtype to simulate (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``:
            every layer, dense ones too, attends over ``core.kv_dtype.as_stored`` K / V, as SGLang's
            fp8 KV cache and OasisKV's fp8 host tier hold them; ``None``: the model's dtype).
        summary_dtype: score 8-bit summaries rounded outwards (``core.summaries.quantize_outward``:
            ``"int8"`` or ``"fp8_e4m3"``, one scale per block and KV head) instead of the exact
            ones; ``None``: exact (the engine today).
        summary_agreement: with ``summary_dtype``: ``{sparse layer: [sum, count]}`` (filled) of the
            agreement of the top-K selected with 8-bit summaries with the top-K from exact ones
            (each step's own query, non-forced blocks).
        working_sets: with ``fetch_cap``: ``{sparse layer: (ids [1, H, K], last_used [1, H, K])}``
            the carried block table (internal; each forward starts from an empty one, while
            ``admissions`` keeps summing over the forwards run under the config).
    """

    prefix_len: int
    budget_tokens: int | None = 512
    block_size: int = 16
    sink_blocks: int = 1
    recent_blocks: int = 2
    dense_layers: tuple[int, ...] = (0, 1)
    predictor: str = "current"
    chunk: int = 128
    agreement: dict = field(default_factory=dict)      # layer -> [sum of agreement, count]
    record: bool = False
    pass1: SimConfig | None = None
    on_layer: Callable[[int], None] | None = None
    kv: dict = field(default_factory=dict)
    selected: dict = field(default_factory=dict)
    queries: dict = field(default_factory=dict)
    previous: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    draft_queries: dict = field(default_factory=dict)
    fetch_cap: int | None = None
    step_budget: int | None = None
    admissions: dict = field(default_factory=dict)
    working_sets: dict = field(default_factory=dict)
    kv_dtype: torch.dtype | None = None
    summary_dtype: str | None = None
    summary_agreement: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.summary_dtype is not None and self.summary_dtype not in SUMMARY_FORMATS:
            raise ValueError(f"summary_dtype must be None or one of {SUMMARY_FORMATS}, got {self.summary_dtype!r}")
        if self.fetch_cap is not None and (isinstance(self.fetch_cap, bool) or not isinstance(self.fetch_cap, int)
                                           or self.fetch_cap < 1):
            raise ValueError(f"fetch_cap must be a positive integer or None, got {self.fetch_cap!r}")
        if self.fetch_cap is not None and (self.budget_tokens is None or self.record or self.pass1 is not None):
            raise ValueError("fetch_cap is simulated only in a plain sparse run (a budget, no record / pass 2)")
        if self.step_budget is not None and (self.fetch_cap is None or isinstance(self.step_budget, bool)
                                             or not isinstance(self.step_budget, int) or self.step_budget < 0):
            raise ValueError(f"step_budget must be an integer >= 0 with a fetch_cap, got {self.step_budget!r}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {PREDICTORS}, got {self.predictor!r}")
        if self.budget_tokens is not None and self.budget_tokens % self.block_size:
            raise ValueError("budget_tokens must be a multiple of block_size")
        if self.pass1 is not None and not (self.pass1.record and self.pass1.predictor == "current"):
            raise ValueError("pass 2 needs a pass 1 run with record=True and predictor 'current'")

    def for_drafts(self) -> SimConfig:
        """The pass-2 config reading this (recorded, already run) pass-1 config."""
        if self.budget_tokens is not None and self.recent_blocks < 1:
            # the block holding position t + 1 is not summarised at step t: it must be forced
            raise ValueError("look-ahead simulation needs recent_blocks >= 1")
        return dataclasses.replace(self, record=False, pass1=self, agreement={}, kv={}, selected={},
                                   queries={}, previous={}, predicted={}, draft_queries={}, summary_agreement={})


_ACTIVE: list[SimConfig] = []


def block_summaries(k: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [H, T, D]`` -> ``(kmin, kmax) [NB, H, D]`` over each block's tokens (partial block: its tokens)."""
    H, T, D = k.shape
    nb = -(-T // bs)
    pad = nb * bs - T
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad))
    lo = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("inf")).view(H, nb, bs, D).amin(2)
    hi = kp.masked_fill(torch.arange(nb * bs, device=k.device)[None, :, None] >= T, float("-inf")).view(H, nb, bs, D).amax(2)
    return lo.transpose(0, 1).contiguous(), hi.transpose(0, 1).contiguous()


def _select(qsel: torch.Tensor, kmin, kmax, pos: torch.Tensor, cfg: SimConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K of decode positions ``pos [N]`` with selecting queries ``qsel [N, Hq, D]``."""
    bs = cfg.block_size
    n_ctx = pos + 1
    num_blocks, num_complete = (n_ctx + bs - 1) // bs, n_ctx // bs
    nb = int(num_blocks.max())
    N = qsel.shape[0]
    lo = kmin[:nb].unsqueeze(0).expand(N, -1, -1, -1)
    hi = kmax[:nb].unsqueeze(0).expand(N, -1, -1, -1)
    scores = quest_scores(qsel, lo, hi)                              # [N, H, nb]
    return select_blocks(scores, num_blocks, num_complete, cfg.budget_tokens // bs, cfg.sink_blocks, cfg.recent_blocks)


def _topk_set_agreement(a: torch.Tensor, fa: torch.Tensor, b: torch.Tensor, fb: torch.Tensor) -> tuple[float, int]:
    """Sum over rows of ``|a ∩ b| / |b|`` on non-forced entries, and the number of rows with a non-empty ``b``."""
    va, vb = (a >= 0) & ~fa, (b >= 0) & ~fb
    inter = ((b[..., :, None] == a[..., None, :]) & va[..., None, :]).any(-1) & vb
    nb = vb.sum(-1)
    ok = nb > 0
    return float((inter.sum(-1)[ok].float() / nb[ok].float()).sum()), int(ok.sum())


def oasis_sim_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: ``query [1, Hq, T, D]``, ``key/value [1, H, T, D]`` -> ``([1, T, Hq, Dv], None)``.

    With the active config's ``pass1`` set, the ``T`` rows are draft rows (``_draft_attention``).
    """
    cfg = _ACTIVE[-1]
    layer = getattr(module, "layer_idx", 0)
    out = _attention(cfg, layer, query, key, value, scaling)
    if cfg.on_layer is not None:
        cfg.on_layer(layer)
    return out, None


def _attention(cfg: SimConfig, layer: int, query, key, value, scaling) -> torch.Tensor:
    B, Hq, T, D = query.shape
    H = key.shape[1]
    G = Hq // H
    scale = scaling if scaling is not None else 1.0 / math.sqrt(D)
    if cfg.kv_dtype is not None:          # what an fp8 KV cache holds (every layer)
        key, value = as_stored(key, cfg.kv_dtype), as_stored(value, cfg.kv_dtype)
    if cfg.pass1 is not None:
        return _draft_attention(cfg, layer, query, key, value, scale)
    if cfg.record and B == 1:
        cfg.kv[layer] = (key[0].detach().clone(), value[0].detach().clone())
    out = scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=G > 1)
    P = cfg.prefix_len
    if B != 1 or cfg.budget_tokens is None or layer in cfg.dense_layers or T <= P:
        return out.transpose(1, 2).contiguous()
    q, k, v = query[0], key[0], value[0]                            # [Hq, T, D], [H, T, D]
    bs = cfg.block_size
    kmin, kmax = block_summaries(k.float(), bs)
    exact = None
    if cfg.summary_dtype is not None:
        exact = (kmin, kmax)
        qlo, qhi, qs = quantize_outward(kmin, kmax, cfg.summary_dtype)
        kmin, kmax = dequantize(qlo, qs), dequantize(qhi, qs)
    o = out[0].clone()                                              # [Hq, T, Dv]
    tok_block = torch.arange(T, device=q.device) // bs
    for s in range(P, T, cfg.chunk):
        pos = torch.arange(s, min(T, s + cfg.chunk), device=q.device)
        cur = q[:, pos].transpose(0, 1)                             # [N, Hq, D]
        w_cur, f_cur = _select(cur, kmin, kmax, pos, cfg)
        if exact is not None:
            w_ex, f_ex = _select(cur, exact[0], exact[1], pos, cfg)
            a, n = _topk_set_agreement(w_cur, f_cur, w_ex, f_ex)
            acc = cfg.summary_agreement.setdefault(layer, [0.0, 0])
            acc[0] += a
            acc[1] += n
        # both predictors every run: the agreement of `previous` with `current` is recorded
        w_prev, f_prev = _select(q[:, pos - 1].transpose(0, 1), kmin, kmax, pos, cfg)
        a, n = _topk_set_agreement(w_prev, f_prev, w_cur, f_cur)
        acc = cfg.agreement.setdefault(layer, [0.0, 0])
        acc[0] += a
        acc[1] += n
        if cfg.record:
            if s == P:
                cfg.selected[layer] = (w_cur.new_empty(T - P, *w_cur.shape[1:]), f_cur.new_empty(T - P, *f_cur.shape[1:]))
                cfg.previous[layer] = (w_cur.new_empty(T - P, *w_cur.shape[1:]), f_cur.new_empty(T - P, *f_cur.shape[1:]))
                cfg.queries[layer] = q.new_empty(T - P, Hq, D, dtype=torch.float32)
            cfg.selected[layer][0][pos - P], cfg.selected[layer][1][pos - P] = w_cur, f_cur
            cfg.previous[layer][0][pos - P], cfg.previous[layer][1][pos - P] = w_prev, f_prev
            cfg.queries[layer][pos - P] = cur.float()
        wanted = w_cur if cfg.predictor == "current" else w_prev
        if cfg.fetch_cap is not None:
            wanted = _carry_working_set(cfg, layer, wanted, f_cur if cfg.predictor == "current" else f_prev, pos)
        nbk = kmin.shape[0]
        held = torch.zeros(len(pos), H, nbk + 1, dtype=torch.bool, device=q.device)
        held.scatter_(2, torch.where(wanted >= 0, wanted, nbk), True)
        tmask = held[:, :, :nbk][:, :, tok_block] & (torch.arange(T, device=q.device)[None, None, :] <= pos[:, None, None])
        # attention of each decode position over its KV heads' resident tokens
        qq = q[:, pos].view(H, G, len(pos), D)
        sc = torch.einsum("hgnd,htd->hgnt", qq.float(), k.float()) * scale
        sc = sc.masked_fill(~tmask.permute(1, 0, 2)[:, None], float("-inf"))
        p = torch.softmax(sc, -1)
        o[:, pos] = torch.einsum("hgnt,htd->hgnd", p, v.float()).reshape(Hq, len(pos), -1).to(o.dtype)
    return o.unsqueeze(0).transpose(1, 2).contiguous()


def _carry_working_set(cfg: SimConfig, layer: int, wanted: torch.Tensor, forced: torch.Tensor,
                       pos: torch.Tensor) -> torch.Tensor:
    """The resident blocks ``[N, H, K]`` (``-1``: empty slot) at decode positions ``pos [N]``
    (consecutive) given the predicted ``wanted`` / ``forced`` ``[N, H, K]``: the layer's block
    table is updated one step at a time by ``plan_admissions`` with ``cfg.fetch_cap`` (and the
    share of ``cfg.step_budget`` of each KV head)."""
    N, H, K = wanted.shape
    if layer not in cfg.working_sets or int(pos[0]) == cfg.prefix_len:     # a forward starts empty
        cfg.working_sets[layer] = (torch.full((1, H, K), -1, dtype=torch.int64, device=wanted.device),
                                   torch.zeros((1, H, K), dtype=torch.int64, device=wanted.device))
    ids, last_used = cfg.working_sets[layer]
    row = torch.zeros(1, dtype=torch.int64, device=wanted.device)
    acc = cfg.admissions.setdefault(layer, [0, 0, 0])
    out = torch.empty_like(wanted)
    for i in range(N):
        first = bool((ids < 0).all())
        allow = None
        if cfg.step_budget is not None:
            cand = budget_candidates(ids, row, wanted[i:i + 1], forced[i:i + 1], cfg.fetch_cap)
            allow = share_budget(cand, torch.tensor(cfg.step_budget), pos[i].to(torch.int64), K)
        adm = plan_admissions(ids, last_used, row, wanted[i:i + 1], forced[i:i + 1], int(pos[i]), cfg.fetch_cap,
                              allow=allow)
        if not first:                                       # the first step fills an empty set
            acc[0] += int((wanted[i] >= 0).sum()) - int(adm.hits)
            acc[1] += int(adm.mask.sum())
            acc[2] += H
        out[i] = ids[0]
    return out


def _draft_attention(cfg: SimConfig, layer: int, query, key, value, scale: float) -> torch.Tensor:
    """Pass 2: attention of the draft rows (paper: Look-ahead Attention, the paired forward).

    Args:
        query: ``[1, Hq, M, D]`` post-RoPE queries of the draft rows; row ``i`` is the draft of
            step ``t = P + i`` at position ``t + 1`` (``P = pass1.prefix_len``, ``M <= N - 1``).
        key, value: ``[1, H, M, D]`` the draft rows' own post-RoPE k / v.
        scale: softmax scale.
    Returns:
        ``[1, M, Hq, Dv]`` in the query's dtype. Row ``i`` attends to pass 1's true-token K/V at
        positions ``<= t`` (sparse layer: only in the blocks of ``S_t``, forced ones and the
        normal token ``t`` included) and to its own k/v; nothing else (not other drafts). At a
        sparse layer, also stores the row's top-K for step ``t + 1`` (``cfg.predicted``) and its
        query (``cfg.draft_queries``).
    """
    p1 = cfg.pass1
    k_true, v_true = p1.kv[layer]                                   # [H, T, D] of the true tokens
    H, T, D = k_true.shape
    _, Hq, M, _ = query.shape
    G = Hq // H
    P = p1.prefix_len
    if query.shape[0] != 1 or M > T - P - 1:
        raise ValueError(f"pass 2 takes one sequence of at most {T - P - 1} draft rows, got {tuple(query.shape)}")
    dev = query.device
    q = query[0].float()                                             # [Hq, M, D]
    ks, vs = key[0].float(), value[0].float()                        # [H, M, D]
    kt, vt = k_true.float(), v_true.float()
    sparse = p1.budget_tokens is not None and layer not in p1.dense_layers
    bs = p1.block_size
    tok = torch.arange(T, device=dev)
    tok_block = tok // bs
    out = torch.empty(Hq, M, vt.shape[-1], dtype=torch.float32, device=dev)
    for s in range(0, M, p1.chunk):
        r = torch.arange(s, min(M, s + p1.chunk), device=dev)
        t = P + r                                                    # step of each row
        m = len(r)
        allowed = (tok[None, :] <= t[:, None])[:, None, :].expand(m, H, T)
        if sparse:
            wanted = p1.selected[layer][0][r]                        # S_t, forced included [m, H, K]
            nbk = -(-T // bs)
            held = torch.zeros(m, H, nbk + 1, dtype=torch.bool, device=dev)
            held.scatter_(2, torch.where(wanted >= 0, wanted, nbk), True)
            allowed = allowed & held[:, :, :nbk][:, :, tok_block]
            allowed[torch.arange(m, device=dev), :, t] = True         # the normal token t (in a forced block anyway)
        qq = q[:, r].view(H, G, m, D)
        sc = torch.einsum("hgmd,htd->hgmt", qq, kt) * scale
        sc = sc.masked_fill(~allowed.permute(1, 0, 2)[:, None], float("-inf"))
        own = (qq * ks[:, None, r]).sum(-1, keepdim=True) * scale    # [H, G, m, 1]
        p = torch.softmax(torch.cat([sc, own], -1), -1)
        o = torch.einsum("hgmt,htd->hgmd", p[..., :T], vt) + p[..., T:] * vs[:, None, r]
        out[:, r] = o.reshape(Hq, m, -1)
    if sparse:
        kmin, kmax = block_summaries(kt, bs)
        qsel = q.transpose(0, 1).contiguous()                        # [M, Hq, D]
        cfg.predicted[layer] = _select(qsel, kmin, kmax, P + torch.arange(M, device=dev) + 1, p1)
        cfg.draft_queries[layer] = qsel
    return out.to(query.dtype).unsqueeze(0).transpose(1, 2).contiguous()


def previous_prediction(p1: SimConfig, layer: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``previous`` predictor from pass 1's records: step ``t``'s normal query selects for step
    ``t + 1`` (its forced set, blocks complete at ``t + 1``); rows ``t = P .. P + steps - 1``.
    Returns ``(wanted, forced)`` ``[steps, H, K]`` (recorded by pass 1 as it ran)."""
    w, f = p1.previous[layer]
    return w[1:steps + 1], f[1:steps + 1]


def prediction_agreement(p1: SimConfig, predicted: dict) -> dict[int, tuple[float, int]]:
    """Per sparse layer ``(sum, count)`` of ``|P_{t+1} ∩ S_{t+1}| / |S_{t+1}|`` (non-forced) over
    steps and KV heads; ``predicted``: ``{layer: (wanted, forced) [M, H, K]}``, row ``i`` = step
    ``t = P + i``, compared with pass 1's ``S_{t+1}`` = ``selected`` row ``i + 1``."""
    res = {}
    for layer, (w, f) in sorted(predicted.items()):
        M = w.shape[0]
        sw, sf = p1.selected[layer]
        res[layer] = _topk_set_agreement(w, f, sw[1:M + 1], sf[1:M + 1])
    return res


def ngram_drafts(ids: Sequence[int], start: int, end: int, max_n: int = 3) -> list[int]:
    """Model-free prompt-lookup drafter: the draft ``d_{t+1}`` for each ``t in [start, end)``.

    For the context ``ids[:t + 1]``, take its suffix of ``n`` tokens, ``n = max_n .. 1``; at the
    first ``n`` whose suffix also occurs earlier (ending at ``j < t``), propose the token that
    followed its most recent earlier occurrence, ``ids[j + 1]``; with no match, repeat
    ``ids[t]``. (Prompt lookup decoding; the draft source of the look-ahead measurement.)

    Args:
        ids: token ids, ``len(ids) >= end``.
    Returns:
        ``end - start`` token ids; element ``i`` is the draft for position ``start + i + 1``.
    """
    ids = [int(x) for x in ids]
    last: list[dict] = [dict() for _ in range(max_n + 1)]           # n -> {n-gram: last end j}
    built = 0                                                        # n-grams ending at j < built indexed

    def index_upto(t: int) -> None:
        nonlocal built
        for j in range(built, t):                                    # ends j whose follower ids[j + 1] <= t
            for n in range(1, max_n + 1):
                if j - n + 1 >= 0:
                    last[n][tuple(ids[j - n + 1:j + 1])] = j
        built = max(built, t)

    out = []
    for t in range(start, end):
        index_upto(t)
        d = ids[t]
        for n in range(max_n, 0, -1):
            if t - n + 1 < 0:
                continue
            j = last[n].get(tuple(ids[t - n + 1:t + 1]))
            if j is not None:
                d = ids[j + 1]
                break
        out.append(d)
    return out


@torch.inference_mode()
def lookahead_agreement(model, ids: torch.Tensor, prefix_len: int, drafts: dict[str, torch.Tensor],
                        on_pass: Callable[[str], None] | None = None, on_layer: Callable[[int], None] | None = None,
                        **cfg) -> tuple[dict[str, dict[int, tuple[float, int]]], SimConfig, dict[str, SimConfig]]:
    """Agreement of the look-ahead (one per draft source) and ``previous`` predictors with ``current``.

    Args:
        model: a causal LM loaded with ``attn_implementation=register()``.
        ids: ``[T]`` int64 true tokens; ``T - prefix_len = N`` decode steps.
        drafts: ``{source: [M] int64}``, ``M <= N - 1``: the draft of step ``t = prefix_len + i``
            (token for position ``t + 1``) at index ``i``.
        on_pass: called with ``"pass1"`` / the source name after each forward.
        cfg: further ``SimConfig`` fields (``budget_tokens``, ``block_size``, ...).
    Returns:
        ``({predictor: {layer: (sum, count)}}, pass-1 config, {source: pass-2 config})`` with
        predictors ``lookahead-<source>`` and ``previous``, all over the steps of the first
        ``min(M)`` drafts.
    """
    T = ids.shape[-1]
    p1 = SimConfig(prefix_len=prefix_len, record=True, predictor="current", on_layer=on_layer, **cfg)
    with simulate(p1):
        model(ids.view(1, T), logits_to_keep=1, use_cache=False)
    if on_pass:
        on_pass("pass1")
    res, runs = {}, {}
    steps = min([T - prefix_len - 1] + [len(d) for d in drafts.values()])
    for name, d in drafts.items():
        p2 = p1.for_drafts()
        pos = torch.arange(len(d), device=ids.device) + prefix_len + 1
        with simulate(p2):
            model(d.view(1, -1).to(ids.device), position_ids=pos[None], logits_to_keep=1, use_cache=False)
        if on_pass:
            on_pass(name)
        res[f"lookahead-{name}"] = prediction_agreement(p1, {k: (w[:steps], f[:steps]) for k, (w, f) in p2.predicted.items()})
        runs[name] = p2
    res["previous"] = prediction_agreement(p1, {layer: previous_prediction(p1, layer, steps) for layer in p1.selected})
    return res, p1, runs


def register() -> str:
    """Register ``oasis_sim`` with transformers; returns the name for ``attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, oasis_sim_attention)
    return NAME


class simulate:
    """Context manager activating a :class:`SimConfig` for forwards of a model loaded with
    ``attn_implementation="oasis_sim"``."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg

    def __enter__(self) -> SimConfig:
        _ACTIVE.append(self.cfg)
        return self.cfg

    def __exit__(self, *exc):
        _ACTIVE.remove(self.cfg)
        return False
