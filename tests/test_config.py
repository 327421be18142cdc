import pytest

from oasis_sglang.config import OasisConfig, OasisConfigError


def test_defaults():
    c = OasisConfig()
    assert (c.budget_tokens, c.block_size, c.budget_blocks, c.dense_layers) == (2048, 16, 128, (0, 1))


def test_from_json_roundtrip():
    c = OasisConfig.from_json('{"budget_tokens": 512, "dense_layers": [3, 1], "fetch_cap": null}')
    assert c.budget_tokens == 512 and c.dense_layers == (1, 3) and c.fetch_cap is None
    assert OasisConfig.from_json(c.to_json()) == c


def test_frozen():
    with pytest.raises(Exception):
        OasisConfig().budget_tokens = 1


@pytest.mark.parametrize("text,key", [
    ('{"budget_tokenz": 512}', "budget_tokenz"),
    ('{"budget_tokens": 500}', "budget_tokens"),
    ('{"budget_tokens": 1099511627776}', "budget_tokens"),
    ('{"budget_tokens": 1' + "0" * 5000 + '}', "kv_sparse_config"),
    ('{"budget_tokens": "512"}', "budget_tokens"),
    ('{"budget_tokens": true}', "budget_tokens"),
    ('{"block_size": 12}', "block_size"),
    ('{"block_size": 0}', "block_size"),
    ('{"fetch_cap": 0}', "fetch_cap"),
    ('{"sink_blocks": -1}', "sink_blocks"),
    ('{"recent_blocks": 0}', "recent_blocks"),
    ('{"dense_layers": [0, 0]}', "dense_layers"),
    ('{"dense_layers": [-1]}', "dense_layers"),
    ('{"dense_layers": 3}', "dense_layers"),
    ('{"budget_tokens": 48, "sink_blocks": 1, "recent_blocks": 2}', "budget_tokens"),
    ('{"kernels": "cuda"}', "kernels"),
    ('{"kernels": null}', "kernels"),
    ('{"pd_read_mode": "async"}', "pd_read_mode"),
    ('{"pd_read_mode": null}', "pd_read_mode"),
    ('{"pd_host_slots": 0}', "pd_host_slots"),
    ('{"pd_host_slots": -5}', "pd_host_slots"),
    ('{"pd_host_slots": 2147483648}', "pd_host_slots"),
    ('{"pd_host_slots": 1.5}', "pd_host_slots"),
    ('{"pd_host_slots": "4096"}', "pd_host_slots"),
    ('{"pd_host_slots": true}', "pd_host_slots"),
    ('{"budget_tokens": 512, "budget_tokens": 1024}', "'budget_tokens' is given twice"),
    ('{"dense_layers": [-1]}', r"got \[-1\]"),
])
def test_bad_values_name_the_key(text, key):
    with pytest.raises(OasisConfigError, match=key):
        OasisConfig.from_json(text)


def test_not_json_or_not_object():
    with pytest.raises(OasisConfigError, match="not valid JSON"):
        OasisConfig.from_json("{budget: 1}")
    with pytest.raises(OasisConfigError, match="JSON object"):
        OasisConfig.from_json("[1, 2]")
    long = '{"budget_tokens": 1' + "0" * 5000 + "}"
    with pytest.raises(OasisConfigError, match=r"\(5020 characters\)") as e:
        OasisConfig.from_json(long)
    assert len(str(e.value)) < 600, "a long value is not echoed whole"
    with pytest.raises(OasisConfigError, match="kv_sparse_config is nested too deeply"):
        OasisConfig.from_json("[" * 100000 + "]" * 100000)


def test_check_model_layer_range():
    OasisConfig(dense_layers=(0, 29)).check_model(30)
    with pytest.raises(OasisConfigError, match="dense_layers"):
        OasisConfig(dense_layers=(30,)).check_model(30)


def test_kernel_backend_resolution():
    assert OasisConfig().kernel_backend("cuda") == "triton"
    assert OasisConfig().kernel_backend("cpu") == "torch"
    assert OasisConfig(kernels="torch").kernel_backend("cuda") == "torch"
    with pytest.raises(OasisConfigError, match="'kernels'.*cpu"):
        OasisConfig(kernels="triton").kernel_backend("cpu")


def test_pd_host_slots():
    assert OasisConfig().pd_host_slots is None
    c = OasisConfig.from_json('{"pd_host_slots": 4096}')
    assert c.pd_host_slots == 4096 and OasisConfig.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="pd_host_slots"):
        OasisConfig(pd_host_slots=0)
