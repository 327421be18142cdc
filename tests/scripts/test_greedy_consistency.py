"""scripts/greedy_consistency.py's comparison and argument handling (its servers run on the GPU
host: scripts/gpu_smoke.sh)."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import greedy_consistency as gc  # noqa: E402


def test_first_difference_finds_the_first_differing_token_or_a_prefix():
    assert gc.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert gc.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert gc.first_difference([1, 2], [1, 2, 3]) == 2
    assert gc.first_difference([], [7]) == 0


def test_a_variant_is_parsed_into_variables_and_a_malformed_one_is_refused():
    assert gc.variant("OASIS_SPEC_OVERLAP=1,X=a=b") == {"OASIS_SPEC_OVERLAP": "1", "X": "a=b"}
    assert gc.variant("") == {}
    with pytest.raises(argparse.ArgumentTypeError, match="'OASIS_SPEC_OVERLAP' is not NAME=VALUE"):
        gc.variant("OASIS_SPEC_OVERLAP")


def test_prompts_are_reproducible_and_inside_the_vocabulary():
    a, b = gc.prompts(3, 50, 1000, seed=4), gc.prompts(3, 50, 1000, seed=4)
    assert a == b and len(a) == 3 and all(len(p) == 50 for p in a)
    assert all(100 <= t < 1000 for p in a for t in p)
    assert gc.prompts(1, 50, 1000, seed=5) != a[:1]


def test_one_variant_or_no_model_path_is_refused_before_any_server_starts(monkeypatch, capsys):
    monkeypatch.setenv("M", "/nonexistent")
    with pytest.raises(SystemExit) as e:
        gc.main(["--variant", "OASIS_SPEC_OVERLAP=1"])
    assert e.value.code == 2 and "at least two" in capsys.readouterr().err
    monkeypatch.delenv("M")
    with pytest.raises(SystemExit) as e:
        gc.main(["--variant", "A=0", "--variant", "A=1"])
    assert e.value.code == 2 and "set M" in capsys.readouterr().err


def test_logprob_difference_counts_a_one_sided_nan_or_missing_value_wherever_it_falls():
    nan = float("nan")
    assert gc.logprob_difference([-0.5, nan, -0.1], [-0.5, -0.7, -0.1]) == float("inf")
    assert gc.logprob_difference([-0.5, -0.7, nan], [-0.5, -0.7, -0.1]) == float("inf")
    assert gc.logprob_difference([nan, -0.1], [nan, -0.1]) == 0.0
    assert gc.logprob_difference([None, -0.2], [-0.1, -0.2]) == float("inf")
    assert gc.logprob_difference([None], [None]) == 0.0 and gc.logprob_difference([], [-1.0]) == 0.0
    assert gc.logprob_difference([-0.5, -0.1], [-0.5, -0.1 - 1e-7]) > 0


class _Srv:
    url = "http://fake"

    def log(self):
        return "OasisKV decode: #running-req: 1\n"

    def stop(self):
        pass


def _run(monkeypatch, tmp_path, outputs, *extra):
    """main() with the server start and the requests replaced: ``outputs[variant]`` is what the
    variant's server answers to every prompt (ids, log-probabilities), or an exception."""
    import json

    import oasis_sglang.testing.launch as launch

    monkeypatch.setenv("M", "/m")
    monkeypatch.setenv("D", "/d")
    monkeypatch.delenv("X", raising=False)
    monkeypatch.setattr(launch, "launch", lambda *a, **k: _Srv())

    def greedy(url, ids, n, timeout):
        o = outputs[int(gc.os.environ["X"])]
        if isinstance(o, Exception):
            raise o
        return o
    monkeypatch.setattr(gc, "greedy", greedy)
    rc = gc.main(["--variant", "X=0", "--variant", "X=1", "--prompts", "2", "--input-len", "16",
                  "--out", str(tmp_path), *extra])
    return rc, json.loads((tmp_path / "greedy.json").read_text())


def test_exit_status_says_same_different_or_failed_and_the_outputs_are_kept(monkeypatch, tmp_path, capsys):
    same = ([5, 6, 5], [-0.5, -0.2, -0.1])
    rc, j = _run(monkeypatch, tmp_path, [same, same])
    assert rc == 0 and j["first_difference"] == [[None, None]] and j["max_logprob_diff"] == [0.0]
    assert "SAME tokens, same log-probabilities" in capsys.readouterr().out
    rc, j = _run(monkeypatch, tmp_path, [same, ([5, 6, 5], [-0.5, -0.2, -0.1000001])])
    assert rc == 1 and "SAME tokens, DIFFERENT log-probabilities" in capsys.readouterr().out
    rc, j = _run(monkeypatch, tmp_path, [same, ([5, 7, 5], [-0.5, -0.3, -0.1])])
    assert rc == 1 and j["first_difference"] == [[1, 1]] and "DIFFERENT tokens" in capsys.readouterr().out
    rc, j = _run(monkeypatch, tmp_path, [same, RuntimeError("HTTP 500")])
    assert rc == 3 and j["variants"][0]["ids"] == [same[0], same[0]] and "HTTP 500" in j["variants"][1]["error"]


def test_a_lookahead_without_a_draft_and_a_missing_draft_path_are_refused_before_any_server(monkeypatch, capsys):
    monkeypatch.setenv("M", "/m")
    with pytest.raises(SystemExit) as e:
        gc.main(["--system", "oasis", "--predictor", "lookahead", "--variant", "A=0", "--variant", "A=1"])
    assert e.value.code == 2 and "needs a draft model" in capsys.readouterr().err
    monkeypatch.delenv("D", raising=False)
    with pytest.raises(SystemExit) as e:
        gc.main(["--system", "oasis-eagle3", "--variant", "A=0", "--variant", "A=1"])
    assert e.value.code == 2 and "set D" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        gc.variant("=1")
    assert gc.variant(" A = 1 ") == {"A": "1"}
