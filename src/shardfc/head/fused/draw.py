"""Partial FC's draw in one kernel: :func:`shardfc.head.sampling.draw_keys` on the GPU.

The torch form of the counter-based draw spends about forty elementwise int64 passes over a
shard's classes (each 32-bit multiply emulated in two halves so that int64 never overflows):
at a million classes a few hundred microseconds of a Partial FC step. Here one program a block of
rows computes the same keys in registers with uint32 arithmetic, which wraps as the hash needs,
and writes each key once: ``n·9`` bytes (the ``present`` byte read, the int64 key written).
"""

from __future__ import annotations

import contextlib
from typing import Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from shardfc.head.fused import shapes_only
from shardfc.head.fused.traffic import note, span

#: Rows a program keys (4 warps).
DRAW_BLOCK = 1024


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 words (the multiplies wrap mod 2**32; ``>>`` is logical on uint32)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def draw_keys_kernel(present_ptr, keys_ptr, step_ptr, n, s1, s2, BLOCK: tl.constexpr):
    """``keys[r]`` for rows ``r`` of this program's block: ``2**32`` where ``present[r]`` (uint8),
    else ``mix32(mix32(r ^ a) ^ b)`` with ``a = mix32(step ^ s1)``, ``b = mix32(a ^ s2)`` (the step
    read from ``step_ptr``, int64, its low 32 bits)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    step = tl.load(step_ptr + tl.zeros([BLOCK], tl.int32)).to(tl.uint32)  # the cast keeps the low 32 bits
    a = _mix32(step ^ s1.to(tl.uint32))
    b = _mix32(a ^ s2.to(tl.uint32))
    key = _mix32(_mix32(offs.to(tl.uint32) ^ a) ^ b).to(tl.int64)
    present = tl.load(present_ptr + offs, mask=mask, other=0)
    key = tl.where(present != 0, tl.full([BLOCK], 1 << 32, tl.int64), key)
    tl.store(keys_ptr + offs, key, mask=mask)


def draw_keys_(present: Tensor, step: Union[int, Tensor], s1: int, s2: int) -> Tensor:
    """:func:`~shardfc.head.sampling.draw_keys` of ``present`` (bool ``[n]``) at ``step`` (an int64
    tensor of one element on ``present``'s device, or an int) with the stream's words ``s1, s2``
    (:func:`~shardfc.head.sampling.seed_words`), in one launch."""
    n = present.shape[0]
    if n >= 2**32:
        raise ValueError(f"draw_keys_: {n} rows; the draw keys rows by 32-bit words (at most 2**32 - 1)")
    keys = torch.empty(n, dtype=torch.int64, device=present.device)
    if shapes_only(present):  # meta: what it would touch (shardfc plan --bytes), nothing launched
        note("draw_keys", [span(present)], [span(keys)])
        return keys
    if n == 0:
        return keys
    if not isinstance(step, Tensor):
        step = torch.tensor([int(step)], dtype=torch.int64, device=present.device)
    with torch.cuda.device(present.device) if present.is_cuda else contextlib.nullcontext():
        draw_keys_kernel[(triton.cdiv(n, DRAW_BLOCK),)](
            present.contiguous().view(torch.uint8), keys, step.reshape(1), n, s1, s2, BLOCK=DRAW_BLOCK)
    return keys


__all__ = ["DRAW_BLOCK", "draw_keys_kernel", "draw_keys_"]
