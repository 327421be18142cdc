"""sglang_glue/fixes/pd_cpu.py: SGLang's PD mode on the CPU engine (the end-to-end run through the
router is tests/e2e/test_e2e_pd.py). The hooks read only ``server_args.device`` and the
``KVArgs`` fields they set: stand-ins give them."""

from types import SimpleNamespace

import pytest

from oasis_sglang.sglang_glue import hooks
from oasis_sglang.sglang_glue.fixes.pd_cpu import early_send_hook, nixl_manager_init_hook


@pytest.mark.parametrize("device,want", [("cpu", ["DRAM"] * 3), ("cuda", None)])
def test_kv_pool_registered_as_dram_on_cpu_only(device, want):
    args = SimpleNamespace(kv_data_ptrs=[1, 2, 3])
    assert nixl_manager_init_hook(object(), args, "prefill", SimpleNamespace(device=device)) is None
    assert getattr(args, "kv_data_mem_kinds", None) == want


@pytest.mark.parametrize("device,sent", [("cpu", False), ("cuda", True)])
def test_early_send_skipped_on_cpu_only(device, sent):
    calls = []
    sched = SimpleNamespace(server_args=SimpleNamespace(device=device))
    early_send_hook(lambda self, req: calls.append(req), sched, "req")
    assert calls == (["req"] if sent else [])


def test_the_hooks_are_listed_and_resolve():
    impls = {h.impl.rsplit(":", 1)[1]: h for h in hooks.HOOKS if "pd_cpu" in h.impl}
    assert impls["nixl_manager_init_hook"].kind == "BEFORE" and impls["early_send_hook"].kind == "AROUND"
    assert not [b for b in hooks.unresolved_targets() if "disaggregation" in b or "pd_cpu" in b]
