"""sglang_glue/graph_hooks.py: the dense path for short contexts as a second decode CUDA graph
per batch size, on the CPU where graphs cannot run: the bookkeeping, not the capture.

SGLang's ``DecodeCudaGraphRunner`` is too heavy to build here; the hooks read its
``model_runner`` only, and the stand-in ``capture_one_shape`` below does what SGLang's does
around the model (``init_forward_metadata_out_graph(in_capture=True)``, then
``init_forward_metadata_in_graph`` and the layers, which a graph records). Real
``OasisAttnBackend`` over SGLang's ``TorchNativeAttnBackend``, ``ReqToTokenPool`` and
``ForwardBatch``; the real engine."""

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from oasis_sglang.config import OasisConfig
from oasis_sglang.core import OasisSparseKV, StepMode
from oasis_sglang.kernels import get_kv_ops
from oasis_sglang.sglang_glue.graph_hooks import capture_one_shape_hook, dense_label, resolve_variant_hook

from test_attn_backend_paired import HostReads, backend_over  # noqa: E402 (this folder is on sys.path: pytest rootdir-less import)

BS, H, HQ, D, LAYERS, WIDTH = 4, 2, 6, 16, 3, 128
ROWS = [1, 2]


def _backend(dense=True, predictor="previous", lens=(21, 30)):
    """An OasisAttnBackend over a CPU engine (64-token working sets; the Triton kernels, which read
    no value on the host, interpreted on the CPU), rows 1 and 2 prefilled with
    ``lens`` tokens (the prefill predicts each row's first decode step)."""
    torch.manual_seed(0)
    rtp = ReqToTokenPool(size=4, max_context_len=WIDTH, device="cpu", enable_memory_saver=False)
    cfg = OasisConfig(budget_tokens=64, block_size=BS, dense_layers=(0,), predictor=predictor,
                      dense_short_contexts=dense, kernels="triton")
    eng = OasisSparseKV(cfg, LAYERS, 4 * WIDTH + BS, rtp.req_to_token.shape[0], H, D, D, torch.float32, "cpu",
                        ops=get_kv_ops("triton"), predictor=predictor, padding_row=0)
    be, rt, mr = backend_over(eng, rtp, ROWS, lens, WIDTH)
    return be, eng, rtp, rt, mr


def _decode_batch(rtp, rows, lens):
    """SGLang's DECODE batch: ``seq_lens`` include the token being decoded."""
    B = len(rows)
    loc = torch.stack([rtp.req_to_token[r, n - 1] for r, n in zip(rows, lens)]).long()
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=torch.zeros(B, dtype=torch.long),
                        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens), out_cache_loc=loc,
                        seq_lens_sum=sum(lens), seq_lens_cpu=torch.tensor(lens))


class Runner:
    """Stand-in for SGLang's ``DecodeCudaGraphRunner``: what the hooks read (``model_runner``),
    and a ``capture_one_shape`` that prepares and runs the step as SGLang's capture does (on a
    batch of padding rows: row 0, context 1), recording each variant it captured."""

    def __init__(self, be, mr, fail_on=None):
        self.be, self.model_runner, self.captured, self.fail_on = be, mr, [], fail_on

    def capture_one_shape(self, size, forward, stream_idx=None, variant_label=None):
        if self.fail_on is not None and variant_label == self.fail_on:
            raise RuntimeError("capture failed")
        rtp = self.model_runner.req_to_token_pool
        fb = _decode_batch(rtp, [0] * size, [1] * size)
        be, eng = self.be, self.be.engine
        with HostReads() as watch:
            be.init_forward_metadata_out_graph(fb, in_capture=True)
            be.init_forward_metadata_in_graph(fb)
            for l in eng.sparse_layers:
                layer = RadixAttention(num_heads=HQ, head_dim=D, scaling=D ** -0.5, num_kv_heads=H, layer_id=l)
                be.forward_decode(torch.randn(size, HQ * D), torch.randn(size, H * D), torch.randn(size, H * D),
                                  layer, fb)
        self.captured.append((variant_label, eng.step.mode, eng.step.dense, watch.reads))
        return f"graph {variant_label}"


def _capture(runner, size=3, label=None):
    return capture_one_shape_hook(Runner.capture_one_shape, runner, size, None, None, label)


def test_each_batch_size_is_captured_again_as_the_dense_path():
    be, eng, _, rt, mr = _backend()
    runner = Runner(be, mr)
    assert _capture(runner) == "graph None", "SGLang's own capture's result"
    assert _capture(runner, label="nolora") == "graph nolora"
    assert [(lab, m, d) for lab, m, d, _ in runner.captured] == [
        (None, StepMode.CAPTURE, False), ("oasis_dense", StepMode.CAPTURE, True),
        ("nolora", StepMode.CAPTURE, False), ("nolora+oasis_dense", StepMode.CAPTURE, True)]
    assert all(reads == [] for *_, reads in runner.captured), "a captured step read tensor values on the host"
    assert not rt.capture_dense and eng.stats.decode_steps == 0 and eng.stats.dense_steps == 0
    assert dense_label(None) == "oasis_dense" and dense_label("lora") == "lora+oasis_dense"


@pytest.mark.parametrize("case", ["dense off", "draft", "no oasis"])
def test_no_dense_variant_without_the_dense_path_or_for_the_draft_model(case):
    be, eng, rtp, rt, mr = _backend(dense=case != "dense off")
    if case == "draft":
        mr.is_draft_worker = True
    if case == "no oasis":
        del rtp._oasis
    runner = Runner(be, mr)
    _capture(runner)
    assert [lab for lab, *_ in runner.captured] == [None], "SGLang's capture only"
    assert resolve_variant_hook("lora", runner, None) == "lora"


def test_a_failed_dense_capture_propagates_and_resets_the_flag():
    be, _, _, rt, mr = _backend()
    runner = Runner(be, mr, fail_on="oasis_dense")
    with pytest.raises(RuntimeError, match="capture failed"):
        _capture(runner)
    assert not rt.capture_dense, "later captures are SGLang's own again"


def test_a_replay_picks_the_dense_graph_while_every_context_fits():
    """Replays after both captures: the bookkeeping of a batch whose next contexts fit the 64-token
    working sets (and were predicted) sets ``replay_dense``, and SGLang's variant resolves to the
    dense graph's label; a batch with a row past the budget resolves to SGLang's own label."""
    be, eng, rtp, rt, mr = _backend(lens=(21, 30))
    runner = Runner(be, mr)
    _capture(runner)
    fb = _decode_batch(rtp, ROWS, [22, 31])
    be.init_forward_metadata_out_graph(fb)                   # the replay's bookkeeping
    assert rt.replay_dense and eng.stats.dense_steps == 1 and eng.stats.graph_steps == 1
    assert resolve_variant_hook(None, runner, fb) == "oasis_dense"
    assert resolve_variant_hook("nolora", runner, fb) == "nolora+oasis_dense"

    be2, eng2, rtp2, rt2, mr2 = _backend(lens=(21, 63))        # row 2's next context (64 + 1) does not fit
    runner2 = Runner(be2, mr2)
    _capture(runner2)
    be2.init_forward_metadata_out_graph(_decode_batch(rtp2, ROWS, [22, 64]))
    assert not rt2.replay_dense and eng2.stats.dense_steps == 0 and eng2.stats.graph_steps == 1
    assert resolve_variant_hook(None, runner2, None) is None
