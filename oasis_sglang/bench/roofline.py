"""The HBM bytes a decode step has to read, and the bandwidth a measured step reached.

Decode is HBM-bound: a step reads every weight once and, for attention, the KV cache it attends
over. Dividing those bytes by the measured step time says what fraction of the GPU's peak
bandwidth a run reached. ``bench_oasis`` prints the figures for every run
(``docs/benchmarks/2026-12-06_h100-sweep-fold-roofline.md`` has the analysis).

The bytes are a lower bound for a dense decoder (Llama / Qwen3 style, ``config.json``):

* weights: every linear layer and the LM head once (the embedding table's rows are gathered,
  not read whole);
* dense SGLang: every layer's K and V of every running request's whole context;
* OasisKV: the sparse layers' working sets (``min(budget, context)`` tokens per request, layer
  and KV head), the dense layers' whole context, and the key summaries (min and max per block and
  KV head), which the scoring reads whole every step. A step whose context fits the working set
  runs the dense path (``dense_short_contexts``) and reads no summaries.

Not counted: activations, the selection's own tables, the admissions' copies into HBM, the
write-back, and a speculative draft model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

# peak HBM bandwidth, TB/s (vendor data sheets), by a substring of ``nvidia-smi``'s GPU name; the
# first match wins
PEAK_HBM_TB_S = (
    ("H200", 4.8),
    ("H100 80GB HBM3", 3.35),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
)


def peak_hbm_tb_s(gpu_name: str) -> float | None:
    """Peak HBM bandwidth in TB/s of a GPU by its ``nvidia-smi`` name, or ``None`` when unknown."""
    for key, tb_s in PEAK_HBM_TB_S:
        if key in gpu_name:
            return tb_s
    return None


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense decoder that set its decode step's bytes (``config.json`` names).

    Attributes:
        layers, hidden, intermediate, vocab: ``num_hidden_layers``, ``hidden_size``,
            ``intermediate_size``, ``vocab_size``.
        q_heads, kv_heads, head_dim: attention heads, KV heads, dimension per head.
    """

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, model: str | os.PathLike) -> "ModelShape | None":
        """The shape from ``model/config.json``, or ``None`` when it cannot be read or lacks a size
        (e.g. a mixture-of-experts model, whose step does not read every expert)."""
        try:
            c = json.loads((Path(model) / "config.json").read_text())
            if any(k in c for k in ("num_experts", "num_local_experts", "n_routed_experts")):
                return None
            q = int(c["num_attention_heads"])
            return cls(int(c["num_hidden_layers"]), int(c["hidden_size"]), int(c["intermediate_size"]),
                       int(c["vocab_size"]), q, int(c.get("num_key_value_heads", q)),
                       int(c.get("head_dim") or c["hidden_size"] // q))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of the weights one decode step reads: q/k/v/o, the gated MLP (gate, up, down) of
        every layer, and the LM head."""
        attn = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return (self.layers * (attn + mlp) + self.vocab * self.hidden) * dtype_bytes


def step_hbm_bytes(shape: ModelShape, system: str, running: int, context: int, *, kv_bytes: int = 2,
                   weight_bytes: int = 2, budget: int = 2048, block: int = 16, dense_layers: int = 2,
                   summary_bytes: int = 2) -> dict[str, int]:
    """The HBM bytes of one decode step by what reads them.

    Args:
        shape: the model. system: ``"dense"`` (SGLang's own KV cache) or an OasisKV system
            (any other name). running: requests in the batch. context: tokens per request.
        kv_bytes: bytes per KV element (2 bf16, 1 fp8). weight_bytes: bytes per weight.
        budget, block, dense_layers: OasisKV's ``budget_tokens``, ``block_size`` and the number
            of ``dense_layers``. summary_bytes: bytes per summary element.
    Returns:
        ``{"weights", "kv", "working_sets", "dense_layers", "summaries", "total"}`` in bytes
        (``kv`` is dense SGLang's whole KV cache; the three OasisKV parts are 0 for dense).
    Raises:
        ValueError: a negative count, or ``dense_layers`` above the model's layers.
    """
    if min(running, context, budget, block, dense_layers) < 0 or block == 0:
        raise ValueError(f"step_hbm_bytes: running {running}, context {context}, budget {budget}, block {block}, "
                         f"dense_layers {dense_layers}: want counts >= 0 and a block of at least 1 token")
    if dense_layers > shape.layers:
        raise ValueError(f"step_hbm_bytes: dense_layers {dense_layers} > the model's {shape.layers} layers")
    per_token = shape.kv_heads * shape.head_dim * 2 * kv_bytes          # K and V of one layer
    out = {"weights": shape.weight_bytes(weight_bytes), "kv": 0, "working_sets": 0, "dense_layers": 0,
           "summaries": 0}
    if system == "dense":
        out["kv"] = running * shape.layers * context * per_token
    else:
        sparse = shape.layers - dense_layers
        out["working_sets"] = running * sparse * min(budget, context) * per_token
        out["dense_layers"] = running * dense_layers * context * per_token
        if context + 1 > budget:              # the dense path (the context fits) scores nothing
            blocks = math.ceil(context / block)
            out["summaries"] = running * sparse * shape.kv_heads * blocks * 2 * shape.head_dim * summary_bytes
    out["total"] = sum(out.values())
    return out


def reached(total_bytes: int, step_ms: float, gpu_name: str) -> tuple[float, float | None]:
    """``(TB/s, fraction of the GPU's peak or None)`` of ``total_bytes`` (bytes) read in one step
    of ``step_ms`` milliseconds.

    Raises:
        ValueError: a step time that is not a positive number of milliseconds.
    """
    if not step_ms > 0:
        raise ValueError(f"reached: step_ms {step_ms!r}: want a positive step time in milliseconds")
    tb_s = total_bytes / (step_ms * 1e-3) / 1e12
    peak = peak_hbm_tb_s(gpu_name)
    return tb_s, None if peak is None else tb_s / peak
