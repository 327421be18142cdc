"""The teacher-forced selection simulation (oasis_sglang.eval.sparse_sim) used by
scripts/measure_agreement.py: attention per decode position over exactly the selected blocks,
and equality with dense when the budget covers the context (real SmolLM2)."""

import types

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from oasis_sglang.core.selection import quest_scores, select_blocks
from oasis_sglang.eval import sparse_sim


def test_block_summaries_cover_partial_blocks(seed):
    k = torch.randn(3, 37, 8)
    lo, hi = sparse_sim.block_summaries(k, 16)
    assert lo.shape == (3, 3, 8)
    full = k[:, :32].reshape(3, 2, 16, 8)
    ref_lo, ref_hi = full.amin(2), full.amax(2)
    assert torch.equal(lo[:2], ref_lo.transpose(0, 1)) and torch.equal(hi[:2], ref_hi.transpose(0, 1))
    assert torch.equal(lo[2], k[:, 32:].amin(1)) and torch.equal(hi[2], k[:, 32:].amax(1))


@pytest.mark.parametrize("predictor", ["current", "previous"])
def test_decode_positions_attend_exactly_the_selected_blocks(seed, predictor):
    H, G, T, D, P, bs = 2, 3, 150, 16, 100, 8
    q, k, v = torch.randn(1, H * G, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    cfg = sparse_sim.SimConfig(prefix_len=P, budget_tokens=48, block_size=bs, dense_layers=(), predictor=predictor, chunk=16)
    with sparse_sim.simulate(cfg):
        out, _ = sparse_sim.oasis_sim_attention(types.SimpleNamespace(layer_idx=3), q, k, v, None)
    dense = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(out[:, :P], dense[:, :P])                    # prefill is dense
    kmin, kmax = sparse_sim.block_summaries(k[0], bs)
    for t in (P, P + 7, T - 1):
        qsel = q[0, :, t - (predictor == "previous")]
        nb, nc = -(-(t + 1) // bs), (t + 1) // bs
        sc = quest_scores(qsel[None], kmin[None, :nb], kmax[None, :nb])
        wanted, _ = select_blocks(sc, torch.tensor([nb]), torch.tensor([nc]), 6, 1, 2)
        for h in range(H):
            blocks = sorted(int(b) for b in wanted[0, h] if b >= 0)
            pos = [p for b in blocks for p in range(b * bs, min(t + 1, (b + 1) * bs))]
            assert len(pos) <= 48
            ref = scaled_dot_product_attention(q[0, h * G:(h + 1) * G, t][:, None], k[0, h, pos][None].expand(G, -1, -1),
                                               v[0, h, pos][None].expand(G, -1, -1))
            assert torch.allclose(out[0, t, h * G:(h + 1) * G], ref[:, 0], atol=1e-5)
    s, n = cfg.agreement[3]
    assert n > 0 and 0 <= s / n <= 1


def _resident_by_hand(wanted_steps, forced_steps, K, cap):
    """Independent reference of capped eviction for one KV head: ``K`` slots, each step's missing
    predicted blocks admitted in priority order, free slots first (slot order), then the
    resident blocks not predicted, least recently predicted first (ties: slot order); at most
    ``cap`` admissions beyond the free slots, forced blocks always. Returns each step's set."""
    slots, used, sets = [None] * K, [0] * K, []
    for step, (want, forced) in enumerate(zip(wanted_steps, forced_steps)):
        want = [int(b) for b in want if b >= 0]
        forced_set = {int(b) for b, f in zip(wanted_steps[step], forced) if f and b >= 0}
        missing = [b for b in want if b not in slots]
        free = [i for i in range(K) if slots[i] is None]
        evictable = sorted((i for i in range(K) if slots[i] is not None and slots[i] not in want),
                           key=lambda i: (used[i], i))
        limit = max(len(free) + cap, sum(b in forced_set for b in missing))
        admit = missing[:limit]
        for i in range(K):                                 # kept blocks are used this step
            if slots[i] in want:
                used[i] = step
        for b, i in zip(admit, free + evictable):
            slots[i], used[i] = b, step
        sets.append({b for b in slots if b is not None})
    return sets


@pytest.mark.parametrize("cap", [1, 3])
def test_capped_working_set_follows_lru_capped_eviction(seed, cap):
    H, G, T, D, P, bs, budget = 2, 2, 170, 32, 90, 8, 48
    K = budget // bs
    q, k, v = 0.1 * torch.randn(1, H * G, T, D), 0.1 * torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    # Steer the top-K so that the cap binds by construction, whatever the seed: the keys of block
    # b lean on axis b, and the query at step t on 3 blocks outside the forced ones (sink, 2 recent)
    # that steps t-1 and t-2 did not pick, so every step misses 3 predicted blocks (cap 1 binds at
    # every step, cap 3 wherever a new recent block is forced as well).
    for b in range(-(-T // bs)):
        k[0, :, b * bs:(b + 1) * bs, b] += 3.0
    for t in range(P, T):
        m = (t + 1) // bs - 3                              # blocks 1 .. m: neither sink nor recent
        for i in range(3):
            q[0, :, t, 1 + (3 * t + i) % m] += 2.0
    cfg = sparse_sim.SimConfig(prefix_len=P, budget_tokens=budget, block_size=bs, dense_layers=(), chunk=16,
                               fetch_cap=cap)
    with sparse_sim.simulate(cfg):
        out, _ = sparse_sim.oasis_sim_attention(types.SimpleNamespace(layer_idx=2), q, k, v, None)
    kmin, kmax = sparse_sim.block_summaries(k[0], bs)
    wanted, forced = [], []
    for t in range(P, T):
        nb, nc = -(-(t + 1) // bs), (t + 1) // bs
        sc = quest_scores(q[0, :, t][None], kmin[None, :nb], kmax[None, :nb])
        w, f = select_blocks(sc, torch.tensor([nb]), torch.tensor([nc]), K, 1, 2)
        wanted.append(w[0])
        forced.append(f[0])
    capped_somewhere = False
    for h in range(H):
        sets = _resident_by_hand([w[h] for w in wanted], [f[h] for f in forced], K, cap)
        for i, t in enumerate(range(P, T)):
            blocks = sorted(sets[i])
            capped_somewhere |= set(blocks) != {int(b) for b in wanted[i][h] if b >= 0}
            pos = [p for b in blocks for p in range(b * bs, min(t + 1, (b + 1) * bs))]
            ref = scaled_dot_product_attention(q[0, h * G:(h + 1) * G, t][:, None], k[0, h, pos][None].expand(G, -1, -1),
                                               v[0, h, pos][None].expand(G, -1, -1))
            assert torch.allclose(out[0, t, h * G:(h + 1) * G], ref[:, 0], atol=1e-5), (h, t)
    assert capped_somewhere, "the steered queries must hit the cap (else the test shows nothing)"
    missing, admitted, n = cfg.admissions[2]
    assert n == (T - P - 1) * H and admitted <= missing
    assert admitted <= n * cap + (T - P) // bs * H, "admissions beyond the cap are forced (new recent blocks)"


def test_unbounded_carried_working_set_is_the_predicted_top_k(seed):
    H, G, T, D, P, bs, budget = 2, 3, 150, 16, 100, 8, 48
    q, k, v = torch.randn(1, H * G, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    outs = {}
    for cap in (None, budget // bs):
        cfg = sparse_sim.SimConfig(prefix_len=P, budget_tokens=budget, block_size=bs, dense_layers=(),
                                   predictor="previous", chunk=16, fetch_cap=cap)
        with sparse_sim.simulate(cfg):
            outs[cap] = sparse_sim.oasis_sim_attention(types.SimpleNamespace(layer_idx=3), q, k, v, None)[0]
    assert torch.equal(outs[None], outs[budget // bs])
    missing, admitted, _ = cfg.admissions[3]
    assert admitted == missing > 0
    # a second forward under the same config starts from an empty working set
    cfg = sparse_sim.SimConfig(prefix_len=P, budget_tokens=budget, block_size=bs, dense_layers=(), chunk=16, fetch_cap=1)
    with sparse_sim.simulate(cfg):
        first = sparse_sim.oasis_sim_attention(types.SimpleNamespace(layer_idx=3), q, k, v, None)[0]
        second = sparse_sim.oasis_sim_attention(types.SimpleNamespace(layer_idx=3), q, k, v, None)[0]
    assert torch.equal(first, second)


@pytest.mark.parametrize("kw", [{"fetch_cap": 0}, {"fetch_cap": True}, {"fetch_cap": 2.0},
                                {"fetch_cap": 2, "budget_tokens": None}, {"fetch_cap": 2, "record": True}])
def test_fetch_cap_config_errors_name_the_field(kw):
    with pytest.raises(ValueError, match="fetch_cap"):
        sparse_sim.SimConfig(prefix_len=8, **{"budget_tokens": 64, **kw})


def test_smollm2_dense_when_budget_covers_context_and_not_below(seed):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oasis_sglang.models import essay_texts, prepare_smollm2

    folder = prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                 attn_implementation=sparse_sim.register()).eval()
    ids = torch.tensor(tok.encode(essay_texts()[0][1], add_special_tokens=False)[:240])[None]
    logits = {}
    with torch.inference_mode():
        for budget in (None, 256, 64):
            with sparse_sim.simulate(sparse_sim.SimConfig(prefix_len=160, budget_tokens=budget)) as cfg:
                logits[budget] = model(ids).logits[0, 160:]
    assert torch.allclose(logits[256], logits[None], atol=2e-3, rtol=1e-3)
    assert not torch.allclose(logits[64], logits[None], atol=1e-2)
    assert sorted(cfg.agreement) == list(range(2, model.config.num_hidden_layers))


# ---- look-ahead agreement (pass 1 records, pass 2 = batched draft rows) ----------------------

def _tiny_llama(attn: str, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      initializer_range=0.2, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


class _Reference:
    """Slow per-row reference of the paired forward of ONE step ``t``: the sequence is the true
    prefix ``ids[:t+1]`` plus the draft token at position ``t+1``; every row's mask is built on its
    own (true rows: causal, or their own selection at sparse decode rows; the draft row: the
    blocks of row ``t``'s selection, tokens <= t, row t, itself)."""

    def __init__(self, cfg: sparse_sim.SimConfig):
        self.cfg = cfg
        self.q_draft, self.pred, self.sel_t = {}, {}, {}

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        c, layer = self.cfg, module.layer_idx
        q, k, v = query[0].float(), key[0].float(), value[0].float()        # [Hq, L, D], [H, L, D]
        Hq, L, D = q.shape
        H, G, bs, K = k.shape[0], Hq // k.shape[0], c.block_size, c.budget_tokens // c.block_size
        sparse = layer not in c.dense_layers
        tok = torch.arange(L)
        allow = torch.zeros(H, L, L, dtype=torch.bool)
        sel = {}
        for r in range(L):
            if r == L - 1 and sparse:                                          # the draft row
                for h in range(H):
                    allow[h, r] = torch.isin(tok // bs, sel[r - 1][h][sel[r - 1][h] >= 0]) & (tok <= r - 1)
                allow[:, r, r - 1] = allow[:, r, r] = True
            elif r < c.prefix_len or not sparse:
                allow[:, r] = tok <= r
            else:
                kmin, kmax = sparse_sim.block_summaries(k[:, :r + 1], bs)
                sc = quest_scores(q[:, r][None], kmin[None], kmax[None])
                w, _ = select_blocks(sc, torch.tensor([-(-(r + 1) // bs)]), torch.tensor([(r + 1) // bs]),
                                     K, c.sink_blocks, c.recent_blocks)
                sel[r], sel_scores = w[0], sc[0]
                for h in range(H):
                    allow[h, r] = torch.isin(tok // bs, w[0, h][w[0, h] >= 0]) & (tok <= r)
        sc = torch.einsum("hgld,hmd->hglm", q.view(H, G, L, D), k) * (scaling or D ** -0.5)
        p = torch.softmax(sc.masked_fill(~allow[:, None], float("-inf")), -1)
        out = torch.einsum("hglm,hmd->hgld", p, v).reshape(Hq, L, -1)
        if sparse:
            self.sel_t[layer] = (sel_scores, sel[L - 2])                           # row t = the last true row
            self.q_draft[layer] = q[:, L - 1]
            kmin, kmax = sparse_sim.block_summaries(k, bs)
            self.pred[layer] = (quest_scores(q[:, L - 1][None], kmin[None], kmax[None])[0],
                                select_blocks(quest_scores(q[:, L - 1][None], kmin[None], kmax[None]),
                                              torch.tensor([-(-L // bs)]), torch.tensor([L // bs]), K,
                                              c.sink_blocks, c.recent_blocks))
        return out.to(query.dtype).unsqueeze(0).transpose(1, 2).contiguous(), None


def _same_topk(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, tol: float = 1e-4) -> bool:
    """Equal block sets per KV head, or differing only in blocks tied (within ``tol``) at the boundary."""
    for h in range(want.shape[0]):
        g, w = set(got[h].tolist()) - {-1}, set(want[h].tolist()) - {-1}
        if g != w:
            diff = [b for b in g ^ w]
            kth = min(float(scores[h, b]) for b in w)
            if any(abs(float(scores[h, b]) - kth) > tol * max(1.0, abs(kth)) for b in diff):
                return False
    return True


def test_batched_draft_rows_equal_the_step_by_step_paired_forward(seed):
    from transformers import AttentionInterface

    model = _tiny_llama(sparse_sim.register())
    T, P, bs = 300, 200, 8
    ids = torch.randint(0, 96, (T,))
    drafts = torch.randint(0, 96, (T - P - 1,))
    res, p1, runs = sparse_sim.lookahead_agreement(
        model, ids, P, {"random": drafts, "oracle": ids[P + 1:]}, budget_tokens=48, block_size=bs, dense_layers=(0,))
    p2, oracle = runs["random"], runs["oracle"]
    sparse_layers = [1, 2, 3]
    assert sorted(p2.predicted) == sparse_layers and sorted(res["previous"]) == sparse_layers
    ref = _Reference(p1)
    AttentionInterface.register("oasis_sim_ref", ref)
    model.set_attn_implementation("oasis_sim_ref")
    for t in (P, P + 37, P + 90, T - 2):
        i = t - P
        with torch.inference_mode():
            model(torch.cat([ids[:t + 1], drafts[i:i + 1]])[None], use_cache=False)
        for layer in sparse_layers:
            assert _same_topk(p1.selected[layer][0][i], ref.sel_t[layer][1], ref.sel_t[layer][0])  # pass 1's S_t
            assert torch.allclose(p2.draft_queries[layer][i], ref.q_draft[layer], atol=1e-4, rtol=1e-4), (t, layer)
            scores, (want, _) = ref.pred[layer]
            assert _same_topk(p2.predicted[layer][0][i], want[0], scores), (t, layer)
            # previous: step t's normal query, selecting for step t + 1
            kmin, kmax = sparse_sim.block_summaries(p1.kv[layer][0].float(), bs)
            sc = quest_scores(p1.queries[layer][i][None], kmin[None], kmax[None])
            want, _ = select_blocks(sc[..., :-(-(t + 2) // bs)], torch.tensor([-(-(t + 2) // bs)]),
                                    torch.tensor([(t + 2) // bs]), 6, 1, 2)
            assert _same_topk(sparse_sim.previous_prediction(p1, layer, T - P - 1)[0][i], want[0], sc[0]), (t, layer)
    # the oracle draft's query at the first sparse layer is the true token's (dense layers below)
    assert torch.allclose(oracle.draft_queries[1], p1.queries[1][1:], atol=1e-5)
    assert res["lookahead-oracle"][1][0] / res["lookahead-oracle"][1][1] > 0.999
    for pred in res.values():
        for s, n in pred.values():
            assert n == (T - P - 1) * 2 and 0 <= s / n <= 1


def test_oracle_lookahead_agreement_is_one_when_the_budget_covers_the_context(seed):
    model = _tiny_llama(sparse_sim.register(), layers=3)
    T, P = 260, 180
    ids = torch.randint(0, 96, (T,))
    res, p1, runs = sparse_sim.lookahead_agreement(model, ids, P, {"oracle": ids[P + 1:]}, budget_tokens=512,
                                                   block_size=8, dense_layers=(0,))
    for layer, (s, n) in res["lookahead-oracle"].items():
        assert n > 0 and s / n == 1.0
    for layer, q in runs["oracle"].draft_queries.items():      # everything selected: the draft row = the true row
        assert torch.allclose(q, p1.queries[layer][1:], atol=1e-5)


def test_ngram_drafter_continues_a_periodic_sequence():
    ids = [5, 6, 7, 8, 9] * 12
    d = sparse_sim.ngram_drafts(ids, 0, len(ids) - 1)
    assert d[:5] == [5, 6, 7, 8, 9]                               # no earlier match yet: repeat the last token
    assert d[5:] == ids[6:]                                       # from the 2nd period on, always the continuation
    # the longest suffix wins over a more recent shorter match; the most recent match of that length
    ids = [1, 2, 3, 9, 7, 3, 4, 2, 3, 5, 1, 2, 3]
    assert sparse_sim.ngram_drafts(ids, len(ids) - 1, len(ids)) == [9]
    assert sparse_sim.ngram_drafts([3, 1, 5, 3, 2, 6, 0, 3], 7, 8) == [2]    # (3,) seen at 0 and 3: the later


@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_kv_cache_attends_over_rounded_keys_and_values_in_every_layer(seed, kv):
    """``kv_dtype``: dense layers and the prefill attend over fp8-rounded K/V (SGLang's fp8 pool),
    and a sparse run whose budget covers the context equals that dense run."""
    from oasis_sglang.core.kv_dtype import as_stored

    H, G, T, D, P = 2, 2, 40, 16, 30
    q, k, v = torch.randn(1, H * G, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    want = scaled_dot_product_attention(q, as_stored(k, kv), as_stored(v, kv), is_causal=True, enable_gqa=True)
    plain = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for budget, layer in ((None, 3), (64, 0), (64, 3)):          # dense run, a dense layer, a covering budget
        cfg = sparse_sim.SimConfig(prefix_len=P, budget_tokens=budget, block_size=8, kv_dtype=kv)
        with sparse_sim.simulate(cfg):
            out, _ = sparse_sim.oasis_sim_attention(types.SimpleNamespace(layer_idx=layer), q, k, v, None)
        assert torch.allclose(out, want.transpose(1, 2), atol=1e-5), (budget, layer)
        assert not torch.allclose(out, plain.transpose(1, 2), atol=1e-3), "fp8 rounding changes the output"
