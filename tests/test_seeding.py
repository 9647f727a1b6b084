"""Seeds mixed from integers (SplitMix64, the same in every process) and the global generators seeded."""

import random

import numpy as np
import torch

from shardfc.seeding import _splitmix64, mix_seed, seed_all


def test_splitmix64_is_the_reference_generator():
    # The reference SplitMix64 (Steele, Lea and Flood 2014; Vigna's C code) seeded with 0 gives
    # 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f: each output is the mix of the
    # state advanced by the golden gamma, which _splitmix64 takes as its input.
    gamma = 0x9E3779B97F4A7C15
    assert [_splitmix64(k * gamma & (2**64 - 1)) for k in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_mix_seed_chains_the_parts_into_63_bits():
    assert mix_seed() == 0
    assert mix_seed(0) == 0xE220A8397B1DCDAF >> 1
    assert mix_seed(5, 7) == _splitmix64(_splitmix64(5) ^ 7) >> 1
    assert mix_seed(-1) == _splitmix64(2**64 - 1) >> 1  # a negative part as its 64-bit pattern
    assert mix_seed(2**64 + 3) == mix_seed(3)
    seeds = {mix_seed(a, b) for a in range(20) for b in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)
    assert mix_seed(1, 2) != mix_seed(2, 1)
    torch.Generator().manual_seed(max(seeds))  # fits torch's signed int64


def test_seed_all_seeds_python_numpy_and_torch():
    big = 2**32 + 7  # numpy takes seeds below 2**32: this one as 7
    for seed in (3, big):
        seed_all(seed)
        drawn = (random.random(), np.random.rand(), torch.rand(1).item())
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        assert drawn == (random.random(), np.random.rand(), torch.rand(1).item())
