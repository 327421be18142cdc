"""scripts/bench_discard.py gives a request's blocks back on a real on-demand host tier: every
case leaves nothing resident, and the ``written`` mask cuts the ``madvise`` calls of scattered
blocks to about the runs holding a read piece (the timing itself is the script's business)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_discard  # noqa: E402


def test_small_tier_every_case_gives_everything_back_and_the_mask_cuts_calls(tmp_path):
    out = tmp_path / "d.json"
    assert bench_discard.main(["--tokens", "512", "--pages", "256", "--layers", "2", "--kv-heads", "2",
                               "--fractions", "0.25", "1.0", "--repeat", "1", "--out", str(out)]) == 0
    rows = {(r["layout"], r["fraction"], r["mask"]): r for r in json.loads(out.read_text())["results"]}
    assert len(rows) == 8 and all(r["variant"] == ("yes" if m else "no") for (_, _, m), r in rows.items())
    assert all(r["resident_after_mib"] == 0 and r["resident_before_mib"] > 0 for r in rows.values())
    full = rows["scattered", 0.25, False]["madvise_calls"]
    assert rows["scattered", 1.0, True]["madvise_calls"] == rows["scattered", 1.0, False]["madvise_calls"] == full
    assert rows["scattered", 0.25, True]["madvise_calls"] < 0.5 * full
    assert rows["consecutive", 0.25, True]["madvise_calls"] == rows["consecutive", 0.25, False]["madvise_calls"]


def test_a_baseline_revision_is_timed_beside_and_a_bad_one_is_named(tmp_path):
    """--baseline REV loads host_tier.py of that revision (here the one before the mask) and
    times it the same way: it gives everything back and makes as many calls as no mask."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if subprocess.run(["git", "-C", str(root), "cat-file", "-e", "63b14b5^{commit}"], capture_output=True).returncode:
        pytest.skip("a clone without 63b14b5 (shallow)")
    out = tmp_path / "d.json"
    assert bench_discard.main(["--tokens", "256", "--pages", "128", "--layers", "1", "--kv-heads", "2",
                               "--fractions", "0.5", "--layouts", "scattered", "--repeat", "1",
                               "--baseline", "63b14b5", "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"baseline", "no", "yes"} and rows["baseline"]["resident_after_mib"] == 0
    assert rows["baseline"]["madvise_calls"] == rows["no"]["madvise_calls"] > rows["yes"]["madvise_calls"]
    with pytest.raises(SystemExit, match="--baseline no-such-rev"):
        bench_discard.main(["--tokens", "256", "--pages", "128", "--baseline", "no-such-rev"])


@pytest.mark.parametrize("bad", [["--fractions", "1.5"], ["--tokens", "0"], ["--repeat", "0"]])
def test_bad_arguments_are_refused_by_name(bad, capsys):
    with pytest.raises(SystemExit) as e:
        bench_discard.main(bad)
    assert e.value.code == 2
    name = bad[0]
    assert name in capsys.readouterr().err
