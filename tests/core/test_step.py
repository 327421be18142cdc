"""core/step.py: StepMode and DecodeStep, and the three ways an engine begins a decode step
(``OasisSparseKV.begin_decode_step``: eager, capture, replay)."""

import pytest
import torch

from oasis_sglang.config import OasisConfig
from oasis_sglang.core import DecodeStep, OasisSparseKV, StepMode

BS, H, D = 4, 2, 16


def _engine(device="cpu", predictor="previous", rows=5):
    cfg = OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0,), predictor=predictor)
    return OasisSparseKV(cfg, 3, 256, rows, H, D, D, torch.float32, device)


def test_step_modes_parse_from_their_strings():
    assert [m.value for m in StepMode] == ["eager", "capture", "replay"]
    for m in StepMode:
        assert StepMode(m.value) is m and m == m.value and isinstance(m, str)
    for bad in ("graph", "EAGER", "", None):
        with pytest.raises(ValueError):
            StepMode(bad)


def test_decode_step_batch_size_counts_every_row():
    st = DecodeStep(StepMode.CAPTURE, torch.tensor([3, 5, 0]), torch.ones(3, dtype=torch.long),
                    torch.zeros(6, 8, dtype=torch.int32), 2, 8)
    assert st.batch_size == 3
    assert (st.rows_host, st.seq_host, st.sync, st.timed, st.seq_m1, st.seq_p1, st.clock_next) == \
        (None, None, False, False, None, None, None)


def test_capture_reads_no_value_and_spans_the_table_width():
    """On the meta device no tensor has a value: reading one (``.item()``, ``.tolist()``) raises.
    A capture step begins there all the same; an eager one cannot (it reads ``max(seq)``)."""
    eng = _engine("meta")
    rows = torch.tensor([1, 2, 0], device="meta")
    seq = torch.tensor([5, 9, 1], device="meta")
    rtt = torch.zeros(5, 61, dtype=torch.int32, device="meta")
    st = eng.begin_decode_step(rows, seq, rtt, mode="capture")
    assert eng.step is st and st.mode is StepMode.CAPTURE and st.batch_size == 3
    assert st.max_seq == 61 and st.nb_max == 16, "ceil(61 / 4): the table's width, not the batch's lengths"
    assert st.rows_host is None and st.seq_host is None
    assert st.seq_m1 is None, "the device values are prepared inside the graph (prepare_step_device)"
    assert eng.stats.decode_steps == 0, "a capture (or warm-up) is no decode step"
    st2 = eng.begin_decode_step(rows, seq, rtt, mode=StepMode.CAPTURE, max_seq_len=10)
    assert (st2.max_seq, st2.nb_max) == (10, 3)
    with pytest.raises(RuntimeError, match="meta"):
        eng.begin_decode_step(rows, seq, rtt, mode="eager")


def test_capture_on_the_cpu_leaves_counters_and_clock_until_prepared():
    eng = _engine()
    rtt = torch.zeros(5, 40, dtype=torch.int32)
    st = eng.begin_decode_step(torch.tensor([1, 0]), torch.tensor([7, 1]), rtt, mode="capture",
                               rows_host=[1, 0], seq_lens_host=[7, 1])
    assert (st.max_seq, st.nb_max) == (40, 10)
    assert st.rows_host is None and st.seq_host is None, "a capture takes no host values"
    assert eng.stats.decode_steps == 0 and int(eng.clock) == 0 and eng.last_batch is None
    eng.prepare_step_device()
    assert int(eng.clock) == 1
    assert st.seq_m1.tolist() == [6, 0] and st.seq_p1.tolist() == [8, 2] and int(st.clock_next) == 2


def test_eager_step_reads_the_batch_maximum_and_prepares_itself():
    eng = _engine()
    rtt = torch.zeros(5, 40, dtype=torch.int32)
    st = eng.begin_decode_step(torch.tensor([1, 2]), torch.tensor([7, 13]), rtt, rows_host=[1, 2],
                               seq_lens_host=[7, 13])
    assert st.mode is StepMode.EAGER and (st.max_seq, st.nb_max) == (13, 4)
    assert st.rows_host == [1, 2] and st.seq_host == [7, 13]
    assert st.sync, "nothing was predicted: the step selects synchronously"
    assert eng.stats.decode_steps == 1 and eng.stats.sync_steps == 1 and int(eng.clock) == 1
    assert st.seq_m1.tolist() == [6, 12] and st.seq_p1.tolist() == [8, 14]


def test_replay_needs_host_lists_and_leaves_no_step():
    eng = _engine()
    rtt = torch.zeros(5, 40, dtype=torch.int32)
    rows, seq = torch.tensor([1, 2]), torch.tensor([7, 13])
    eng.begin_decode_step(rows, seq, rtt, mode="capture")
    for bad in (dict(), dict(rows_host=[1, 2]), dict(seq_lens_host=[7, 13])):
        with pytest.raises(ValueError, match="replay needs rows_host and seq_lens_host"):
            eng.begin_decode_step(rows, seq, rtt, mode="replay", **bad)
    assert eng.stats.decode_steps == 0 and eng.step is not None, "a refused replay changes nothing"
    st = eng.begin_decode_step(rows, seq, rtt, mode="replay", rows_host=[1, 2], seq_lens_host=[7, 13])
    assert eng.step is None, "the graph runs the layers: no eager layer may read a step"
    assert st.mode is StepMode.REPLAY and st.rows_host == [1, 2] and st.seq_host == [7, 13]
    assert st.batch_size == 0 and st.nb_max == 0
    assert eng.stats.decode_steps == 1 and eng.stats.graph_steps == 1
    assert eng.last_batch == ([1, 2], [7, 13])
    assert eng.record.host == {1: 8, 2: 14}, "the host record advances as the captured layers predict"
    with pytest.raises(RuntimeError, match="without begin_decode_step"):
        eng.decode_attention(1, torch.zeros(2, 6, D), torch.zeros(2, H, D), torch.zeros(2, H, D), None)
    with pytest.raises(RuntimeError, match="prepare_step_device without begin_decode_step"):
        eng.prepare_step_device()


def test_a_captured_seq_offset_is_added_inside_the_graph_from_the_callers_buffer():
    """The paired verify step's decode row sees ``seq_lens + 1``. A capture must compute that from
    SGLang's own length buffer in ``prepare_step_device`` (recorded in the graph): a sum taken
    before the capture would replay the capture's lengths forever."""
    eng = _engine()
    rtt = torch.zeros(5, 40, dtype=torch.int32)
    buf = torch.tensor([7, 1])
    st = eng.begin_decode_step(torch.tensor([1, 0]), buf, rtt, mode="capture", seq_offset=1)
    assert st.seq is buf and st.seq_offset == 1, "nothing computed before the graph"
    eng.prepare_step_device()
    eng.prepare_step_device()                       # SGLang's warm-up runs repeat the recorded part
    assert st.seq.tolist() == [8, 2] and st.seq_m1.tolist() == [7, 1] and st.seq_p1.tolist() == [9, 3]
    buf.copy_(torch.tensor([12, 1]))                # a replay: new lengths in the same buffer
    eng.prepare_step_device()
    assert st.seq.tolist() == [13, 2] and st.seq_lens is buf
    st = eng.begin_decode_step(torch.tensor([1, 2]), torch.tensor([7, 13]), rtt, rows_host=[1, 2],
                               seq_lens_host=[8, 14], seq_offset=1)
    assert st.seq.tolist() == [8, 14] and st.seq_offset == 0, "eager: added at once"
    for bad in (2, -1, True, 0.5):
        with pytest.raises(ValueError, match="seq_offset"):
            eng.begin_decode_step(torch.tensor([1]), torch.tensor([7]), rtt, seq_offset=bad)
