"""The speculative draft as a probe: SGLang's EAGLE-3 verify pass as OasisKV's paired forward.

With ``--speculative-algorithm EAGLE3 --speculative-num-steps 1 --speculative-eagle-topk 1
--speculative-num-draft-tokens 2`` each target step is a TARGET_VERIFY forward with two rows per
request: the token being decoded and the draft token after it. ``OasisAttnBackend`` serves the
first as the normal decode row and the second as the draft row whose query predicts the next
step's working set (paper: Methodology, Look-ahead Attention). In this release the draft is a
probe: its K/V are never written, so it must never be accepted either. These hooks make the
verification reject every draft, so the output equals plain greedy decoding:

* ``verify_tree_greedy_func`` (AROUND): the draft candidates are replaced by ``-1`` (no token),
  so the greedy tree walk accepts none and the bonus token is the target's own argmax;
* ``eagle_sample`` (AROUND): a batch with sampled requests takes the greedy verification path
  (SGLang's CPU engine always does); without this the rejection-sampling kernel could accept a
  draft whose K/V OasisKV did not keep.

Both are inert unless the OasisKV engine of this process runs with a draft (``ACTIVE``).

Before rejecting, the verify hook counts the drafts that equal the target's own next token (what
SGLang would have accepted): ``draft_match()``, shown as ``draft match`` in the ``OasisKV decode``
log line. It tells how good the draft source is (a trained EAGLE-3 head or a self-draft: high;
a random head: near 0) and that the draft layer's attention is right. With NGRAM, steps where
the corpus has no match carry its padding token (id 0) as the draft and count as misses.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ACTIVE = False          # set by init_attention_backends_hook when --kv-sparse oasis runs with a draft
_warned = False
_match = None           # int64 [2] on the device: drafts equal to the target's next token, drafts verified


def activate() -> None:
    """Turn the probe hooks on in this (scheduler) process."""
    global ACTIVE
    ACTIVE = True


def verify_tree_greedy_hook(original, *args, **kwargs):
    """AROUND ``eagle_utils.verify_tree_greedy_func``: reject every draft (probe mode)."""
    if ACTIVE:
        cand = kwargs.get("candidates")
        if cand is None:
            args = list(args)
            cand = args[3]
        tp = kwargs.get("target_predict", args[7] if len(args) > 7 else None)
        if tp is not None and cand.shape[1] > 1:
            _count_matches(cand[:, 1], tp.reshape(cand.shape[0], cand.shape[1])[:, 0])
        cand = cand.clone()
        cand[:, 1:] = -1                      # no vocabulary id: the greedy walk accepts nothing
        if "candidates" in kwargs:
            kwargs["candidates"] = cand
        else:
            args[3] = cand
    return original(*args, **kwargs)


def _count_matches(draft, target) -> None:
    """Accumulate on the device (no host sync on the decode path)."""
    global _match
    if _match is None or _match.device != draft.device:
        _match = torch.zeros(2, dtype=torch.int64, device=draft.device)
    _match[0] += (draft == target).sum()
    _match[1] += draft.numel()


def draft_match() -> torch.Tensor | None:
    """``[drafts equal to the target's next token, drafts verified]`` since start-up (int64 ``[2]``
    on the device; ``DecodeLog`` copies it with its report, no host read here), or ``None``
    before the first verify pass."""
    return _match


def eagle_sample_hook(original, *args, **kwargs):
    """AROUND ``eagle_utils.eagle_sample``: greedy verification while the draft is a probe."""
    global _warned
    if not ACTIVE:
        return original(*args, **kwargs)
    batch = kwargs.get("batch", args[1] if len(args) > 1 else None)     # eagle_sample(verify_input, batch, ...)
    info = getattr(batch, "sampling_info", None)
    if info is None or info.is_all_greedy:
        return original(*args, **kwargs)
    if not _warned:
        logger.warning("OasisKV: with a draft source, decoding is greedy in this release (the draft is a "
                       "probe that is never accepted; sampled requests are decoded greedily)")
        _warned = True
    info.is_all_greedy = True
    try:
        return original(*args, **kwargs)
    finally:
        info.is_all_greedy = False
