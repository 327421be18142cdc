"""core/prediction.py: PredictionRecord, the device record of which context each request row
was predicted for and its host mirror (real tensors on the CPU)."""

import logging

import pytest
import torch

from oasis_sglang.core.prediction import PredictionRecord


def _record(rows=6):
    return PredictionRecord(rows, "cpu")


def test_a_new_record_has_nothing_predicted_and_a_trusted_empty_mirror():
    rec = _record(4)
    assert rec.seq.dtype == torch.int64 and rec.seq.tolist() == [-1, -1, -1, -1]
    assert rec.host == {} and rec.trusted
    assert not rec.all_predicted_device(torch.tensor([1]), torch.tensor([5]))
    assert not rec.all_predicted_host([1], [5])
    assert not rec.can_replay([1], [5])


def test_mark_writes_the_device_record_and_mirror_the_host_one():
    rec = _record()
    rec.mark(torch.tensor([1, 3]), torch.tensor([21, 9]))
    assert rec.seq.tolist() == [-1, 21, -1, 9, -1, -1]
    assert rec.host == {}, "mark touches the device record only"
    rec.mirror([1, 3], [21, 9])
    assert rec.host == {1: 21, 3: 9} and rec.trusted
    rec.mark(torch.tensor([3]), torch.tensor([10]))
    rec.mirror([3], [10])                                   # a later prediction replaces the row's entry
    assert rec.seq.tolist() == [-1, 21, -1, 10, -1, -1] and rec.host == {1: 21, 3: 10}


def test_all_predicted_host_and_device_agree_on_exact_contexts():
    rec = _record()
    rec.mark(torch.tensor([1, 3]), torch.tensor([21, 9]))
    rec.mirror([1, 3], [21, 9])
    for rows, seq, want in (([1, 3], [21, 9], True), ([3, 1], [9, 21], True), ([1], [21], True),
                            ([1, 3], [21, 10], False), ([1, 3], [22, 9], False), ([1, 2], [21, 9], False),
                            ([2], [1], False)):
        assert rec.all_predicted_host(rows, seq) is want, (rows, seq)
        assert rec.all_predicted_device(torch.tensor(rows), torch.tensor(seq)) is want, (rows, seq)


def test_can_replay_needs_host_lists_of_one_length_real_rows_and_trust():
    rec = _record()
    rec.mark(torch.tensor([1, 3]), torch.tensor([21, 9]))
    rec.mirror([1, 3], [21, 9])
    assert rec.can_replay([1, 3], [21, 9])
    assert rec.can_replay(torch.tensor([1, 3]).tolist(), [21, 9])
    assert not rec.can_replay([1, 3], [21, 10]), "a row predicted for another context"
    assert not rec.can_replay([1, 4], [21, 9]), "a row never predicted"
    assert not rec.can_replay([1, None], [21, 9]), "a None row"
    assert not rec.can_replay([1, 3], [21]), "length mismatch"
    assert not rec.can_replay([1], [21, 9]), "length mismatch"
    assert not rec.can_replay(None, [21]) and not rec.can_replay([1], None) and not rec.can_replay(None, None)
    rec.distrust()
    assert not rec.trusted and rec.host is None
    assert not rec.can_replay([1, 3], [21, 9]), "an untrusted mirror never replays"
    assert rec.all_predicted_device(torch.tensor([1, 3]), torch.tensor([21, 9])), "the device record still holds"


def test_mirror_without_host_values_stops_trusting_until_confirm():
    rec = _record()
    rec.mark(torch.tensor([2]), torch.tensor([7]))
    rec.mirror([2], [7])
    rec.mark(torch.tensor([4]), torch.tensor([12]))
    rec.mirror(None, None)                                  # a prediction made without host values
    assert rec.host is None and not rec.trusted
    rec.mirror([4], [12])                                   # an untrusted mirror stays untrusted
    assert rec.host is None
    rec.mirror([4], None)
    assert rec.host is None


@pytest.mark.parametrize("rows", [[1, 3], torch.tensor([1, 3]), 1])
def test_forget_drops_rows_from_both_records(rows):
    rec = _record()
    rec.mark(torch.tensor([1, 3, 5]), torch.tensor([21, 9, 33]))
    rec.mirror([1, 3, 5], [21, 9, 33])
    rec.forget(rows)
    gone = [1, 3] if not isinstance(rows, int) else [1]
    kept = {r: s for r, s in {1: 21, 3: 9, 5: 33}.items() if r not in gone}
    assert rec.host == kept
    assert [r for r, s in enumerate(rec.seq.tolist()) if s >= 0] == sorted(kept)
    assert all(rec.seq[r] == -1 for r in gone)
    assert not rec.can_replay([1], [21])
    rec.forget([0, 2])                                      # rows never predicted: nothing changes
    assert rec.host == kept


def test_forget_on_an_untrusted_mirror_clears_the_device_record_only():
    rec = _record()
    rec.mark(torch.tensor([1, 3]), torch.tensor([21, 9]))
    rec.distrust()
    rec.forget([3])
    assert rec.host is None and rec.seq.tolist() == [-1, 21, -1, -1, -1, -1]


def test_confirm_rebuilds_an_untrusted_mirror_from_the_device(caplog):
    rec = _record()
    rec.mark(torch.tensor([1, 3]), torch.tensor([21, 9]))
    rec.mirror(None, None)
    with caplog.at_level(logging.INFO, logger="oasis_sglang.core.prediction"):
        rec.confirm()
    assert rec.host == {1: 21, 3: 9} and rec.trusted
    assert rec.can_replay([1, 3], [21, 9])
    assert "rebuilding the host record" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_confirm_rebuilds_a_corrupted_mirror_and_logs_the_rows(caplog):
    rec = _record()
    rec.mark(torch.tensor([1, 3]), torch.tensor([21, 9]))
    rec.mirror([1, 3], [21, 9])
    rec.host[3] = 14                                         # disagrees with the device
    rec.host[5] = 40                                         # a row the device never predicted
    with caplog.at_level(logging.INFO, logger="oasis_sglang.core.prediction"):
        rec.confirm()
    assert rec.host == {1: 21, 3: 9}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "3: (14, 9)" in errors[0] and "5: (40, -1)" in errors[0] and "1:" not in errors[0]


def test_confirm_of_an_agreeing_mirror_changes_nothing_and_logs_nothing(caplog):
    rec = _record()
    rec.mark(torch.tensor([0, 2]), torch.tensor([5, 6]))
    rec.mirror([0, 2], [5, 6])
    with caplog.at_level(logging.INFO, logger="oasis_sglang.core.prediction"):
        rec.confirm()
    assert rec.host == {0: 5, 2: 6} and not caplog.records


def test_lengths_host_gives_every_rows_predicted_context_or_none():
    r = _record()
    r.mirror([1, 2], [21, 30])
    assert r.lengths_host([2, 1]) == [30, 21]
    assert r.lengths_host([1, 3]) is None, "a row never predicted"
    assert r.lengths_host([]) == []
    r.distrust()
    assert r.lengths_host([1]) is None, "an untrusted mirror"
