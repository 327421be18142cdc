"""scripts/bench_pipeline.py refuses bad options before it builds anything (on a GPU host the
build pins the host tier and prefills every layer first), naming the option."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_pipeline.py"


@pytest.mark.parametrize("argv,msg", [
    (["--predictors", "bogus"], "--predictors"), (["--steps", "0"], "--steps"), (["--context", "-5"], "--context"),
    (["--device", "xyz"], "--device"), (["--drift", "nan"], "--drift"), (["--layers", "0"], "--layers"),
    (["--budget", "100"], "--budget"), (["--copy-programs", "-3"], "--copy-programs"),
])
def test_bad_options_are_refused_naming_them(argv, msg):
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}       # this checkout's package, installed or not
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *argv], capture_output=True, text=True,
                       timeout=120, cwd=SCRIPT.parents[1], env=env)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
