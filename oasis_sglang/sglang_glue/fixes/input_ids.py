"""Out-of-vocabulary ``input_ids`` and a ``top_logprobs_num`` above the vocabulary are refused at
the API instead of killing the server.

SGLang 0.5.17 checks a request's length (``TokenizerManager._validate_one_request``,
``managers/tokenizer_manager.py``) but not that its token ids lie in the vocabulary: it defines
``_validate_input_ids_in_vocab`` and never calls it (which would also let negative ids through).
An id outside ``[0, vocab_size)`` then reaches the scheduler's embedding lookup
(``IndexError: index out of range in self``) and the scheduler process exits: every running
request fails and the server stops serving, with or without ``--kv-sparse``. This hook, BEFORE
``_validate_one_request`` (listed in ``hooks.HOOKS``), raises the same ``ValueError`` SGLang uses
for its other request checks, which the HTTP server returns as a 400 for that request alone.

A ``max_new_tokens`` that is not a number (``"ten"``) fails inside ``_validate_one_request``
itself (``max_new_tokens + input_token_num``: a ``TypeError``, so an HTTP 500 with no message);
it is refused here with a ``ValueError`` naming it.

The same holds for ``top_logprobs_num`` larger than the vocabulary with ``return_logprob``:
``logprobs.topk(k)`` (``layers/logprob_processor.py get_top_logprobs_raw``) raises "selected
index k out of range" in the scheduler, which exits.
"""

from __future__ import annotations


def validate_input_ids_hook(self, obj, input_ids, *args, **kwargs):
    """BEFORE ``TokenizerManager._validate_one_request(obj, input_ids)``.

    Raises:
        ValueError: an id that is not an integer in ``[0, vocab_size)``, naming it and the range;
            ``top_logprobs_num`` above ``vocab_size`` when ``return_logprob`` is set;
            ``sampling_params.max_new_tokens`` that is not an integer (or an integral float).
    """
    sp = getattr(obj, "sampling_params", None)
    m = sp.get("max_new_tokens") if isinstance(sp, dict) else None
    if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float))
                          or (isinstance(m, float) and not m.is_integer())):
        shown = repr(m) if len(repr(m)) <= 80 else repr(m)[:80] + "..."
        raise ValueError(f"sampling_params.max_new_tokens must be an integer, got {shown}")
    vocab = getattr(getattr(self, "model_config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        return None
    if getattr(obj, "return_logprob", False):
        k = getattr(obj, "top_logprobs_num", None)
        for x in k if isinstance(k, (list, tuple)) else [k]:
            if isinstance(x, int) and not isinstance(x, bool) and x > vocab:
                raise ValueError(f"top_logprobs_num {x} exceeds the vocabulary size {vocab}")
    if not input_ids:
        return None
    bad = next((t for t in input_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"input_ids contains {bad!r}, outside the vocabulary: token ids must be integers in "
                         f"[0, {vocab})")
    return None
