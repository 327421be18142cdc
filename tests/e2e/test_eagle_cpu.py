"""EAGLE-3 speculative decoding on SGLang's CPU engine (dense, no --kv-sparse).

(a) the op-level tests are in tests/cpu/test_sgl_kernel_ops.py;
(b) end to end: SmolLM2 greedy output with EAGLE-3 (random-weight draft, intel_amx backend with
    the torch ops, num-steps 1, topk 1, 2 draft tokens) is token-for-token the output of plain
    dense SGLang (torch_native), for prompts sent together (batched verify);
(c) the intel_amx seq_lens fix matters: the verify attention of ``IntelAMXAttnBackend`` equals
    attention over prefix + draft tokens with the fix, and does not with it disabled
    (``OASIS_DISABLE_SPEC_FIX=1``), so these tests fail without the hook; same for the
    multi-step draft decode lengths. The unit tests start no server.
"""

import concurrent.futures as cf
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch

from oasis_sglang.sglang_glue.fixes import spec_cpu as spec_fix

OUT = Path(os.environ.get("OASIS_TEST_OUT", Path(__file__).resolve().parents[2] / "out" / "tests"))
EAGLE_ARGS = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "1",
              "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
N_NEW = 32


# ---------------------------------------------------------------------------------------------
# (c) unit level: IntelAMXAttnBackend's verify / draft-decode lengths, with and without the hook
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def amx_backend_cls():
    """``IntelAMXAttnBackend`` with the plugin's hooks applied (as in every SGLang process)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    import oasis_sglang.cpu.sgl_kernel_ops  # noqa: F401 - registers torch.ops.sgl_kernel.*_attention_cpu without CUDA
    from oasis_sglang.sglang_glue import hooks

    load_plugins()
    hooks.register()
    HookRegistry.apply_hooks()
    assert set(spec_fix.SEQ_LENS_TARGETS) <= HookRegistry._patched
    if not hasattr(torch.ops.sgl_kernel, "extend_attention_cpu"):
        pytest.skip("no sgl_kernel CPU attention ops on this host")
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend

    return IntelAMXAttnBackend


class _Pool:
    def __init__(self, kb, vb):
        self.kb, self.vb = kb, vb

    def set_kv_buffer(self, layer, loc, k, v, *args, **kwargs):
        self.kb[loc.loc] = k.view(-1, *self.kb.shape[1:])
        self.vb[loc.loc] = v.view(-1, *self.vb.shape[1:])

    def get_key_buffer(self, layer_id):
        return self.kb

    def get_value_buffer(self, layer_id):
        return self.vb


def _backend(cls, pool, req_to_token, num_draft_tokens):
    """A real ``IntelAMXAttnBackend`` without a model runner (the fields ``__init__`` sets)."""
    b = cls.__new__(cls)
    b.forward_metadata = b.extend_metadata = b.draft_decode_metadata = None
    b.device, b.token_to_kv_pool = "cpu", pool
    b.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    b.use_sliding_window_kv_pool, b.swa_out_cache_loc = False, None
    b.num_head, b.v_head_dim, b.num_kv_splits, b.num_draft_tokens = 6, 32, 8, num_draft_tokens
    b.decode_attention_fwd = torch.ops.sgl_kernel.decode_attention_cpu
    b.extend_attention_fwd = torch.ops.sgl_kernel.extend_attention_cpu
    return b


LAYER = SimpleNamespace(layer_id=0, tp_q_head_num=6, tp_k_head_num=2, tp_v_head_num=2, qk_head_dim=32, v_head_dim=32,
                        scaling=0.125, logit_cap=0.0, is_cross_attention=False, sliding_window_size=-1)


def _ref(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1),
        attn_mask=mask, scale=LAYER.scaling)
    return o.transpose(0, 1)


def _verify_case(cls):
    """A TARGET_VERIFY batch: 2 requests with 9 and 4 verified tokens, 2 draft tokens each."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    n, lens, rows = 2, [9, 4], [1, 0]
    kb, vb = torch.randn(64, 2, 32), torch.randn(64, 2, 32)
    table = (torch.randperm(63)[:3 * 20] + 1).view(3, 20).to(torch.int32)
    loc = torch.cat([table[r, L:L + n] for r, L in zip(rows, lens)]).to(torch.int64)
    fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=2, seq_lens=torch.tensor(lens),
                         req_pool_indices=torch.tensor(rows), out_cache_loc=loc, encoder_lens=None,
                         spec_info=SimpleNamespace(draft_token_num=n, tree_topk=1, custom_mask=None))
    q, k, v = torch.randn(2 * n, 6 * 32), torch.randn(2 * n, 2, 32), torch.randn(2 * n, 2, 32)
    backend = _backend(cls, _Pool(kb, vb), table, n)
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(q, k, v, LAYER, fb).view(2 * n, 6, 32)
    ref = []
    for i, (r, L) in enumerate(zip(rows, lens)):
        idx = table[r, :L + n].long()          # verified prefix + the draft tokens (written above)
        mask = torch.cat([torch.ones(n, L, dtype=torch.bool), torch.tril(torch.ones(n, n, dtype=torch.bool))], 1)
        ref.append(_ref(q[i * n:(i + 1) * n].view(n, 6, 32), kb[idx], vb[idx], mask))
    assert torch.equal(fb.seq_lens, torch.tensor(lens))      # the hook restores the batch's lengths
    return out, torch.cat(ref)


def test_verify_attention_sees_prefix_plus_drafts(amx_backend_cls, monkeypatch, seed):
    monkeypatch.delenv(spec_fix.DISABLE_ENV, raising=False)
    out, ref = _verify_case(amx_backend_cls)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_verify_attention_is_wrong_without_the_fix(amx_backend_cls, monkeypatch, seed):
    """SGLang 0.5.17 as shipped (hook disabled): the verify pass reads the wrong key lengths."""
    monkeypatch.setenv(spec_fix.DISABLE_ENV, "1")
    out, ref = _verify_case(amx_backend_cls)
    assert (out - ref).abs().max() > 0.05


def _draft_decode_case(cls):
    """Step 0 of a multi-step draft decode (num-steps 2, topk 2): per-candidate lengths L+1."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from oasis_sglang.cpu.sgl_kernel_ops import build_draft_decode_metadata_cpu

    topk, steps, lens, rows = 2, 2, torch.tensor([7, 3]), torch.tensor([0, 2])
    kb, vb = torch.randn(64, 2, 32), torch.randn(64, 2, 32)
    table = (torch.randperm(63)[:3 * 20] + 1).view(3, 20).to(torch.int32)
    draft_table = build_draft_decode_metadata_cpu(table, rows, lens, topk, steps, 20)
    seq_exp = lens.repeat_interleave(topk) + 1
    loc = torch.stack([draft_table[i, seq_exp[i] - 1] for i in range(4)]).to(torch.int64)
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=4, seq_lens=lens, req_pool_indices=rows,
                         out_cache_loc=loc, encoder_lens=None, spec_info=None)
    backend = _backend(cls, _Pool(kb, vb), table, 3)
    backend.forward_metadata = (torch.zeros(4, 6, 8, 33), None)
    backend.draft_decode_metadata = (draft_table, seq_exp, torch.arange(4))
    q, k, v = torch.randn(4, 6 * 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    out = backend.forward_decode(q, k, v, LAYER, fb).view(4, 6, 32)
    ref = torch.cat([_ref(q[i].view(1, 6, 32), kb[draft_table[i, :seq_exp[i]].long()],
                          vb[draft_table[i, :seq_exp[i]].long()], None) for i in range(4)])
    return out, ref


def test_multistep_draft_decode_sees_candidate_lengths(amx_backend_cls, monkeypatch, seed):
    monkeypatch.delenv(spec_fix.DISABLE_ENV, raising=False)
    out, ref = _draft_decode_case(amx_backend_cls)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv(spec_fix.DISABLE_ENV, "1")   # 0.5.17 as shipped: 2 request lengths for 4 candidate rows
    with pytest.raises(ValueError, match="4 queries, 4 req_pool_indices, 2 seq_lens"):
        _draft_decode_case(amx_backend_cls)


def test_platform_fallback_keeps_intel_amx_only_for_speculative_cpu(amx_backend_cls):
    from sglang.srt.arg_groups import overrides

    fallback = overrides._attention_backend_platform_fallbacks
    assert getattr(fallback, "__wrapped__", None) is not None, "hook not applied"
    view = lambda **kw: SimpleNamespace(**{"device": "cpu", "attention_backend": "intel_amx",  # noqa: E731
                                           "speculative_algorithm": "EAGLE3", **kw})
    from sglang.srt.utils import cpu_has_amx_support

    if cpu_has_amx_support() or not spec_fix.oasis_torch_attention_ops():
        pytest.skip("a CPU with AMX and the real sgl_kernel: SGLang keeps intel_amx itself")
    assert fallback(view()) == {}
    assert fallback(view(speculative_algorithm=None)) == {"attention_backend": "torch_native"}   # SGLang's own


# ---------------------------------------------------------------------------------------------
# (b) end to end: EAGLE-3 output == dense output
# ---------------------------------------------------------------------------------------------

def _prompts(tok):
    from oasis_sglang import needle
    from oasis_sglang.models import essay_texts

    essay = tok.encode(essay_texts()[1][1], add_special_tokens=False)
    return [needle.chat_ids(tok, [{"role": "user", "content": "Name three primary colors."}]),
            tok.encode("def fibonacci(n):"), essay[:300]]


def _generate(url, ids):
    r = requests.post(url + "/generate", json={
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}, timeout=900)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return [t[1] for t in meta["output_token_logprobs"]], meta


@pytest.fixture(scope="module")
def servers():
    """Dense SGLang (torch_native) and SGLang + EAGLE-3 (intel_amx + the torch ops), started together."""
    from oasis_sglang.models import prepare_smollm2, prepare_smollm2_eagle3
    from oasis_sglang.testing.launch import base_args, launch, has_cuda

    if has_cuda():
        pytest.skip("CPU-engine test")
    model, draft = str(prepare_smollm2()), str(prepare_smollm2_eagle3())
    dense_args = base_args(max_total_tokens=8192)
    eagle_args = [("intel_amx" if a == "torch_native" else a) for a in dense_args] + EAGLE_ARGS + [
        "--speculative-draft-model-path", draft]
    assert "intel_amx" in eagle_args
    with cf.ThreadPoolExecutor(2) as ex:
        futs = {name: ex.submit(launch, model, 0, args, OUT / f"{name}.log")
                for name, args in (("eagle_dense", dense_args), ("eagle3", eagle_args))}
        srv, errors = {}, []
        for name, f in futs.items():
            try:
                srv[name] = f.result()
            except Exception as e:  # noqa: BLE001 - stop the other one before failing
                errors.append(e)
    try:
        if errors:
            raise errors[0]
        yield srv
    finally:
        for s in srv.values():
            s.stop()


@pytest.mark.e2e
def test_eagle3_greedy_equals_dense(servers):
    from transformers import AutoTokenizer

    from oasis_sglang.models import prepare_smollm2

    prompts = _prompts(AutoTokenizer.from_pretrained(str(prepare_smollm2())))
    with cf.ThreadPoolExecutor(len(prompts)) as ex:   # sent together: verify runs batched
        dense = list(ex.map(lambda p: _generate(servers["eagle_dense"].url, p), prompts))
        eagle = list(ex.map(lambda p: _generate(servers["eagle3"].url, p), prompts))
    for p, (d, _), (e, meta) in zip(prompts, dense, eagle):
        assert len(e) == N_NEW
        assert e == d, f"prompt of {len(p)} tokens: EAGLE-3 {e} != dense {d}"
        assert meta.get("spec_verify_ct", 0) > 0, meta          # the speculative path ran
    log = servers["eagle3"].log()
    assert "keeps the intel_amx attention backend" in log and "seq_lens fix on" in log


# ---------------------------------------------------------------------------------------------


def _eagle_server(name, draft, spec_args, env=None):
    from oasis_sglang.models import prepare_smollm2
    from oasis_sglang.testing.launch import base_args, launch

    args = [("intel_amx" if a == "torch_native" else a) for a in base_args(max_total_tokens=8192)]
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return launch(str(prepare_smollm2()), 0, args + spec_args + ["--speculative-draft-model-path", draft],
                      OUT / f"{name}.log")
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _both(servers, other, prompts):
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        dense = [d for d, _ in ex.map(lambda p: _generate(servers["eagle_dense"].url, p), prompts)]
        got = list(ex.map(lambda p: _generate(other.url, p), prompts))
    return dense, got


@pytest.mark.e2e
def test_eagle3_tree_with_accepted_drafts_equals_dense(servers):
    """topk 2, 3 steps, 4 draft tokens (tree mask, multi-step draft decode) with the echo draft,
    which is accepted on repetitive output: SGLang's acceptance path (KV moves of accepted
    drafts, bonus tokens past a draft) still gives dense's tokens."""
    from transformers import AutoTokenizer

    from oasis_sglang.models import prepare_smollm2, prepare_smollm2_eagle3

    tok = AutoTokenizer.from_pretrained(str(prepare_smollm2()))
    prompts = _prompts(tok) + [tok.encode("----------------")]
    srv = _eagle_server("eagle3_tree_echo", str(prepare_smollm2_eagle3(echo=True)),
                        ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                         "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"])
    try:
        dense, got = _both(servers, srv, prompts)
    finally:
        srv.stop()
    for p, d, (e, meta) in zip(prompts, dense, got):
        assert e == d, f"prompt of {len(p)} tokens: EAGLE-3 {e} != dense {d}"
    assert got[-1][1]["spec_accepted_drafts"] >= N_NEW // 2, got[-1][1]    # "0000..." is mostly accepted


@pytest.mark.e2e
def test_eagle3_without_the_fix_differs(servers):
    """The served setting with the intel_amx seq_lens hooks disabled: SGLang 0.5.17's bug gives
    other tokens than dense (from the first verified step on)."""
    from transformers import AutoTokenizer

    from oasis_sglang.models import prepare_smollm2, prepare_smollm2_eagle3

    prompts = _prompts(AutoTokenizer.from_pretrained(str(prepare_smollm2())))
    srv = _eagle_server("eagle3_nofix", str(prepare_smollm2_eagle3()), EAGLE_ARGS, env={spec_fix.DISABLE_ENV: "1"})
    try:
        dense, got = _both(servers, srv, prompts)
        assert "seq_lens fix DISABLED" in srv.log()
    finally:
        srv.stop()
    for d, (e, _) in zip(dense, got):
        assert e[0] == d[0] and e != d      # the first token comes from prefill, the rest from verify
