"""OasisKV Prometheus metrics, beside SGLang's own (``--enable-metrics``, served at ``/metrics``).

Created in the scheduler process after SGLang set ``PROMETHEUS_MULTIPROC_DIR`` (as SGLang's
``observability/metrics_collector.py`` does), and updated at each ``OasisKV decode`` log line
(every ``--decode-log-interval`` steps) from ``OasisSparseKV.residency()``:

==========================================  =======  ===================================================
name                                        type     meaning
==========================================  =======  ===================================================
sglang:oasis_hit_rate                       gauge    wanted blocks already resident / (hits + admitted)
sglang:oasis_hit_blocks_total               counter  (KV head, block) pieces found resident
sglang:oasis_admitted_blocks_total          counter  pieces copied host -> device
sglang:oasis_evicted_blocks_total           counter  admissions that evicted a resident block
sglang:oasis_h2d_bytes_total                counter  bytes host -> device (admissions)
sglang:oasis_d2h_bytes_total                counter  bytes device -> host (completed blocks written back)
sglang:oasis_sync_steps_total               counter  steps selected synchronously (rows not predicted)
sglang:oasis_decode_steps_total             counter  decode steps (sparse layers) since start-up
sglang:oasis_graph_steps_total              counter  of those, replayed from a CUDA graph
sglang:oasis_dense_steps_total              counter  of those, on the dense path for short contexts
sglang:oasis_exposed_wait_seconds           gauge    compute-stream stall on transfers, last step
sglang:oasis_agreement                      gauge    measure_agreement: mean per-layer agreement
sglang:oasis_agreement_min_layer            gauge    measure_agreement: lowest layer's agreement
sglang:oasis_draft_match_rate               gauge    with a draft: drafts equal to the target's next token
==========================================  =======  ===================================================
"""

from __future__ import annotations

COUNTERS = ("hit_blocks", "admitted_blocks", "evicted_blocks", "bytes_h2d", "bytes_d2h", "sync_steps",
            "decode_steps", "graph_steps", "dense_steps")
_NAMES = {"hit_blocks": "hit_blocks", "admitted_blocks": "admitted_blocks", "evicted_blocks": "evicted_blocks",
          "bytes_h2d": "h2d_bytes", "bytes_d2h": "d2h_bytes", "sync_steps": "sync_steps",
          "decode_steps": "decode_steps", "graph_steps": "graph_steps", "dense_steps": "dense_steps"}


class OasisMetrics:
    """Prometheus instruments of one scheduler process.

    Args:
        labels: the label values (SGLang uses ``model_name`` and others).
    """

    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Counter, Gauge

        names = list(labels)
        self.labels = labels
        self._last = {k: 0 for k in COUNTERS}
        self.counters = {k: Counter(f"sglang:oasis_{_NAMES[k]}", f"OasisKV {k.replace('_', ' ')}", names)
                         for k in COUNTERS}
        g = lambda n, doc: Gauge(f"sglang:oasis_{n}", doc, names, multiprocess_mode="mostrecent")  # noqa: E731
        self.hit_rate = g("hit_rate", "OasisKV: wanted blocks already resident / (hits + admitted)")
        self.wait = g("exposed_wait_seconds", "OasisKV: compute-stream stall on transfers in the last step")
        self.agreement = g("agreement", "OasisKV: mean per-layer agreement of the prediction (measure_agreement)")
        self.agreement_min = g("agreement_min_layer", "OasisKV: lowest per-layer agreement (measure_agreement)")
        self.draft_match = g("draft_match_rate", "OasisKV: drafts equal to the target's next token / drafts")
        for c in self.counters.values():        # create the labelled series now, so they show as 0
            c.labels(**labels)

    def update(self, r: dict) -> None:
        """Publish a ``residency()`` snapshot (counters advance by the change since the last one)."""
        for k in COUNTERS:
            delta = r[k] - self._last[k]
            if delta > 0:
                self.counters[k].labels(**self.labels).inc(delta)
            self._last[k] = r[k]
        hits, adm = r["hit_blocks"], r["admitted_blocks"]
        self.hit_rate.labels(**self.labels).set(hits / max(1, hits + adm))
        self.wait.labels(**self.labels).set(sum(r["exposed_wait_ms"]) / 1e3)
        ag = [x for x in (r.get("agreement") or []) if x is not None]
        if ag:
            self.agreement.labels(**self.labels).set(sum(ag) / len(ag))
            self.agreement_min.labels(**self.labels).set(min(ag))
        dm = r.get("draft_match")
        if dm and dm[1]:
            self.draft_match.labels(**self.labels).set(dm[0] / dm[1])


def make_metrics(server_args) -> OasisMetrics | None:
    """The instruments when ``--enable-metrics`` is on, else ``None``."""
    if not getattr(server_args, "enable_metrics", False):
        return None
    name = getattr(server_args, "served_model_name", None) or server_args.model_path
    return OasisMetrics({"model_name": str(name)})
