"""Every test here must close the NIXL agents it made (``NixlTier.close``, ``*Side.close``):
NIXL's progress thread busy-polls a core while an agent lives, and leaked agents once held both
cores of the 2-core CI box for the rest of the run (the end-to-end servers then timed out)."""

import gc

import pytest


@pytest.fixture(autouse=True)
def no_nixl_agent_left_open():
    yield
    from oasis_sglang.disagg.transport import NixlTier

    gc.collect()
    left = [t.name for t in gc.get_objects() if type(t) is NixlTier and not t.closed]
    for t in gc.get_objects():          # close them, so one leak fails one test, not the whole run
        if type(t) is NixlTier:
            t.close()
    assert not left, f"NIXL agents left open by this test (close their NixlTier / PrefillSide / DecodeSide): {left}"
