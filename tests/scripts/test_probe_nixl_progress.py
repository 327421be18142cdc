"""scripts/probe_nixl_progress.py: two real NIXL agents over UCX loopback; bad options are refused
naming them, and with the 100 us pause the idle agents stay far below a core."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "probe_nixl_progress.py"


def run(*argv):
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=180,
                          cwd=SCRIPT.parents[1], env=env)


@pytest.mark.parametrize("argv,msg", [(["--delay-us", "-1"], "--delay-us"), (["--idle-s", "0"], "--idle-s"),
                                      (["--reads", "0"], "--reads"), (["--delay-us", "x"], "--delay-us")])
def test_bad_options_are_refused_naming_them(argv, msg):
    r = run(*argv)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_idle_agents_with_the_pause_use_little_cpu_and_a_read_lands():
    pytest.importorskip("nixl")
    r = run("--delay-us", "100", "--idle-s", "1.5", "--reads", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    cpu = float(re.search(r"two idle agents, pause 100 us: ([\d.]+) CPU s in 1.5 s", r.stdout).group(1))
    assert cpu < 0.5, r.stdout
    assert "bytes equal: True" in r.stdout
