"""sglang_glue/fixes/input_ids.py: out-of-vocabulary input_ids are refused before they reach the
scheduler (the server-level check is in tests/e2e/test_e2e.py). The hook's ``self`` is SGLang's
TokenizerManager, of which it reads only ``model_config.vocab_size``: a stand-in gives it."""

from types import SimpleNamespace

import pytest

from oasis_sglang.sglang_glue import hooks
from oasis_sglang.sglang_glue.fixes.input_ids import validate_input_ids_hook

TM = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))


@pytest.mark.parametrize("ids", [[1, 2, 99], [], None])
def test_ids_in_the_vocabulary_pass(ids):
    assert validate_input_ids_hook(TM, object(), ids) is None


@pytest.mark.parametrize("ids,bad", [([1, 100], "100"), ([-1, 5], "-1"), ([3, 99999999], "99999999"),
                                     ([1, 2.0], "2.0"), ([True], "True")])
def test_ids_outside_the_vocabulary_are_refused_naming_them(ids, bad):
    with pytest.raises(ValueError, match=rf"input_ids contains {bad}, outside the vocabulary.*\[0, 100\)"):
        validate_input_ids_hook(TM, object(), ids)


def test_the_hook_is_listed_and_resolves():
    h = [h for h in hooks.HOOKS if h.impl.endswith("validate_input_ids_hook")]
    assert len(h) == 1 and h[0].kind == "BEFORE"
    assert not [b for b in hooks.unresolved_targets() if "validate_one_request" in b or "input_ids" in b]


@pytest.mark.parametrize("k,ok", [(5, True), (100, True), (101, False), ([3, 100000], False), (None, True)])
def test_top_logprobs_above_the_vocabulary_are_refused(k, ok):
    obj = SimpleNamespace(return_logprob=True, top_logprobs_num=k)
    if ok:
        assert validate_input_ids_hook(TM, obj, [1, 2]) is None
    else:
        with pytest.raises(ValueError, match=r"top_logprobs_num (101|100000) exceeds the vocabulary size 100"):
            validate_input_ids_hook(TM, obj, [1, 2])
    obj.return_logprob = False                            # not asked for: SGLang ignores the number
    assert validate_input_ids_hook(TM, obj, [1]) is None


@pytest.mark.parametrize("m,ok", [(10, True), (None, True), (10.0, True), ("ten", False), (True, False),
                                  ([1], False), (2.5, False)])
def test_a_max_new_tokens_that_is_not_an_integer_is_refused_naming_it(m, ok):
    obj = SimpleNamespace(sampling_params={"max_new_tokens": m})
    if ok:
        assert validate_input_ids_hook(TM, obj, [1, 2]) is None
    else:
        with pytest.raises(ValueError, match=r"sampling_params\.max_new_tokens must be an integer, got"):
            validate_input_ids_hook(TM, obj, [1, 2])
