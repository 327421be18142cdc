import os

import pytest


@pytest.fixture(scope="module")
def restore_env():
    """ServerArgs with --kv-sparse oasis sets SGLang environment variables: put them back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
