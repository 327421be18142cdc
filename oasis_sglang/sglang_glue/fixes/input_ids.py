"""Out-of-vocabulary ``input_ids`` are refused at the API instead of killing the server.

SGLang 0.5.17 checks a request's length (``TokenizerManager._validate_one_request``,
``managers/tokenizer_manager.py``) but not that its token ids lie in the vocabulary: it defines
``_validate_input_ids_in_vocab`` and never calls it (which would also let negative ids through).
An id outside ``[0, vocab_size)`` then reaches the scheduler's embedding lookup
(``IndexError: index out of range in self``) and the scheduler process exits: every running
request fails and the server stops serving, with or without ``--kv-sparse``. This hook, BEFORE
``_validate_one_request`` (listed in ``hooks.HOOKS``), raises the same ``ValueError`` SGLang uses
for its other request checks, which the HTTP server returns as a 400 for that request alone.
"""

from __future__ import annotations


def validate_input_ids_hook(self, obj, input_ids, *args, **kwargs):
    """BEFORE ``TokenizerManager._validate_one_request(obj, input_ids)``.

    Raises:
        ValueError: an id that is not an integer in ``[0, vocab_size)``, naming it and the range.
    """
    vocab = getattr(getattr(self, "model_config", None), "vocab_size", None)
    if not input_ids or not isinstance(vocab, int):
        return None
    bad = next((t for t in input_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"input_ids contains {bad!r}, outside the vocabulary: token ids must be integers in "
                         f"[0, {vocab})")
    return None
