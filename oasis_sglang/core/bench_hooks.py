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
        churn: a churn profile to replay (``core/churn.py``; ``OASIS_CHURN``): per sparse layer
            the wanted blocks not resident per step and KV head measured on real text,
            stretched to this model's sparse layers; ``None``: the prediction as it is. The
            predicted lists are rewritten to miss that many resident blocks (speed only).
    """

    assume_predicted: bool = False
    skip_admission_copy: bool = False
    skip_prefetch: bool = False
    host_check_interval: int = 0
    churn: tuple[float, ...] | None = None

    def churn_mean(self, layer: int, num_layers: int) -> float | None:
        """The replayed churn of sparse layer ``layer`` of ``num_layers`` (``None``: no replay)."""
        if self.churn is None:
            return None
        from .churn import resample

        return resample(self.churn, num_layers)[layer]

    def __post_init__(self):
        for name in ("assume_predicted", "skip_admission_copy", "skip_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise OasisConfigError(f"BenchHooks: {name} must be true or false, got {getattr(self, name)!r}")
        k = self.host_check_interval
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise OasisConfigError(f"BenchHooks: host_check_interval must be an integer >= 0 (0: never), got {k!r}")
        c = self.churn
        if c is not None:
            import math

            if not isinstance(c, (tuple, list)) or not c or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in c):
                raise OasisConfigError(f"BenchHooks: churn must be a non-empty list of per-layer means >= 0, got {c!r}")
            self.churn = tuple(float(x) for x in c)

    @classmethod
    def from_env(cls) -> "BenchHooks":
        """``OASIS_ABLATE`` (unset, empty or ``no-transfer``) and ``OASIS_CHURN`` (a churn
        profile file, ``core.churn.load_profile``) as hooks; logs a warning when either is set.

        Raises:
            OasisConfigError: an unknown ``OASIS_ABLATE`` value, naming the choices; an
                ``OASIS_CHURN`` file that cannot be read as a profile.
        """
        churn = None
        path = os.environ.get("OASIS_CHURN", "")
        if path:
            from .churn import load_profile

            try:
                churn = load_profile(path)
            except (OSError, ValueError) as e:
                raise OasisConfigError(f"OASIS_CHURN: {e}") from None
            logger.warning("OasisKV: OASIS_CHURN=%s: predictions rewritten to replay %.2f wanted blocks not resident "
                           "per step and KV head on average (a benchmark mode: outputs are wrong)", path,
                           sum(churn) / len(churn))
        ablate = os.environ.get("OASIS_ABLATE", "")
        if ablate not in ("",) + ABLATIONS:
            raise OasisConfigError(f"OASIS_ABLATE: unknown ablation {ablate!r} (choices: {', '.join(ABLATIONS)}, "
                                   "or unset)")
        if ablate == "no-transfer":
            logger.warning("OasisKV: OASIS_ABLATE=no-transfer: admitted blocks are NOT copied from the host tier "
                           "(a speed ablation for benchmarks: outputs are wrong)")
        return cls(skip_admission_copy=ablate == "no-transfer", churn=churn)
