"""Needle prompts (oasis_sglang.needle) from the real essays and SmolLM2's tokenizer."""

import pytest

from oasis_sglang import needle


def test_haystack_has_the_length_asked_and_refuses_what_it_cannot_give(tok):
    assert len(needle.haystack_ids(tok, 1000)) == 1000
    p = needle.build(tok, 1000, 0.5)
    assert needle.NEEDLE in p.messages[0]["content"] and p.messages[0]["content"].endswith(needle.QUESTION)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="at least 1 token"):
            needle.build(tok, bad, 0.5)
    with pytest.raises(ValueError, match="the essays hold only"):
        needle.haystack_ids(tok, 10_000_000)
    with pytest.raises(ValueError, match="depth"):
        needle.build(tok, 1000, 1.5)
