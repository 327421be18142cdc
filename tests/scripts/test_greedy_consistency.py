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
