"""sglang_glue/attn_backend.py: the paired TARGET_VERIFY step (a draft beside the normal token) in
SGLang's CUDA-graph modes, on the CPU where graphs cannot run: the bookkeeping, not the capture.

A captured step runs the same layer code as an eager one, prepared through SGLang's graph hooks
(``init_forward_metadata_out_graph(in_capture=True)`` then ``init_forward_metadata_in_graph``):
here that code must read no value from a tensor (a graph cannot) and compute what the eager step
computes; a replay's host bookkeeping must advance the prediction record by the decode row's
context (``seq_lens + 1``). Real SGLang ForwardBatch / ReqToTokenPool / TorchNativeAttnBackend,
the real engine with the Triton kernels (interpreted on the CPU)."""

import traceback
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from torch.utils._python_dispatch import TorchDispatchMode

from oasis_sglang.config import OasisConfig
from oasis_sglang.core import OasisSparseKV, StepMode
from oasis_sglang.kernels import get_kv_ops
from oasis_sglang.sglang_glue.attn_backend import OasisAttnBackend
from oasis_sglang.sglang_glue.log_line import DecodeLog
from oasis_sglang.sglang_glue.runtime import OasisRuntime
from oasis_sglang.sglang_glue.scheduler_hooks import can_run_graph_hook

BS, H, HQ, D, LAYERS, WIDTH = 4, 2, 6, 16, 3, 64
ROWS = [1, 2]


class HostReads(TorchDispatchMode):
    """Records every read of a tensor's value by the host (``.item()``, ``.tolist()``, ``int()``,
    ``bool()``: ATen's ``_local_scalar_dense``), with where it happened."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append("".join(traceback.format_stack(limit=6)[:-1]))
        return func(*args, **(kwargs or {}))


def backend_over(eng, rtp, rows, lens, width):
    """An OasisAttnBackend over ``eng`` (wrapping SGLang's TorchNativeAttnBackend; its
    ``OasisRuntime`` attached to ``rtp``), with request ``rows[i]`` prefilled with ``lens[i]``
    random tokens through every sparse layer (its own pages, page 0 left free). Returns the
    backend, the runtime and the stand-in model runner."""
    rt = OasisRuntime(eng)
    rtp._oasis = rt
    mr = SimpleNamespace(device="cpu", req_to_token_pool=rtp, token_to_kv_pool=None, is_draft_worker=False,
                         model_config=SimpleNamespace(attention_arch=AttentionArch.MHA))
    be = OasisAttnBackend(TorchNativeAttnBackend(mr), rt, None, rtp, DecodeLog(eng, 10**6))
    for row in rows:
        rtp.req_to_token[row] = torch.arange(width, dtype=torch.int32) + width * (row - 1) + BS
    for l in eng.sparse_layers:
        for row, n in zip(rows, lens):
            k, v = torch.randn(n, H, D), torch.randn(n, H, D)
            eng.write_kv(l, rtp.req_to_token[row, :n].long(), k, v)
            eng.extend_attention(l, torch.randn(n, HQ, D), torch.tensor([row]), torch.zeros(1, dtype=torch.long),
                                 torch.tensor([n]), rtp.req_to_token, None, k, v)
    rt.batch_rows_host = list(rows)
    return be, rt, mr


def _backend(seed: int = 0):
    """An OasisAttnBackend over a CPU engine (predictor lookahead, Triton kernels), prefilled with
    the same random context for every call with the same seed: rows 1 and 2 hold 21 and 30 tokens."""
    torch.manual_seed(seed)
    rtp = ReqToTokenPool(size=4, max_context_len=WIDTH, device="cpu", enable_memory_saver=False)
    # a fixed step budget of 2 blocks per layer: its kernels run (and are watched) as on a GPU
    cfg = OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0,), predictor="lookahead", kernels="triton",
                      transfer_budget=2 * 2 * 2 * BS * D * 4)
    eng = OasisSparseKV(cfg, LAYERS, 4 * WIDTH + BS, rtp.req_to_token.shape[0], H, D, D, torch.float32, "cpu",
                        ops=get_kv_ops("triton"), predictor="lookahead", padding_row=0)
    lens = [21, 30]
    be, rt, _ = backend_over(eng, rtp, ROWS, lens, WIDTH)
    r = torch.tensor(ROWS)
    return be, eng, rtp, r, lens


def _verify_batch(rtp, lens):
    """SGLang's TARGET_VERIFY batch of the paired forward: 2 tokens per request (the token being
    decoded at position ``seq_lens``, the draft at ``seq_lens + 1``); ``seq_lens`` excludes both."""
    B = len(lens)
    loc = torch.stack([rtp.req_to_token[row, n:n + 2] for row, n in zip(ROWS, lens)]).reshape(-1).long()
    return ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=B,
                        input_ids=torch.zeros(2 * B, dtype=torch.long), req_pool_indices=torch.tensor(ROWS),
                        seq_lens=torch.tensor(lens), out_cache_loc=loc, seq_lens_sum=sum(lens),
                        seq_lens_cpu=torch.tensor(lens), spec_info=SimpleNamespace(draft_token_num=2))


def _layers_of(eng):
    return [RadixAttention(num_heads=HQ, head_dim=D, scaling=D ** -0.5, num_kv_heads=H, layer_id=l)
            for l in eng.sparse_layers]


def _paired_step(be, eng, fb, inputs):
    """The sparse layers of one paired forward (what the model's attention calls)."""
    return [be.forward_extend(q, k, v, layer, fb) for layer, (q, k, v) in zip(_layers_of(eng), inputs)]


def _inputs(n_layers, B, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2 * B, HQ * D, generator=g), torch.randn(2 * B, H * D, generator=g),
             torch.randn(2 * B, H * D, generator=g)) for _ in range(n_layers)]


def test_a_captured_paired_step_reads_no_value_and_computes_the_eager_step():
    eager_be, eager, rtp_e, _, lens = _backend()
    graph_be, graph, rtp_g, _, _ = _backend()
    inputs = _inputs(len(eager.sparse_layers), len(lens))
    fb_e = _verify_batch(rtp_e, lens)
    eager_be.init_forward_metadata(fb_e)
    assert eager.step.mode is StepMode.EAGER and eager.step.seq.tolist() == [22, 31], "the decode row: seq_lens + 1"
    out_e = _paired_step(eager_be, eager, fb_e, inputs)

    fb_g = _verify_batch(rtp_g, lens)
    with HostReads() as watch:
        graph_be.init_forward_metadata_out_graph(fb_g, in_capture=True)       # before the capture
        graph_be.init_forward_metadata_in_graph(fb_g)                         # recorded in the graph
        out_g = _paired_step(graph_be, graph, fb_g, inputs)
    assert watch.reads == [], "a captured paired step read tensor values on the host:\n" + "\n".join(watch.reads)
    st = graph.step
    assert st.mode is StepMode.CAPTURE and st.max_seq == WIDTH, "a capture spans the table's width"
    assert st.seq_lens is fb_g.seq_lens and st.seq.tolist() == [22, 31], \
        "the +1 is computed from SGLang's own length buffer inside the graph, so a replay offsets the replayed lengths"
    for o_e, o_g in zip(out_e, out_g):
        assert o_e.shape == o_g.shape == (2 * len(lens), HQ * D)
        torch.testing.assert_close(o_g, o_e, rtol=1e-6, atol=1e-6)
    assert torch.equal(graph.ws.ids, eager.ws.ids), "the same working sets (the prediction for the next step)"
    assert torch.equal(graph.ws.k[0], eager.ws.k[0]) and torch.equal(graph.ws.v[-1], eager.ws.v[-1])
    assert torch.equal(graph.record.seq, eager.record.seq) and eager.record.seq[ROWS].tolist() == [23, 32]
    assert torch.equal(graph.counters, eager.counters)
    assert int(graph.budget.blocks) == 2 and graph.budget.enabled, "the budget's kernels ran in both steps"
    assert graph.stats.decode_steps == 0 and eager.stats.decode_steps == 1, "a capture is no decode step"


def test_a_replayed_paired_step_advances_the_host_record_by_the_decode_rows_context():
    be, eng, rtp, _, lens = _backend()
    runner = SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=rtp, is_draft_worker=False))
    fb = _verify_batch(rtp, lens)
    assert can_run_graph_hook(True, runner, fb) is True, "the prefill predicted each decode row (context 22, 31)"
    be.init_forward_metadata(fb)                        # one eager step (predicts contexts 23, 32)
    _paired_step(be, eng, fb, _inputs(len(eng.sparse_layers), 2))
    nxt = _verify_batch(rtp, [n + 1 for n in lens])
    assert can_run_graph_hook(True, runner, nxt) is True
    assert can_run_graph_hook(True, runner, fb) is False, "that context was decoded already"
    # SGLang's replay view: padded to a captured batch of 4 (padding row 0, fill length 1)
    view = SimpleNamespace(batch_size=4, num_padding=2, forward_mode=ForwardMode.TARGET_VERIFY,
                           req_pool_indices=torch.tensor(ROWS + [0, 0]), seq_lens=torch.tensor([22, 31, 1, 1]),
                           seq_lens_cpu=torch.tensor([22, 31, 1, 1]))
    assert can_run_graph_hook(True, runner, nxt) is True       # SGLang's EAGLE verify: check, then load the graph
    be.init_forward_metadata_out_graph(view)                   # (DecodeCudaGraphRunner.load_batch)
    nxt.mark_forward_metadata_ready()
    assert can_run_graph_hook(True, runner, nxt) is True, \
        "asked again once loaded (ModelRunner._forward_raw): the replay stands, the record has moved on"
    assert eng.step is None, "the graph runs the layers"
    assert eng.stats.graph_steps == 1 and eng.stats.decode_steps == 2
    assert eng.last_batch == (ROWS, [23, 32]), "the decode rows' contexts, without the padding"
    assert eng.record.host == {1: 24, 2: 33}, "as the captured layers predict: one more than each decode row"
    assert can_run_graph_hook(True, runner, _verify_batch(rtp, [n + 2 for n in lens])) is True
    be.runtime.batch_rows_host = [1]
    with pytest.raises(RuntimeError, match="without the batch's 2 rows on the host"):
        be.init_forward_metadata_out_graph(view)


def test_record_lengths_steps_without_sglangs_host_lengths_advance_as_with_them():
    """``record_lengths`` (OASIS_RECORD_LENGTHS): a paired verify batch that carries no host copy
    of its lengths (SGLang's overlapped spec worker when no backend asks for one) runs as one that
    does: the eager step keeps the host record trusted and predicts the same contexts, and the
    replay's bookkeeping advances the record by the decode rows' contexts, read from the record."""
    be, eng, rtp, _, lens = _backend()
    be.runtime.record_lengths = True
    runner = SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=rtp, is_draft_worker=False))
    fb = _verify_batch(rtp, lens)
    fb.seq_lens_cpu = None
    assert can_run_graph_hook(True, runner, fb) is True, "the prefill's prediction gives each row's context"
    be.init_forward_metadata(fb)                        # eager: host lists from the record, no device read
    assert eng.step.rows_host == ROWS and eng.step.seq_host == [22, 31] and eng.record.trusted
    _paired_step(be, eng, fb, _inputs(len(eng.sparse_layers), 2))
    assert eng.record.host == {1: 23, 2: 32} and eng.record.seq[ROWS].tolist() == [23, 32]
    view = SimpleNamespace(batch_size=4, num_padding=2, forward_mode=ForwardMode.TARGET_VERIFY,
                           req_pool_indices=torch.tensor(ROWS + [0, 0]), seq_lens=torch.tensor([22, 31, 1, 1]),
                           seq_lens_cpu=None)
    be.init_forward_metadata_out_graph(view)            # the replay's bookkeeping
    assert eng.last_batch == (ROWS, [23, 32]) and eng.record.host == {1: 24, 2: 33}
    assert be.runtime.length_mismatches == 0
    eng.record.forget([2])                              # a row the record does not know: no host lengths
    with pytest.raises(RuntimeError, match="without the host lengths of its 2 rows"):
        be.init_forward_metadata_out_graph(view)


def test_a_capture_logs_nothing_and_an_eager_paired_step_logs_at_its_last_layer(caplog):
    be, eng, rtp, _, lens = _backend()
    be.log.interval = 1
    fb = _verify_batch(rtp, lens)
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    be.init_forward_metadata_in_graph(fb)
    with caplog.at_level("INFO"):
        _paired_step(be, eng, fb, _inputs(len(eng.sparse_layers), 2))
    assert "OasisKV decode" not in caplog.text, "a line inside a capture would read the device"
    be.init_forward_metadata(fb)
    with caplog.at_level("INFO"):
        _paired_step(be, eng, fb, _inputs(len(eng.sparse_layers), 2))
    assert "OasisKV decode" in caplog.text
