import os

import pytest


@pytest.fixture(scope="module")
def restore_env():
    """ServerArgs with --kv-sparse oasis sets SGLang environment variables: put them back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def cpu_engine_env():
    """The environment of an OasisKV server on CPU: SGLang's CPU engine (a server without it
    is refused at start-up; ``test_server_args.py`` tests that refusal). Module scope, so the
    modules' own module-scoped fixtures that build ServerArgs see it too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_USE_CPU_ENGINE", "1")
        yield
