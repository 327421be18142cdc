"""BenchHooks: benchmark and test switches of the engine. Never set in normal serving.

Kept out of ``OasisSparseKV``'s constructor so the serving path has no knobs that make its
output wrong; a benchmark or test sets them on ``engine.bench`` after construction, and the
SGLang glue applies ``BenchHooks.from_env()`` (the one switch a served benchmark can reach).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..config import OasisConfigError

logger = logging.getLogger(__name__)

ABLATIONS = ("no-transfer",)


@dataclass
class BenchHooks:
    """Switches read by ``OasisSparseKV``.

    Attributes:
        assume_predicted: every row counts as predicted for its context, so no step selects
            synchronously (``scripts/bench_pipeline.py`` times the replayed path eagerly).
        skip_admission_copy: admissions are planned and counted but not copied from the host
            tier (``OASIS_ABLATE=no-transfer``, ``bench_oasis --suite stall``): the step's
            exposed transfer cost is the difference to a normal run. Outputs are wrong.
        skip_prefetch: the next step's predict / select / transfer stages are not issued
            (``bench_pipeline`` ``no-prefetch``: the floor the prefetch's cost is measured
            against). The working set goes stale.
        host_check_interval: every this many decode steps, the host decision "every row was
            predicted" is also checked against the device record (a host read); 0 = never
            (the record is compared whole at every report instead).
    """

    assume_predicted: bool = False
    skip_admission_copy: bool = False
    skip_prefetch: bool = False
    host_check_interval: int = 0

    def __post_init__(self):
        for name in ("assume_predicted", "skip_admission_copy", "skip_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise OasisConfigError(f"BenchHooks: {name} must be true or false, got {getattr(self, name)!r}")
        k = self.host_check_interval
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise OasisConfigError(f"BenchHooks: host_check_interval must be an integer >= 0 (0: never), got {k!r}")

    @classmethod
    def from_env(cls) -> "BenchHooks":
        """``OASIS_ABLATE`` (unset, empty or ``no-transfer``) as hooks; logs a warning when set.

        Raises:
            OasisConfigError: an unknown ``OASIS_ABLATE`` value, naming the choices.
        """
        ablate = os.environ.get("OASIS_ABLATE", "")
        if ablate not in ("",) + ABLATIONS:
            raise OasisConfigError(f"OASIS_ABLATE: unknown ablation {ablate!r} (choices: {', '.join(ABLATIONS)}, "
                                   "or unset)")
        if ablate == "no-transfer":
            logger.warning("OasisKV: OASIS_ABLATE=no-transfer: admitted blocks are NOT copied from the host tier "
                           "(a speed ablation for benchmarks: outputs are wrong)")
        return cls(skip_admission_copy=ablate == "no-transfer")
