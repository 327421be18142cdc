"""sglang_glue/server_args.py ``oasis_config``: the one reader of the stored ``--kv-sparse-config``
(real ServerArgs; the flag handling at start-up is in test_server_args)."""

import json
import pickle

import pytest
from sglang.srt.server_args import ServerArgs

from oasis_sglang.config import OasisConfig, OasisConfigError
from oasis_sglang.sglang_glue.server_args import oasis_config

JSON = '{"budget_tokens": 16, "block_size": 4, "dense_layers": [0], "fetch_cap": 2}'


@pytest.fixture(scope="module")
def oasis_args(model, restore_env):
    return ServerArgs(model_path=model, device="cpu", kv_sparse="oasis", kv_sparse_config=JSON)


@pytest.fixture(scope="module")
def plain_args(model, restore_env):
    return ServerArgs(model_path=model, device="cpu")


def _with_config(args, text):
    """A copy of ``args`` whose stored config was changed after start-up (ServerArgs' own
    post-resolution mutation point)."""
    a = pickle.loads(pickle.dumps(args))
    a.override("test", kv_sparse_config=text)
    assert a.kv_sparse_config == text and args.kv_sparse_config != text
    return a


def test_no_config_without_kv_sparse_oasis(plain_args):
    assert plain_args.kv_sparse == "none" and oasis_config(plain_args) is None
    assert oasis_config(object()) is None, "args without the flag (an SGLang without the patch)"


def test_the_stored_config_is_parsed_once_per_json_text(oasis_args):
    cfg = oasis_config(oasis_args)
    assert isinstance(cfg, OasisConfig)
    assert (cfg.budget_tokens, cfg.block_size, cfg.dense_layers, cfg.fetch_cap) == (16, 4, (0,), 2)
    assert oasis_config(oasis_args) is cfg
    # the scheduler process gets the args pickled: the same text gives the same object
    assert oasis_config(pickle.loads(pickle.dumps(oasis_args))) is cfg
    assert oasis_args.kv_sparse_config == cfg.to_json() != JSON, "start-up stored the normalised JSON"
    other = _with_config(oasis_args, OasisConfig(budget_tokens=32, block_size=4, dense_layers=(0,)).to_json())
    got = oasis_config(other)
    assert got is not cfg and got.budget_tokens == 32 and oasis_config(other) is got


@pytest.mark.parametrize("text,key", [('{"budget": 512}', "budget"), ('{"budget_tokens": 6, "block_size": 4}', "budget_tokens"),
                                      ('{"block_size": 3}', "block_size"), ('{"predictor": "oracle"}', "predictor"),
                                      ('{"budget_tokens": 16', "kv_sparse_config|JSON")])
def test_a_bad_stored_config_is_refused_naming_the_key(oasis_args, text, key):
    bad = _with_config(oasis_args, text)
    for _ in range(2):                                  # not cached: refused every time
        with pytest.raises(OasisConfigError, match=key):
            oasis_config(bad)
    assert oasis_config(oasis_args).budget_tokens == 16, "the good text still reads"


def test_a_config_given_as_a_dict_reads_like_its_json(oasis_args):
    """The Python API may hand ``kv_sparse_config`` over as a dict (breaker review: it was an
    unhashable-type error from the cache)."""
    from types import SimpleNamespace

    cfg = oasis_config(oasis_args)
    as_dict = SimpleNamespace(kv_sparse="oasis", kv_sparse_config=json.loads(cfg.to_json()))
    assert oasis_config(as_dict) == cfg
    with pytest.raises(OasisConfigError, match="budget_tokens"):
        oasis_config(SimpleNamespace(kv_sparse="oasis", kv_sparse_config={"budget_tokens": 6, "block_size": 4}))
