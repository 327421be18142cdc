"""scripts/gpu_smoke.sh's Triton cache hand-over (the GPU stages themselves need the lent H200):
a carried ``.gpuhost/triton-cache.tgz`` is unpacked into ``TRITON_CACHE_DIR`` before a stage, the
cache comes back as ``$OUT/triton-cache.tgz`` after it, and the stage's exit status is kept."""

import shutil
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_triton_cache_is_restored_and_returned_and_the_exit_status_kept(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".gpuhost").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_smoke.sh", repo / "scripts")
    src = tmp_path / "src" / "ab12"
    src.mkdir(parents=True)
    (src / "kernel.cubin").write_bytes(b"\x7fELF cubin")
    with tarfile.open(repo / ".gpuhost" / "triton-cache.tgz", "w:gz") as t:
        t.add(src, arcname="ab12")
    out, cache = tmp_path / "out", tmp_path / "cache"
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "TRITON_CACHE_DIR": str(cache)}
    r = subprocess.run(["bash", "scripts/gpu_smoke.sh", "9"], cwd=repo, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "stage 9" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert (cache / "ab12" / "kernel.cubin").read_bytes() == b"\x7fELF cubin", "restored before the stage"
    with tarfile.open(out / "triton-cache.tgz") as t:
        assert "./ab12/kernel.cubin" in t.getnames(), "returned after it"
