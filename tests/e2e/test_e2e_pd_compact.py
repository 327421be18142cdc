"""A PD decode node with a compact host tier (``pd_host_slots``) behind sglang-router (issue 19).

Real SGLang (CPU engine), SmolLM2, NIXL over UCX loopback, the real router: the deployment of
``test_e2e_pd_oasis.py`` (budget 512, block 8, SGLang's retraction test mode on) with
``pd_host_slots`` on the decode node. Its host tier is then one pool of (sparse layer, KV head,
block) pieces that holds only what the node read from the prefill node or decoded itself
(``HostTier(num_slots=...)``, disagg/README.md), not every block of every page.

- greedy output through the router equals one dense server when the budget covers the context
  (three prompts decoded together, one retracted and recomputed every few steps);
- the decode node says it registered the compact pool and how much smaller it is than the whole
  tier, no read waited for a slot, and once every request ended every slot is free again;
- a 6000-token needle at budget 512: answered, while the pool held at most half of the
  request's pieces at once (its peak), and none after it ended.
"""

import concurrent.futures as cf
import re
import time

import pytest

pytest.importorskip("nixl")
pytest.importorskip("sglang_router")

from oasis_sglang import needle  # noqa: E402
from test_e2e import NEEDLE_CASES, chat, dense_reference, generate_ids, short_prompts  # noqa: E402
from test_e2e_pd_oasis import CFG, Deployment  # noqa: E402

pytestmark = pytest.mark.e2e

# SmolLM2: 28 sparse layers x 3 KV heads, K and V of 64 dims in fp32 on CPU: 4 KiB a piece of 8
# tokens. The three short prompts (up to 464 tokens + 24 new) hold at most 3 x 61 pages x 84
# pieces = 15372 pieces at once; the needle request (about 6000 tokens, 750 pages) has 63000
# pieces, of which it reads the ones its working sets want. 40000 slots: 156 MiB.
SLOTS = 40000
REGISTERED = re.compile(r"OasisKV PD: decode node's host tier registered with NIXL as agent \S+: a compact pool of "
                        r"(\d+) pieces \(pd_host_slots\), ([\d.]+) MiB, instead of ([\d.]+) MiB for every block")
RELEASED = re.compile(r"OasisKV PD: released request \S+: its sparse layers' KV in this node's host tier ([\d.]+) MiB "
                      r".* vs ([\d.]+) MiB allocated whole .* host tier resident (\d+) of (\d+) pool slots in use "
                      r"\(peak (\d+)\), (\d+) reads waited for a slot so far, requests from prefill nodes held: (\d+)")


@pytest.fixture(scope="module")
def pd_compact(model):
    d = Deployment(model, {**CFG, "pd_host_slots": SLOTS}, "pd_compact")
    yield d
    d.stop()


def test_compact_decode_tier_through_router_equals_dense(model, tok, pd_compact):
    prompts = short_prompts(tok)
    n_new = 24
    ref = [r[0] for r in dense_reference(model, prompts, n_new)]
    with cf.ThreadPoolExecutor(len(prompts)) as ex:        # together: the decode node runs them batched
        got = list(ex.map(lambda p: generate_ids(pd_compact.url, p, n_new), prompts))
    for p, r, g in zip(prompts, ref, got):
        assert len(p) + n_new <= CFG["budget_tokens"]
        assert g == r, f"prompt of {len(p)} tokens: PD oasis with a compact decode tier {g} != dense {r}"
    dlog = pd_compact.dc.log()
    reg = REGISTERED.findall(dlog)
    assert reg, "the decode node did not register a compact host tier"
    slots, pool_mib, whole_mib = int(reg[0][0]), float(reg[0][1]), float(reg[0][2])
    assert slots == SLOTS and pool_mib < whole_mib, reg
    assert " retracted " in dlog, "no request was retracted (the compact tier's release path did not run)"
    rel = RELEASED.findall(dlog)
    assert len(rel) >= len(prompts), rel
    assert all(int(m[3]) == SLOTS and int(m[5]) == 0 for m in rel), rel      # no read ever waited for a slot
    idle = [m for m in rel if int(m[6]) == 0]
    assert idle and int(idle[-1][2]) == 0, f"slots still in use with no request held: {rel}"
    assert "compact host tier is full" not in dlog


def test_compact_decode_tier_finds_the_needle_holding_a_fraction_of_its_pieces(tok, pd_compact):
    """A 6000-token needle at budget 512: the answer through the router, and the decode node's
    pool never held more than half of the request's pieces (it reads only the blocks its
    working sets want; the whole tier would take memory for all of them)."""
    p = needle.build(tok, *NEEDLE_CASES[-1])
    n = len(needle.chat_ids(tok, p.messages))
    assert n >= 4 * CFG["budget_tokens"]
    o = chat(pd_compact.url, p.messages)
    assert p.answer in o, f"PD oasis with a compact decode tier (budget 512) lost the needle: {o!r}"
    pieces = -(-n // CFG["block_size"]) * 28 * 3
    rel = []
    for _ in range(30):                                 # logged when the request's pages are freed
        rel = [m for m in RELEASED.findall(pd_compact.dc.log()) if int(m[6]) == 0 and float(m[1]) * 2**20 >= n * 28 * 3
               * 64 * 2 * 4]
        if rel:
            break
        time.sleep(1)
    assert rel, "no release line for the needle request"
    held_mib, whole_mib, in_use, peak = float(rel[-1][0]), float(rel[-1][1]), int(rel[-1][2]), int(rel[-1][4])
    assert in_use == 0, rel[-1]
    assert peak < pieces / 2, f"the pool held {peak} of the request's {pieces} pieces at once"
    assert held_mib < whole_mib / 2, rel[-1]
