import os
import random

import pytest
import torch

# Kernel tests on a host without CUDA run the Triton kernels interpreted. Triton reads this flag
# when it decorates functions, its own library included, so it must be set before anything
# imports triton (SGLang does); servers started by the tests get it removed (oasis_sglang/testing/launch.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    s = int(os.environ.get("OASIS_TEST_SEED", random.randrange(1 << 30)))
    print(f"OASIS_TEST_SEED={s}")
    torch.manual_seed(s)
    return s


@pytest.fixture(scope="session")
def model():
    """Path of the prepared SmolLM2-135M-Instruct folder (the end-to-end tests' model)."""
    from oasis_sglang.models import prepare_smollm2

    return str(prepare_smollm2())


@pytest.fixture(scope="session")
def tok(model):
    """Its tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)
