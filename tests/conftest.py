import os
import random

import pytest
import torch

# Kernel tests on a host without CUDA run the Triton kernels interpreted. Triton reads this flag
# when it decorates functions, its own library included, so it must be set before anything
# imports triton (SGLang does); servers started by the tests get it removed (launch.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    s = int(os.environ.get("OASIS_TEST_SEED", random.randrange(1 << 30)))
    print(f"OASIS_TEST_SEED={s}")
    torch.manual_seed(s)
    return s
