"""core/bench_hooks.py: BenchHooks, the benchmark / test switches, and OASIS_ABLATE (from_env).
(The effect of ``no-transfer`` on a running engine is in test_prefetch.)"""

import dataclasses
import logging

import pytest

from oasis_sglang.config import OasisConfigError
from oasis_sglang.core.bench_hooks import ABLATIONS, BenchHooks

OFF = dict(assume_predicted=False, skip_admission_copy=False, skip_prefetch=False, host_check_interval=0, churn=None)


@pytest.fixture(autouse=True)
def _no_churn_env(monkeypatch):
    monkeypatch.delenv("OASIS_CHURN", raising=False)      # (its own tests: test_churn.py)


def test_the_defaults_switch_nothing_on():
    assert dataclasses.asdict(BenchHooks()) == OFF
    assert ABLATIONS == ("no-transfer",)


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_ablation_is_serving(monkeypatch, caplog, value):
    if value is None:
        monkeypatch.delenv("OASIS_ABLATE", raising=False)
    else:
        monkeypatch.setenv("OASIS_ABLATE", value)
    with caplog.at_level(logging.WARNING, logger="oasis_sglang.core.bench_hooks"):
        h = BenchHooks.from_env()
    assert isinstance(h, BenchHooks) and dataclasses.asdict(h) == OFF
    assert not caplog.records, "nothing to warn about"


def test_no_transfer_skips_the_admission_copy_and_warns(monkeypatch, caplog):
    monkeypatch.setenv("OASIS_ABLATE", "no-transfer")
    with caplog.at_level(logging.WARNING, logger="oasis_sglang.core.bench_hooks"):
        h = BenchHooks.from_env()
    assert dataclasses.asdict(h) == dict(OFF, skip_admission_copy=True)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "OASIS_ABLATE=no-transfer" in caplog.text and "outputs are wrong" in caplog.text


@pytest.mark.parametrize("bad", ["no-copy", "No-Transfer", " no-transfer", "1"])
def test_an_unknown_ablation_is_refused_naming_the_variable_and_choices(monkeypatch, bad):
    monkeypatch.setenv("OASIS_ABLATE", bad)
    with pytest.raises(OasisConfigError, match=r"OASIS_ABLATE: unknown ablation .*choices: no-transfer") as e:
        BenchHooks.from_env()
    assert repr(bad) in str(e.value)
    assert isinstance(e.value, ValueError), "OasisConfigError is a ValueError (launch exits with the message)"


@pytest.mark.parametrize("bad", [dict(host_check_interval="x"), dict(host_check_interval=-3),
                                 dict(host_check_interval=True), dict(skip_prefetch=1), dict(assume_predicted="yes")])
def test_bad_switches_are_refused_naming_the_field(bad):
    """A switch of the wrong type would surface only at the next decode step, after its
    counters moved (breaker review): refused when the hooks are made."""
    with pytest.raises(OasisConfigError, match=next(iter(bad))):
        BenchHooks(**bad)
