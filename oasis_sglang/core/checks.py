"""Argument checks of the engine's decode-step calls (``OasisSparseKV.begin_decode_step`` /
``decode_attention``): each raises a ``ValueError`` naming the argument, before the engine
changes any state. Metadata (shapes, dtypes, host integers) only: nothing here reads device
memory.
"""

from __future__ import annotations

import operator

import torch


def as_int(x, name: str, what: str) -> int:
    """``x`` as an int (anything with ``__index__`` but a bool). Raises ValueError naming ``name``."""
    if isinstance(x, bool):
        raise ValueError(f"{what}: {name} {x!r}: want an integer")
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{what}: {name} {x!r}: want an integer") from None


def host_lists(rows_host, seq_lens_host, what: str, num_rows: int, width: int | None) -> tuple[list[int], list[int]]:
    """``(rows, seq_lens)`` as int lists of one length: rows in ``0 .. num_rows - 1``, lengths in
    ``1 .. width`` (``req_to_token``'s width, when known).

    Raises:
        ValueError: not lists / tuples of integers, different lengths or out-of-range values,
            naming ``what`` and the argument.
    """
    for name, xs in (("rows_host", rows_host), ("seq_lens_host", seq_lens_host)):
        if not isinstance(xs, (list, tuple)):
            raise ValueError(f"{what}: {name} must be a list of integers, got {type(xs).__name__}")
    rows_l = [as_int(r, "rows_host entry", what) for r in rows_host]
    seq_l = [as_int(x, "seq_lens_host entry", what) for x in seq_lens_host]
    if len(rows_l) != len(seq_l):
        raise ValueError(f"{what}: {len(rows_l)} rows but {len(seq_l)} lengths")
    hi = width if width is not None else float("inf")
    if rows_l and (min(rows_l) < 0 or max(rows_l) >= num_rows or min(seq_l) < 1 or max(seq_l) > hi):
        raise ValueError(f"{what}: rows_host {rows_l[:8]} / seq_lens_host {seq_l[:8]}: want rows in 0 .. {num_rows - 1} "
                         f"and context lengths in 1 .. {width} (the new token included)")
    return rows_l, seq_l


def check_table(req_to_token, what: str) -> int:
    """``req_to_token``'s width (tokens a row can hold). Raises ValueError unless a 2-D integer tensor."""
    if not (isinstance(req_to_token, torch.Tensor) and req_to_token.dim() == 2
            and not req_to_token.dtype.is_floating_point and req_to_token.dtype != torch.bool):
        shape = tuple(req_to_token.shape) if isinstance(req_to_token, torch.Tensor) else type(req_to_token).__name__
        raise ValueError(f"{what}: req_to_token {shape}: want SGLang's [rows, max_len] integer table")
    return req_to_token.shape[1]


def check_batch(rows, seq_lens, what: str) -> int:
    """The batch size of ``rows [B]`` and ``seq_lens [B]`` (1-D integer tensors of one length)."""
    for name, x in (("rows", rows), ("seq_lens", seq_lens)):
        if not (isinstance(x, torch.Tensor) and x.dim() == 1 and not x.dtype.is_floating_point
                and x.dtype != torch.bool and not x.dtype.is_complex):
            shape = (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{what}: {name} {shape}: want a 1-D integer tensor [B]")
    if rows.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"{what}: rows has {rows.shape[0]} entries but seq_lens {seq_lens.shape[0]}")
    return rows.shape[0]


def check_rows(x, want: tuple[int, int, int], name: str) -> None:
    """``x`` is ``[B, H, D]`` (or ``[B, H*D]``) of ``want``. Raises ValueError naming ``name``."""
    B, H, D = want
    if not (isinstance(x, torch.Tensor) and (tuple(x.shape) == want or tuple(x.shape) == (B, H * D))):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"decode_attention: {name} has shape {shape}, expected {want}")
