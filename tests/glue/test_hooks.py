"""Every hook target resolves in the installed SGLang and the plugin is registered."""

from importlib.metadata import entry_points

from oasis_sglang.sglang_glue import hooks


def test_all_hook_targets_resolve():
    assert hooks.unresolved_targets() == []


def test_entry_point_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("oasis") == "oasis_sglang.sglang_glue.hooks:register"


def test_check_plugin_ready_applies_every_hook():
    hooks.check_plugin_ready()
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert {h.target for h in hooks.HOOKS} <= HookRegistry._patched
