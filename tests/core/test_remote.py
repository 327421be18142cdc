"""core/remote.py RemoteBlocks bookkeeping of reads started between steps (``post`` / ``poll``),
with a read queue standing in for NIXL (the NIXL path: tests/disagg/test_admission.py): a read of
a page's previous request never lands after the page changed hands."""

import pytest
import torch

from oasis_sglang.core.remote import RemoteBlocks


class Reads:
    """Reads that end only when told (a slow network)."""

    def __init__(self):
        self.started = []

    def post(self, peer, layer, heads, src, dst):
        r = {"peer": peer, "layer": layer, "src": src.clone(), "dst": dst.clone(), "done": False,
             "nbytes": 8 * len(heads)}
        r = type("Read", (), r)()
        self.started.append(r)
        return r

    def poll(self, r):
        return r.done


waits_on = [False]


def make():
    reads, waits = Reads(), []

    def poll(r):
        if waits_on[0] and not r.done:      # wait_reads polls until done
            waits.append(r)
            r.done = True
        return r.done
    rb = RemoteBlocks(1, 1, 8, fetch=lambda *a: 0, post=reads.post, poll=poll)
    return rb, reads, waits


@pytest.fixture(autouse=True)
def _reset():
    waits_on[0] = False
    yield
    waits_on[0] = False


def test_started_reads_mark_present_only_once_ended():
    rb, reads, _ = make()
    rb.admit(torch.tensor([3, 4]), "A", torch.tensor([100, 101]))
    rb.deferred[0, 0, 3] = 2
    assert rb.service() == 8 and len(reads.started) == 1
    assert not rb.present[0, 0, 3] and rb.inflight[0, 0, 3] and int(rb.deferred.sum()) == 0
    rb.deferred[0, 0, 3] = 1                            # wanted again while in flight: not read twice
    rb.service()
    assert len(reads.started) == 1
    reads.started[0].done = True
    rb.service()
    assert rb.present[0, 0, 3] and not rb.inflight[0, 0, 3] and not rb.present[0, 0, 4]
    assert (rb.deferred_pieces, rb.pieces_read) == (1, 1)


@pytest.mark.parametrize("how", ["admit", "release"])
def test_pages_changing_hands_wait_for_their_reads(how):
    """A read of request A's page in flight when the page is released or admitted for request B
    is waited for first, so it cannot mark B's piece present with A's bytes later, and B's own
    read is started."""
    rb, reads, waits = make()
    rb.admit(torch.tensor([3]), "A", torch.tensor([100]))
    rb.deferred[0, 0, 3] = 1
    rb.service()
    waits_on[0] = True
    if how == "release":
        rb.release(torch.tensor([3]))
    rb.admit(torch.tensor([3]), "B", torch.tensor([200]))
    assert waits == [reads.started[0]] and not rb.pending
    assert not rb.present[0, 0, 3] and not rb.inflight[0, 0, 3]          # B's piece is not here yet
    rb.deferred[0, 0, 3] = 1
    rb.service()
    assert len(reads.started) == 2 and reads.started[1].peer == "B" and int(reads.started[1].src[0]) == 200


def fail_a_read_into(rb, page):
    """Start a deferred read of piece (0, 0, ``page``), then let the transport report it failed."""
    rb.deferred[0, 0, page] = 1
    rb.service()

    def fail(r):
        raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
    rb.poll = fail
    rb.service()


def test_a_failed_read_loses_its_peer_and_frees_its_pieces():
    rb, reads, _ = make()
    rb.admit(torch.tensor([3]), "A", torch.tensor([100]))
    fail_a_read_into(rb, 3)
    assert "NIXL_ERR_REMOTE_DISCONNECT" in rb.lost["A"] and not rb.pending and not rb.inflight.any()
    assert rb.failed_pages().tolist() == [3] and not rb.present[0, 0, 3]
    rb.deferred[0, 0, 3] = 1
    rb.service()                                       # a lost peer's pieces are not read again
    assert len(reads.started) == 1


def test_written_lists_present_pieces_and_every_piece_of_a_dirty_page():
    """``written`` (what ``HostTier.discard`` may skip the rest of): present pieces, plus every
    piece of a page whose memory may hold data ``present`` does not show: a failed read's
    (its bytes may have landed), or a previous owner's until ``given_back``."""
    rb, reads, _ = make()
    rb.admit(torch.tensor([3, 5]), "A", torch.tensor([100, 101]), present=torch.tensor([[[True, False]]]))
    assert rb.written(torch.tensor([3, 5])).tolist() == [[[True, False]]]
    fail_a_read_into(rb, 5)
    assert not rb.present[0, 0, 5] and rb.written(torch.tensor([5])).tolist() == [[[True]]]
    rb.release(torch.tensor([3, 5]))                   # released without its memory given back
    rb.given_back(torch.tensor([3]))
    rb.admit(torch.tensor([3, 5]), "B", torch.tensor([7, 8]))
    assert rb.written(torch.tensor([3, 5])).tolist() == [[[False, True]]]   # 5: A's data may still be there
    rb.given_back(torch.tensor([5]))
    assert not rb.written(torch.tensor([3, 5])).any()
    for bad, what in ((torch.tensor([8]), "in 0..7"), (torch.tensor([-1]), "in 0..7"),
                      (torch.tensor([True]), "integers")):
        with pytest.raises(ValueError, match=what):
            rb.written(bad)
        with pytest.raises(ValueError, match=what):
            rb.given_back(bad)


def test_a_synchronous_read_that_fails_leaves_its_pages_dirty():
    """``ensure_local`` (pd_read_mode wait): a ``fetch`` that raises may have written part of
    its pieces, so their pages count as written for ``HostTier.discard``."""
    def fetch(*a):
        raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
    rb = RemoteBlocks(1, 2, 8, fetch=fetch)
    rb.admit(torch.tensor([2, 6]), "A", torch.tensor([10, 11]))
    rb.ensure_local(0, torch.tensor([0 * 8 + 6]))
    assert "A" in rb.lost and not rb.present[0, 0, 6]
    assert rb.written(torch.tensor([2, 6])).tolist() == [[[False, True], [False, True]]]


def test_one_read_per_peer_holds_every_layers_pieces():
    """``service`` starts one read per peer per step, whatever the layers: 3 layers' left-out
    pieces of two peers' pages make two reads, each naming its pieces' layers."""
    reads = Reads()
    rb = RemoteBlocks(3, 2, 8, fetch=lambda *a: 0, post=reads.post, poll=reads.poll)
    rb.admit(torch.tensor([1, 2]), "A", torch.tensor([10, 11]))
    rb.admit(torch.tensor([5]), "B", torch.tensor([50]))
    for li, h, pg in [(0, 0, 1), (2, 1, 2), (1, 1, 5), (2, 0, 5), (0, 1, 1)]:
        rb.deferred[li, h, pg] = 1
    rb.service()
    assert sorted(r.peer for r in reads.started) == ["A", "B"]
    got = {r.peer: sorted(zip(torch.as_tensor(r.layer).tolist(), r.dst.tolist(), r.src.tolist())) for r in reads.started}
    assert got == {"A": [(0, 1, 10), (0, 1, 10), (2, 2, 11)], "B": [(1, 5, 50), (2, 5, 50)]}
    for r in reads.started:
        r.done = True
    rb.service()
    assert rb.present[0, :, 1].all() and rb.present[2, 1, 2] and rb.present[1, 1, 5] and rb.present[2, 0, 5]
    assert not rb.present[1, 0, 1] and not rb.present[0, 0, 5] and not rb.inflight.any()


def test_post_and_poll_go_together():
    with pytest.raises(ValueError, match="post and poll"):
        RemoteBlocks(1, 1, 8, fetch=lambda *a: 0, post=lambda *a: None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the counts are read one call late on CUDA only")
def test_cuda_reads_the_counts_one_call_late_without_waiting_for_the_step():
    """On CUDA ``service`` starts the reads of the plans queued before its previous call (their
    snapshot has ended), not of the step in flight; a page changing hands drops its snapshot
    counts too."""
    from oasis_sglang.core.prediction import PredictionRecord
    from oasis_sglang.core.working_set import WorkingSet

    reads = Reads()
    rb = RemoteBlocks(2, 1, 8, fetch=lambda *a: 0, device="cuda", post=reads.post, poll=reads.poll)
    rb.admit(torch.tensor([3, 4]), "A", torch.tensor([30, 40]))
    rb.deferred[1, 0, 3] += 1
    ws = WorkingSet(2, 3, 1, 4, 8, 16, 16, torch.float16, "cuda")
    ws.ids.fill_(7)
    ws.last_used.fill_(3)
    rec = PredictionRecord(3, "cuda")
    rec.seq.copy_(torch.tensor([5, 6, 9]))
    # the first call of an index op on a new stream or size allocates device memory (cudaMalloc
    # waits); SGLang's steps run many times, so warm once as a server would be
    ws.reset_rows([2])
    rec.forget([2])
    rec.seq[2] = 9                         # a plan of step t
    rb.service()                                      # start of t + 1: snapshot taken, nothing read yet
    assert not reads.started and int(rb.deferred.sum()) == 0
    rb.deferred[0, 0, 4] += 1                         # a plan of step t + 1
    rb.service()                                      # start of t + 2: step t's counts
    assert [(r.layer.tolist(), r.dst.tolist()) for r in reads.started] == [([1], [3])]
    rb.release(torch.tensor([4]))                     # page 4 changes hands before its count is read
    rb.service()
    assert len(reads.started) == 1 and rb.counts_s > 0 and rb.service_calls == 3


def test_a_failed_read_still_in_the_transport_holds_its_pages_until_it_ended():
    """A read that failed at ``poll`` (its deadline) but that the transport still works on
    (``ended`` not set) is waited for before its page changes hands; then it is forgotten."""
    import threading
    import time

    reads = Reads()
    rb = RemoteBlocks(1, 1, 8, fetch=lambda *a: 0, post=reads.post, poll=reads.poll)
    rb.admit(torch.tensor([3]), "A", torch.tensor([30]))
    rb.deferred[0, 0, 3] = 1
    rb.service()
    r = reads.started[0]
    r.ended = threading.Event()

    def fail(read):
        raise RuntimeError("a READ of 1 pieces did not end in time")
    rb.poll = fail
    rb.service()
    assert "did not end in time" in rb.lost["A"] and rb.abandoned and not rb.pending
    threading.Timer(0.3, r.ended.set).start()
    t0 = time.time()
    rb.release(torch.tensor([3]))
    assert time.time() - t0 >= 0.25 and not rb.abandoned
    rb.release(torch.tensor([5]))                       # other pages wait for nothing


def test_the_device_copy_of_presence_follows_reads_admissions_and_releases():
    """``present_dev`` (a separate tensor on CUDA) is updated by one flat index per call: after
    reads of pieces spread over layers and heads end, and after pages change hands, it equals
    ``present`` exactly (run on the CPU with a separate copy standing in for the device's)."""
    reads = Reads()
    rb = RemoteBlocks(3, 2, 8, fetch=lambda *a: 0, post=reads.post, poll=reads.poll)
    rb.present_dev = rb.present.clone()                 # what a CUDA engine holds
    rb.admit(torch.tensor([3, 4, 6]), "A", torch.tensor([30, 40, 60]))
    assert torch.equal(rb.present_dev, rb.present) and int((~rb.present).sum()) == 3 * 2 * 3
    for l, h, p in ((2, 1, 3), (0, 1, 6), (1, 0, 4), (2, 0, 6)):
        rb.deferred[l, h, p] = 1
    rb.service()
    reads.started[0].done = True
    rb.service()
    assert torch.equal(rb.present_dev, rb.present)
    assert int((~rb.present).sum()) == 3 * 2 * 3 - 4 and bool(rb.present[2, 1, 3]) and bool(rb.present[1, 0, 4])
    rb.release(torch.tensor([4]))
    assert torch.equal(rb.present_dev, rb.present) and bool(rb.present[:, :, 4].all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams exist only on CUDA")
def test_cuda_bookkeeping_does_not_wait_for_the_step_in_flight():
    """SGLang's overlap scheduler keeps the GPU a step ahead: marking ended reads present,
    admitting and releasing pages, freeing a finished request's working-set row and its
    prediction record must not wait for the kernels queued on the stream (a copy from pageable
    host memory, or ``t[idx] = scalar``, would: 0.5 s each on the H200, ``core/devcopy.py``)."""
    from oasis_sglang.core.prediction import PredictionRecord
    from oasis_sglang.core.working_set import WorkingSet

    reads = Reads()
    rb = RemoteBlocks(2, 1, 8, fetch=lambda *a: 0, device="cuda", post=reads.post, poll=reads.poll)
    ws = WorkingSet(2, 3, 1, 4, 8, 16, 16, torch.float16, "cuda")
    rec = PredictionRecord(3, "cuda")

    def cycle(page, row, step_in_flight):
        """A request on ``page`` (and ``page + 1``, admitted later) in ``row``: one piece read
        and marked present, the pages released, the row freed. Returns what waited."""
        rb.admit(torch.tensor([page]), "A", torch.tensor([10 * page]))
        rb.deferred[1, 0, page] += 1
        rb.service()
        rb.service()                                    # step t's counts (read one call late): the read starts
        reads.started[-1].done = True
        ws.ids[:, row] = 7
        rec.seq[row] = 5
        torch.cuda.synchronize()
        if step_in_flight:
            torch.cuda._sleep(2_000_000_000)            # about a second of GPU time: the step in flight
        busy = torch.cuda.Event()
        busy.record()
        waited = {}
        rb.service()                                    # marks the ended read's piece present
        waited["service"] = busy.query()
        rb.admit(torch.tensor([page + 1]), "A", torch.tensor([10 * page + 10]))
        waited["admit"] = busy.query()
        rb.release(torch.tensor([page, page + 1]))
        waited["release"] = busy.query()
        ws.reset_rows([row])                            # the request finished: its row's slots freed
        waited["WorkingSet.reset_rows"] = busy.query()
        rec.forget([row])
        waited["PredictionRecord.forget"] = busy.query()
        torch.cuda.synchronize()
        return waited

    # once without a step in flight: the first launch of each kernel loads its module (CUDA's
    # lazy loading), which waits for the device; a server has run them all after its first requests
    cycle(2, 0, False)
    ws.ids[:, 2] = 9
    waited = cycle(4, 1, True)
    assert not any(waited.values()), f"waited for the kernels queued before it: {waited}"
    assert torch.equal(rb.present_dev.cpu(), rb.present) and bool(rb.present.all())
    assert len(reads.started) == 2 and not rb.pending
    assert bool((ws.ids[:, :2] == -1).all()) and bool((ws.ids[:, 2] == 9).all()) and int(ws.last_used.sum()) == 0
    assert rec.seq.tolist() == [-1, -1, -1]
