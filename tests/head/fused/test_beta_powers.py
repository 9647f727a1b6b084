"""AdamW's bias corrections in the kernels (``epilogue.beta_powers`` over ``epilogue.step_bits``):
the squaring reads only as many bits as the block's largest step count has, and gives, bit for bit,
what the squaring over all 53 bits gives (done here in Python's fp64), and ``b ** t`` to its error."""

from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl
from fused_pairs import DEVICE

from shardfc.head.fused.epilogue import STEP_BITS, beta_powers, step_bits

BR = 16


def _powers_kernel(t_ptr, pow1_ptr, pow2_ptr, bits_ptr, betas_ptr, n, BR: tl.constexpr):
    offs = tl.arange(0, BR)
    mask = offs < n
    t = tl.load(t_ptr + offs, mask=mask, other=1.0)
    bits = step_bits(tl.max(t))
    pow1, pow2 = beta_powers(tl.load(betas_ptr), tl.load(betas_ptr + 1), t, bits)  # fp64
    tl.store(pow1_ptr + offs, pow1, mask=mask)
    tl.store(pow2_ptr + offs, pow2, mask=mask)
    tl.store(bits_ptr, bits)


@functools.cache
def _kernel():
    """Wrapped when first run, inside a test: conftest.py sets ``TRITON_INTERPRET`` for the tests
    alone (``triton.jit`` reads it when it wraps)."""
    return triton.jit(_powers_kernel)


def _squared(b: float, t: int) -> float:
    """``b ** t`` by squaring over all of :data:`STEP_BITS` bits, in Python's fp64: the kernel's
    arithmetic before it stopped at the counts' top bit."""
    p = 1.0
    for _ in range(STEP_BITS):
        if t & 1:
            p *= b
        b *= b
        t >>= 1
    return p


def _run(counts, beta1, beta2):
    t = torch.tensor(counts, dtype=torch.float64, device=DEVICE)
    pow1, pow2 = torch.empty_like(t), torch.empty_like(t)
    bits = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    betas = torch.tensor([beta1, beta2], dtype=torch.float64, device=DEVICE)
    _kernel()[(1,)](t, pow1, pow2, bits, betas, len(counts), BR=BR)
    return pow1.cpu().tolist(), pow2.cpu().tolist(), int(bits)


@pytest.mark.parametrize("counts", [
    [1],
    [0, 1, 2, 3],
    [1, 2, 4, 8],  # the largest a power of two: its top bit is the one a short loop would drop
    [5, 7, 1000, 1023],
    [1, 1024, 3, 65535],
    [2**20 - 1, 17, 2**20],
    [2**31 + 5, 2**40 - 1, 9],
    [2**52 + 1, 2**53 - 1, 2**52],  # every bit fp64 holds
])
@pytest.mark.parametrize("beta1, beta2", [(0.9, 0.999), (0.5, 0.99), (0.9999999, 0.3)])
def test_the_powers_are_the_full_squaring_bit_for_bit(counts, beta1, beta2):
    pow1, pow2, bits = _run(counts, beta1, beta2)
    top = max(counts)
    assert bits == min(max(top, 1).bit_length(), STEP_BITS), (top, bits)
    for t, p1, p2 in zip(counts, pow1, pow2):
        assert p1 == _squared(beta1, t) and p2 == _squared(beta2, t), (t, p1, p2)
        # and b ** t to a relative t·ε (each squaring doubles the relative error): at most
        # t·ε·b^t ≤ ε / (e·ln(1/b)) apart, far below the fp32 rounding of 1 − b^t that the update reads
        for b, p in ((beta1, p1), (beta2, p2)):
            assert p == pytest.approx(b ** t, rel=2 * max(t, 1) * 2**-52, abs=1e-300), (b, t)


def test_the_bits_read_follow_the_largest_count_and_stop_at_fp64s():
    for top in [1, 2, 3, 4, 255, 256, 10**6, 2**52, 2**53 - 1]:
        assert _run([1, top], 0.9, 0.999)[2] == min(top.bit_length(), STEP_BITS), top
    assert _run([10**6, 3], 0.9, 0.999)[2] == 20  # a million steps: 20 iterations, not 53
