"""The patch-and-rebuild workflow: apply ``patches/`` to the installed SGLang, check, revert.

Each patch in ``patches/series.json`` names its target file (relative to site-packages) and
the SHA-256 of that file before (pristine) and after (patched). Every command checks the
SGLang version and the hashes first and refuses with a clear message on a mismatch, so it
never edits a file it does not recognise. ``apply`` and ``revert`` are idempotent.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


class PatchError(RuntimeError):
    """A version or hash mismatch, or a failed ``patch`` run; the message says which file."""


@dataclass(frozen=True)
class PatchSpec:
    """One entry of ``patches/series.json``: patch file, target (relative to site-packages), hashes, reason."""
    name: str
    target: str
    pristine_sha256: str
    patched_sha256: str
    why: str


def _patch_dir() -> Path:
    return Path(str(resources.files("oasis_sglang.patches")))


def load_series() -> tuple[str, list[PatchSpec]]:
    """Return ``(sglang_version, [PatchSpec, ...])`` from ``patches/series.json``."""
    data = json.loads((_patch_dir() / "series.json").read_text())
    return data["sglang_version"], [PatchSpec(**p) for p in data["patches"]]


def sglang_root() -> Path:
    """Folder that holds the installed ``sglang`` package (site-packages)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("sglang is not installed in this Python environment")
    return Path(list(spec.submodule_search_locations)[0]).parent


def sglang_version() -> str:
    """Version string of the installed ``sglang`` distribution."""
    from importlib.metadata import version

    return version("sglang")


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def state(spec: PatchSpec, root: Path) -> str:
    """``pristine``, ``applied``, ``missing`` or ``unknown`` (the file matches neither hash)."""
    f = root / spec.target
    if not f.exists():
        return "missing"
    h = sha256(f)
    return {spec.pristine_sha256: "pristine", spec.patched_sha256: "applied"}.get(h, "unknown")


def _check_version(expected: str) -> None:
    got = sglang_version()
    if got != expected:
        raise PatchError(f"installed sglang is {got}; these patches are for sglang=={expected}. "
                         f"Install it with: pip install sglang=={expected}")


def _run_patch(spec: PatchSpec, root: Path, reverse: bool) -> None:
    target = root / spec.target
    want = spec.pristine_sha256 if reverse else spec.patched_sha256
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "f.py"
        shutil.copy2(target, work)
        cmd = ["patch", "--quiet", "--batch", "--no-backup-if-mismatch", "-o", str(Path(tmp) / "out.py"),
               str(work), str(_patch_dir() / spec.name)]
        if reverse:
            cmd.insert(1, "-R")
        r = subprocess.run(cmd, capture_output=True, text=True)
        out = Path(tmp) / "out.py"
        if r.returncode != 0 or not out.exists() or sha256(out) != want:
            raise PatchError(f"{spec.name}: patch{' -R' if reverse else ''} did not produce the expected "
                             f"{spec.target} ({r.stdout.strip()} {r.stderr.strip()})")
        shutil.copyfile(out, target)  # atomic enough: the result was verified first
    for pyc in (target.parent / "__pycache__").glob(target.stem + ".*.pyc"):
        pyc.unlink(missing_ok=True)


def status(root: Path | None = None) -> list[tuple[PatchSpec, str]]:
    """``[(PatchSpec, state), ...]`` for every patch; see :func:`state`."""
    root = root or sglang_root()
    _, series = load_series()
    return [(s, state(s, root)) for s in series]


def check(root: Path | None = None, check_version: bool = True) -> None:
    """Raise :class:`PatchError` unless every target is pristine or applied (and the version matches)."""
    expected, series = load_series()
    if check_version:
        _check_version(expected)
    root = root or sglang_root()
    for s in series:
        st = state(s, root)
        fix = f"restore it with: pip install --force-reinstall --no-deps sglang=={expected}"
        if st == "missing":
            raise PatchError(f"{root / s.target} does not exist: is sglang installed under {root}? ({fix})")
        if st == "unknown":
            raise PatchError(f"{s.target} is unknown: its SHA-256 matches neither pristine sglang=={expected} "
                             f"nor the patched file (edited locally, or patched by another oasis-sglang "
                             f"version); refusing to touch it ({fix}, then apply)")


def apply(root: Path | None = None, check_version: bool = True) -> list[str]:
    """Apply every patch not yet applied. Returns ``["<name>: applied|already applied", ...]``."""
    check(root, check_version)
    root = root or sglang_root()
    out = []
    for s in load_series()[1]:
        if state(s, root) == "applied":
            out.append(f"{s.name}: already applied")
            continue
        _run_patch(s, root, reverse=False)
        out.append(f"{s.name}: applied to {root / s.target}")
    return out


def revert(root: Path | None = None, check_version: bool = True) -> list[str]:
    """Undo every applied patch. Returns one line per patch."""
    check(root, check_version)
    root = root or sglang_root()
    out = []
    for s in reversed(load_series()[1]):
        if state(s, root) == "pristine":
            out.append(f"{s.name}: not applied")
            continue
        _run_patch(s, root, reverse=True)
        out.append(f"{s.name}: reverted in {root / s.target}")
    return out
