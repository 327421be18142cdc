"""The patch CLI on a pristine copy of the installed SGLang file (never the real install)."""

import shutil
import subprocess
import sys

import pytest

from oasis_sglang import patching


@pytest.fixture
def root(tmp_path):
    """A folder holding a pristine copy of sglang/srt/server_args.py."""
    _, series = patching.load_series()
    real = patching.sglang_root()
    for s in series:
        dst = tmp_path / s.target
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(real / s.target, dst)
        if patching.state(s, tmp_path) == "applied":   # the install is patched: make it pristine
            patching._run_patch(s, tmp_path, reverse=True)
        assert patching.state(s, tmp_path) == "pristine"
    return tmp_path


def cli(*args):
    return subprocess.run([sys.executable, "-m", "oasis_sglang.cli", "patch", *args], capture_output=True, text=True)


def test_apply_check_revert_reapply(root):
    r = cli("status", "--sglang-root", str(root)); assert r.returncode == 0 and "pristine" in r.stdout
    r = cli("apply", "--sglang-root", str(root)); assert r.returncode == 0 and "applied to" in r.stdout, r.stderr
    target = root / "sglang/srt/server_args.py"
    text = target.read_text()
    assert "kv_sparse: A[" in text and "handle_kv_sparse_args(self)" in text
    r = cli("apply", "--sglang-root", str(root)); assert r.returncode == 0 and "already applied" in r.stdout
    r = cli("check", "--sglang-root", str(root)); assert r.returncode == 0
    r = cli("revert", "--sglang-root", str(root)); assert r.returncode == 0 and "reverted" in r.stdout
    assert "kv_sparse" not in target.read_text()
    r = cli("revert", "--sglang-root", str(root)); assert r.returncode == 0 and "not applied" in r.stdout
    r = cli("apply", "--sglang-root", str(root)); assert r.returncode == 0
    assert target.read_text() == text


def test_refuses_unknown_file(root):
    target = root / "sglang/srt/server_args.py"
    target.write_text(target.read_text() + "\n# locally modified\n")
    before = target.read_text()
    for action in ("apply", "revert", "check"):
        r = cli(action, "--sglang-root", str(root))
        assert r.returncode == 2 and "matches neither" in r.stderr
    assert target.read_text() == before, "a refused command must not touch the file"


def test_version_mismatch_refused(monkeypatch):
    monkeypatch.setattr(patching, "sglang_version", lambda: "0.5.99")
    with pytest.raises(patching.PatchError, match="0.5.99"):
        patching.check()


def test_patched_module_adds_the_flags():
    """The installed SGLang (patched by the test command) parses the new flags."""
    from sglang.srt.server_args import ServerArgs

    fields = ServerArgs.__dataclass_fields__
    assert fields["kv_sparse"].default == "none" and fields["kv_sparse_config"].default is None


@pytest.mark.parametrize("argv,msg", [(["prepare-model", "--cache-dir", "/dev/null"], "is not a folder"),
                                      (["prepare-eagle3", "--seed", "-1"], "--seed -1")])
def test_prepare_commands_refuse_bad_options(argv, msg):
    """Refused with exit 2 and the option named, before any conversion, not with a traceback."""
    r = subprocess.run([sys.executable, "-m", "oasis_sglang.cli", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_an_empty_sglang_root_is_refused():
    """``--sglang-root ''`` (an unset shell variable) is an error, not the installed SGLang."""
    r = cli("status", "--sglang-root", "")
    assert r.returncode == 2 and "--sglang-root is empty" in r.stderr
