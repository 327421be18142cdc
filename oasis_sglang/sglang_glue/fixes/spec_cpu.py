"""EAGLE speculative decoding on SGLang 0.5.17's CPU engine (``intel_amx`` attention backend).

Two hooks (listed in ``hooks.HOOKS``), independent of ``--kv-sparse``:

* ``IntelAMXAttnBackend.forward_extend`` / ``forward_decode`` (AROUND): 0.5.17 computes the
  right key lengths and then overwrites them. ``_build_extend_metadata`` returns
  ``seq_lens + draft_token_num`` for a TARGET_VERIFY batch (the verified prefix plus the draft
  tokens being verified), but ``forward_extend`` then does ``seq_lens = forward_batch.seq_lens``
  (``intel_amx_backend.py:216``), so the verify pass attends to a prefix ``draft_token_num``
  tokens too short and treats the last prefix tokens as the draft tokens: wrong tokens from the
  first verified step. ``forward_decode`` does the same (line 262) with the per-candidate lengths
  of the multi-step draft decode (``draft_decode_metadata``, num-steps > 1). (SGLang 0.5.23 no
  longer has the forward_extend line: shared/notes/sglang-0.5.17.md.) The hooks make the
  method's one read of ``forward_batch.seq_lens`` return the lengths the backend computed
  itself, for the duration of the call; other batches (prefill, decode, draft extend) go to
  SGLang unchanged.
  ``OASIS_DISABLE_SPEC_FIX=1`` turns them off (to show the bug, see tests/test_eagle_cpu.py).

* ``arg_groups.overrides._attention_backend_platform_fallbacks`` (AROUND): SGLang replaces
  ``intel_amx`` by ``torch_native`` on a CPU without AMX tiles (or without the real
  ``sgl_kernel``), but EAGLE has no ``torch_native`` draft/verify backend
  (``speculative/draft_utils.py``: "EAGLE is not supported in attention backend torch_native").
  With speculative decoding on the CPU engine and the oasis torch ops serving ``sgl_kernel``
  (``oasis_sglang.cpu.sgl_kernel_ops``: ``decode_attention_cpu`` / ``extend_attention_cpu`` in torch), the
  hook keeps ``intel_amx``; otherwise it defers to SGLang.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

DISABLE_ENV = "OASIS_DISABLE_SPEC_FIX"
SEQ_LENS_TARGETS = (
    "sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.forward_extend",
    "sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.forward_decode",
)


def spec_fix_disabled() -> bool:
    """True when ``OASIS_DISABLE_SPEC_FIX=1`` (the seq_lens hooks then call SGLang unchanged)."""
    return os.environ.get(DISABLE_ENV) == "1"


def _call_with_seq_lens(original, self, forward_batch, seq_lens, args, kwargs):
    """Run ``original(self, *args)`` with ``forward_batch.seq_lens`` set to ``seq_lens``."""
    saved = forward_batch.seq_lens
    forward_batch.seq_lens = seq_lens
    try:
        return original(self, *args, **kwargs)
    finally:
        forward_batch.seq_lens = saved


def _forward_batch(args, kwargs):
    # forward_extend/forward_decode(self, q, k, v, layer, forward_batch, ...)
    return kwargs["forward_batch"] if "forward_batch" in kwargs else args[4]


def forward_extend_hook(original, self, *args, **kwargs):
    """AROUND ``IntelAMXAttnBackend.forward_extend``: in a TARGET_VERIFY batch the extend kernel
    sees the key lengths of ``self.extend_metadata`` (``seq_lens + draft_token_num``, built by
    ``init_forward_metadata``); any other batch goes to SGLang unchanged."""
    meta = getattr(self, "extend_metadata", None)
    fb = _forward_batch(args, kwargs)
    if spec_fix_disabled() or meta is None or not fb.forward_mode.is_target_verify() or meta[0] is fb.seq_lens:
        return original(self, *args, **kwargs)
    return _call_with_seq_lens(original, self, fb, meta[0], args, kwargs)


def forward_decode_hook(original, self, *args, **kwargs):
    """AROUND ``IntelAMXAttnBackend.forward_decode``: in a multi-step draft decode step the
    decode kernel sees the per-candidate lengths of ``self.draft_decode_metadata``."""
    meta = getattr(self, "draft_decode_metadata", None)
    fb = _forward_batch(args, kwargs)
    if spec_fix_disabled() or meta is None or meta[1] is fb.seq_lens:
        return original(self, *args, **kwargs)
    return _call_with_seq_lens(original, self, fb, meta[1], args, kwargs)


def oasis_torch_attention_ops() -> bool:
    """True when ``sgl_kernel`` is oasis-sglang's CPU shim (torch ``decode/extend_attention_cpu``)."""
    try:
        import sgl_kernel  # noqa: F401
    except Exception:  # noqa: BLE001 - no sgl_kernel at all
        return False
    import torch

    return bool(getattr(sgl_kernel, "__oasis_cpu_shim__", False)) and all(
        hasattr(torch.ops.sgl_kernel, n) for n in ("decode_attention_cpu", "extend_attention_cpu"))


def platform_fallback_hook(original, view, *args, **kwargs):
    """AROUND ``_attention_backend_platform_fallbacks``: keep ``intel_amx`` for EAGLE on CPU.

    Returns ``{}`` (no override) when the device is CPU, the backend ``intel_amx``, a
    speculative algorithm is set and the oasis torch attention ops serve ``sgl_kernel``;
    otherwise SGLang's own result (``torch_native`` on CPUs without AMX).

    Raises:
        RuntimeError: the seq_lens hooks were not applied in this process (SGLang's
            HookRegistry only logs failures): EAGLE would then give wrong tokens.
    """
    if not (getattr(view, "device", None) == "cpu" and getattr(view, "attention_backend", None) == "intel_amx"
            and getattr(view, "speculative_algorithm", None) and oasis_torch_attention_ops()):
        return original(view, *args, **kwargs)
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [t for t in SEQ_LENS_TARGETS if t not in HookRegistry._patched]
    if missing:
        raise RuntimeError("oasis-sglang: EAGLE on the CPU engine needs the intel_amx seq_lens fix, but these "
                           "hooks were not applied: " + ", ".join(missing))
    logger.info("oasis-sglang: speculative decoding on CPU keeps the intel_amx attention backend (torch "
                "decode/extend_attention_cpu; seq_lens fix %s)", "DISABLED" if spec_fix_disabled() else "on")
    return {}


def ngram_load_jit_hook(original, *args, **kwargs):
    """AROUND ``sglang.kernels.ops.speculative.ngram_corpus.load_jit``: SGLang 0.5.17's n-gram
    corpus header (``jit/csrc/ngram_corpus/result.h``) uses ``size_t`` without including
    ``<cstddef>``, which g++ 13 refuses; pre-include it. Harmless where it already compiles."""
    kwargs["extra_cflags"] = list(kwargs.get("extra_cflags") or []) + ["-include", "cstddef"]
    return original(*args, **kwargs)
