"""Partial FC's idle rows caught up by one kernel a parameter: :mod:`shardfc.head.catch_up`'s
update on the GPU, where its torch form issues a dozen indexing and elementwise kernels per block
of rows and, for AdamW, ~200 passes over them.

* :func:`catch_up_sgd_kernel`: each row's ``(w, buf) ← Q[stamp]·(w, buf)`` (the 2×2 table entry
  gathered by the row's stamp, fp64 → fp32), one read and one write of the row and its momentum.
* :func:`catch_up_adamw_kernel`: one program a row iterates the row's own missed steps —
  ``min(gap, iterate)`` of them, a loop bound read from the row, not the worst row's — in
  registers, then the closed-form tail; the moments and the step count as the torch form has them.

Both round once to nearest into the storage dtype and stamp the row current.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from shardfc.head.fused import interpreting, shapes_only, tiles
from shardfc.head.fused.epilogue import beta_powers, step_bits
from shardfc.head.fused.traffic import gathered, note, rows_of


@triton.jit
def catch_up_sgd_kernel(
    p_ptr, buf_ptr, idx_ptr, stamps_ptr, table_ptr, now_ptr, n, D, stride_p, stride_b,
    HAS_IDX: tl.constexpr, MOMENTUM: tl.constexpr, EMULATE_RTNE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    """Rows ``idx[0 .. n)`` (every row: not ``HAS_IDX``) of ``p`` and ``buf`` brought to table entry
    ``now_ptr[0]`` (now, read on the device: a captured launch replays at any later step):
    ``table_ptr`` holds ``[entries, 2, 2]`` fp64, ``stamps_ptr`` each row's entry (int32)."""
    last = tl.load(now_ptr)
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_mask = offs_r < n
    row = offs_r.to(tl.int64)
    if HAS_IDX:
        row = tl.load(idx_ptr + offs_r, mask=r_mask, other=0).to(tl.int64)
    q = table_ptr + tl.load(stamps_ptr + row, mask=r_mask, other=0).to(tl.int64) * 4
    q00 = tl.load(q, mask=r_mask, other=1.0).to(tl.float32)[:, None]
    q01 = tl.load(q + 1, mask=r_mask, other=0.0).to(tl.float32)[:, None]
    q10 = tl.load(q + 2, mask=r_mask, other=0.0).to(tl.float32)[:, None]
    q11 = tl.load(q + 3, mask=r_mask, other=1.0).to(tl.float32)[:, None]
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask = r_mask[:, None] & (offs_d < D)[None, :]
        at_p = p_ptr + row[:, None] * stride_p + offs_d[None, :]
        w = tl.load(at_p, mask=mask, other=0.0).to(tl.float32)
        new_w = q00 * w
        if MOMENTUM:
            at_b = buf_ptr + row[:, None] * stride_b + offs_d[None, :]
            b = tl.load(at_b, mask=mask, other=0.0).to(tl.float32)
            new_w = new_w + q01 * b
            tl.store(at_b, tiles.stored(b * q11 + q10 * w, buf_ptr, EMULATE_RTNE), mask=mask)
        tl.store(at_p, tiles.stored(new_w, p_ptr, EMULATE_RTNE), mask=mask)
    tl.store(stamps_ptr + row, tl.full([BR], 0, tl.int32) + last, mask=r_mask)


@triton.jit
def catch_up_adamw_kernel(
    p_ptr, m_ptr, v_ptr, step_ptr, idx_ptr, stamps_ptr, table_ptr, D, stride_p, stride_m, stride_v, last, iterate,
    HAS_IDX: tl.constexpr, EMULATE_RTNE: tl.constexpr, BD: tl.constexpr,
):
    """Row ``idx[program]`` (or that row) of ``p``, its moments ``m``, ``v`` and fp64 step count,
    brought to table entry ``last``: the first ``iterate`` missed steps one by one (torch AdamW's
    arithmetic with a zero gradient, the bias corrections from the row's count in fp64), the rest
    as decay alone from the table's prefix sums of logs. Table rows: ``lr, wd, β1, β2, ε,
    Σ log(1 − lr·wd), Σ log β1, Σ log β2`` (fp64). One program a row, all of its ``D`` (a block at
    a time, each through the steps): the row's stamp and count are read and then written by it alone."""
    r = tl.program_id(0)
    row = r.to(tl.int64)
    if HAS_IDX:
        row = tl.load(idx_ptr + r).to(tl.int64)
    start = tl.load(stamps_ptr + row).to(tl.int64)
    t0 = tl.load(step_ptr + row)
    gap = last - start
    steps = tl.minimum(gap, iterate)
    tail = table_ptr + tl.minimum(start + iterate, last) * 8
    now = table_ptr + last * 8
    decay_tail = tl.exp(tl.load(now + 5) - tl.load(tail + 5)).to(tl.float32)
    beta1_tail = tl.exp(tl.load(now + 6) - tl.load(tail + 6)).to(tl.float32)
    beta2_tail = tl.exp(tl.load(now + 7) - tl.load(tail + 7)).to(tl.float32)
    bits = step_bits(t0 + steps.to(tl.float64))  # the largest count the steps below reach
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask = offs_d < D
        at_p = p_ptr + row * stride_p + offs_d
        at_m = m_ptr + row * stride_m + offs_d
        at_v = v_ptr + row * stride_v + offs_d
        w = tl.load(at_p, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(at_m, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(at_v, mask=mask, other=0.0).to(tl.float32)
        for i in range(1, steps + 1):  # this row's own missed steps, no more
            e = table_ptr + (start + i) * 8
            lr = tl.load(e)
            b1 = tl.load(e + 2)
            b2 = tl.load(e + 3)
            pow1, pow2 = beta_powers(b1, b2, t0 + i, bits)
            decay = (1.0 - lr * tl.load(e + 1)).to(tl.float32)
            step_size = (lr / (1.0 - pow1)).to(tl.float32)
            bias2_sqrt = tl.sqrt(1.0 - pow2).to(tl.float32)
            weight = (1.0 - b1).to(tl.float32)
            # torch's lerp toward a zero gradient: start + weight·(end − start), or from the end past 0.5
            m = tl.where(weight < 0.5, m + weight * (0.0 - m), m * (1.0 - weight))
            v = v * b2.to(tl.float32)
            denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + tl.load(e + 4).to(tl.float32)
            w = w * decay - tl.div_rn(step_size * m, denom)
        tl.store(at_p, tiles.stored(w * decay_tail, p_ptr, EMULATE_RTNE), mask=mask)
        tl.store(at_m, tiles.stored(m * beta1_tail, m_ptr, EMULATE_RTNE), mask=mask)
        tl.store(at_v, tiles.stored(v * beta2_tail, v_ptr, EMULATE_RTNE), mask=mask)
    tl.store(stamps_ptr + row, (last + start * 0).to(tl.int32))
    tl.store(step_ptr + row, t0 + gap.to(tl.float64))


def _emulate(t: Tensor) -> bool:
    return interpreting() and t.dtype == torch.bfloat16


def catch_up_sgd_(p: Tensor, buf: Optional[Tensor], rows: Optional[Tensor], stamps: Tensor, table: Tensor,
                  now: Tensor) -> None:
    """:class:`~shardfc.head.catch_up.SGDClock`'s catch-up of ``rows`` (None: every row) in one
    launch, to entry ``now`` (int32, one element, on the device)."""
    n = p.shape[0] if rows is None else rows.numel()
    if n and shapes_only(p):  # meta: what it would touch (shardfc plan --bytes), nothing launched
        state = [gathered(t, rows, 0, n) for t in (p, buf) if t is not None]
        note("catch_up_sgd", state + rows_of(rows, 0, n), state)
    if n == 0 or shapes_only(p):
        return
    BR, BD = (16, 16) if interpreting() else (32, 128)
    with torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext():
        catch_up_sgd_kernel[(triton.cdiv(n, BR),)](
            p, buf if buf is not None else p, rows if rows is not None else stamps, stamps, table, now, n, p.shape[1],
            p.stride(0), buf.stride(0) if buf is not None else 0,
            HAS_IDX=rows is not None, MOMENTUM=buf is not None, EMULATE_RTNE=_emulate(p), BR=BR, BD=BD,
        )


def catch_up_adamw_(p: Tensor, m: Tensor, v: Tensor, step: Tensor, rows: Optional[Tensor], stamps: Tensor,
                    table: Tensor, last: int, iterate: int) -> None:
    """:class:`~shardfc.head.catch_up.AdamWClock`'s catch-up of ``rows`` (None: every row) in one launch."""
    n = p.shape[0] if rows is None else rows.numel()
    if n and shapes_only(p):
        state = [gathered(t, rows, 0, n) for t in (p, m, v)]
        note("catch_up_adamw", state + rows_of(rows, 0, n), state)
    if n == 0 or shapes_only(p):
        return
    D = p.shape[1]
    BD = 16 if interpreting() else min(512, triton.next_power_of_2(D))
    with torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext():
        catch_up_adamw_kernel[(n,)](
            p, m, v, step, rows if rows is not None else stamps, stamps, table, D,
            p.stride(0), m.stride(0), v.stride(0), last, min(iterate, last),
            HAS_IDX=rows is not None, EMULATE_RTNE=_emulate(p), BD=BD,
        )


__all__ = ["catch_up_sgd_kernel", "catch_up_adamw_kernel", "catch_up_sgd_", "catch_up_adamw_"]
