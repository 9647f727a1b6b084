"""Partial FC's draw kernel (``fused/draw.py``) against the torch form of the counter-based draw
(``sampling.draw_keys``), which ``tests/head/test_partial_fc.py`` holds to the documented hash."""

from __future__ import annotations

import pytest
import torch
from fused_pairs import DEVICE

from shardfc.head import sampling
from shardfc.head.fused import draw


def _torch_keys(present, step, seed):
    """The torch form, on the CPU (``draw_keys`` picks the kernel on CUDA)."""
    return sampling.draw_keys(present.cpu(), int(step), seed)


@pytest.mark.parametrize("n", [1, 5, draw.DRAW_BLOCK, draw.DRAW_BLOCK + 37, 3 * draw.DRAW_BLOCK - 1])
@pytest.mark.parametrize("seed, step", [(0, 0), (7, 12345), (2**62 + 3, 2**40 + 5)])
def test_the_kernel_keys_every_row_as_the_torch_draw_does(n, seed, step):
    g = torch.Generator().manual_seed(n)
    present = (torch.rand(n, generator=g) < 0.1).to(DEVICE)
    s1, s2 = sampling.seed_words(seed)
    counter = torch.tensor([step], dtype=torch.int64, device=DEVICE)
    keys = draw.draw_keys_(present, counter, s1, s2)
    assert keys.dtype == torch.int64 and keys.shape == (n,)
    assert torch.equal(keys.cpu(), _torch_keys(present, step, seed))
    assert torch.equal(draw.draw_keys_(present, step, s1, s2).cpu(), keys.cpu())  # an int step too


def test_an_empty_shard_and_the_meta_device_launch_nothing():
    s1, s2 = sampling.seed_words(1)
    assert draw.draw_keys_(torch.zeros(0, dtype=torch.bool, device=DEVICE), 0, s1, s2).shape == (0,)
    meta = draw.draw_keys_(torch.zeros(10, dtype=torch.bool, device="meta"), 0, s1, s2)
    assert meta.device.type == "meta" and meta.shape == (10,) and meta.dtype == torch.int64


def test_the_head_s_draw_on_this_device_equals_the_torch_form():
    """``sampling.draw_keys`` on the test's device (the kernel on CUDA, the torch form on the CPU)
    against the torch form on the CPU: the same keys for a seed whatever the device."""
    present = torch.zeros(3000, dtype=torch.bool)
    present[::7] = True
    for seed, step in [(1, 0), (9, 77)]:
        counter = torch.tensor([step], dtype=torch.int64, device=DEVICE)
        keys = sampling.draw_keys(present.to(DEVICE), counter, seed)
        assert keys.device.type == DEVICE.type and torch.equal(keys.cpu(), _torch_keys(present, step, seed))


def test_on_the_meta_device_the_head_s_draw_is_the_kernel_s_one_launch():
    """``shardfc plan --bytes`` counts the draw as the GPU runs it: one launch reading the
    positives' bytes and writing the keys."""
    from shardfc.head.fused import traffic

    seen = []
    with traffic.recording(lambda kernel, reads, writes, flops: seen.append((kernel, [r.nbytes for r in reads],
                                                                            [w.nbytes for w in writes]))):
        keys = sampling.draw_keys(torch.zeros(1000, dtype=torch.bool, device="meta"), 0, seed=5)
    assert keys.device.type == "meta" and keys.shape == (1000,)
    assert seen == [("draw_keys", [1000], [8000])]


def test_a_shard_of_2_32_classes_or_more_is_refused_naming_the_count():
    s1, s2 = sampling.seed_words(0)
    assert draw.draw_keys_(torch.zeros(2**32 - 1, dtype=torch.bool, device="meta"), 0, s1, s2).shape == (2**32 - 1,)
    with pytest.raises(ValueError, match=r"^draw_keys_: 4294967296 rows; the draw keys rows by 32-bit words "
                                         r"\(at most 2\*\*32 - 1\)$"):
        draw.draw_keys_(torch.zeros(2**32, dtype=torch.bool, device="meta"), 0, s1, s2)
