import os
import random

import pytest
import torch


@pytest.fixture
def seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    s = int(os.environ.get("OASIS_TEST_SEED", random.randrange(1 << 30)))
    print(f"OASIS_TEST_SEED={s}")
    torch.manual_seed(s)
    return s
