"""The fused forward's block sizes and grid (:mod:`shardfc.head.fused.autotune`) as chosen on a GPU, on
the meta device and under the interpreter, without launching a kernel: the config lists, the autotune
key's buckets, the launcher's three ways and the class splits from figures worked out by hand."""

from __future__ import annotations

import pytest
import torch

from shardfc.head.fused import autotune

META, CPU = torch.device("meta"), torch.device("cpu")


@pytest.fixture
def compiled(monkeypatch):
    """Sizes as on a GPU (not the interpreter's fixed ones)."""
    monkeypatch.setattr(autotune, "interpreting", lambda: False)


def test_configs_are_the_tiles_warps_and_stages_given():
    (a, b) = autotune._configs([(64, 128, 32, 4, 2), (16, 32, 64, 8, 5)])
    assert (a.kwargs, a.num_warps, a.num_stages) == ({"BM": 64, "BN": 128, "BD": 32}, 4, 2)
    assert (b.kwargs, b.num_warps, b.num_stages) == ({"BM": 16, "BN": 32, "BD": 64}, 8, 5)


def test_forward_configs_by_options():
    F, W, H = autotune.FORWARD_CONFIGS, autotune.WIDE_FORWARD_CONFIGS, autotune.HEAVY_FORWARD_CONFIGS
    assert autotune.forward_configs(1, False) == F + W
    assert autotune.forward_configs(1, False, "tf32", norm_w=True) == F
    assert autotune.forward_configs(1, False, "ieee") == F[1:]
    assert autotune.forward_configs(2, False) == H
    assert autotune.forward_configs(1, True) == autotune.forward_configs(3, True, "ieee", True) == H[:1]
    assert len(F) == 3 and len(W) == 2 and len(H) == 2


def test_lse_forward_tunes_the_forward_kernel_over_its_configs_once_per_list():
    tuned = autotune.lse_forward(2, False)
    assert tuned.fn is autotune.forward.lse_forward_kernel
    assert list(tuned.configs) == autotune.HEAVY_FORWARD_CONFIGS
    assert list(autotune.lse_forward(1, False).configs) == autotune.FORWARD_CONFIGS + autotune.WIDE_FORWARD_CONFIGS
    assert autotune.lse_forward(2, False, "tf32", False) is tuned
    assert list(autotune.lse_forward(1, False, "ieee").configs) == autotune.FORWARD_CONFIGS[1:]
    assert list(autotune.lse_forward(1, False, norm_w=True).configs) == autotune.FORWARD_CONFIGS
    assert list(autotune.lse_forward(1, True).configs) == autotune.HEAVY_FORWARD_CONFIGS[:1]


def test_bucket_rounds_up_to_a_power_of_two():
    assert [autotune.bucket(n) for n in (-3, 0, 1, 2, 3, 4, 5, 1000)] == [1, 1, 1, 2, 4, 4, 8, 1024]
    assert autotune.bucket(1_000_000) == autotune.bucket(1_000_003) == 2**20
    assert autotune.bucket(2.0) == 2


class _Tuned:
    """An autotuned kernel's stand-in: records how it was launched."""

    def __init__(self):
        self.calls = []
        self.fn = self

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_launch_on_the_meta_device_runs_nothing():
    tuned = _Tuned()
    autotune.launch(tuned, lambda meta: (1,), torch.empty(2), torch.empty(2, device="meta"), 3, X=1)
    assert tuned.calls == []


def test_launch_under_the_interpreter_uses_the_fixed_tiles(monkeypatch):
    monkeypatch.setattr(autotune, "interpreting", lambda: True)
    tuned, t = _Tuned(), torch.empty(2)
    autotune.launch(tuned, lambda meta: (meta["BM"] + 1, meta["BN"] + 2), t, 3, X=1)
    ((grid, args, kwargs),) = tuned.calls
    assert grid == (17, 18) and args == (t, 3) and kwargs == {"X": 1, "BM": 16, "BN": 16, "BD": 16}
    assert autotune.INTERPRETER_TILES == {"BM": 16, "BN": 16, "BD": 16}  # untouched


def test_launch_on_a_gpu_lets_the_tuner_choose(compiled):
    tuned, t = _Tuned(), torch.empty(2)
    tuned.fn = None  # never the bare kernel
    grid = lambda meta: (1,)  # noqa: E731
    autotune.launch(tuned, grid, t, 3, X=1)
    assert tuned.calls == [(grid, (t, 3), {"X": 1})]


def test_splits_wanted_off_the_gpu_on_the_meta_device_and_on_cuda(compiled, monkeypatch):
    assert autotune.splits_wanted(1024, 64, CPU, off_gpu=5) == 5
    # 4 programs on each of 132 SMs over 1024 / 64 = 16 row tiles: 33 splits
    assert autotune.splits_wanted(1024, 64, META, off_gpu=5) == 33
    assert autotune.splits_wanted(1000, 64, META, off_gpu=5) == 33  # 16 row tiles, the last one short
    assert autotune.splits_wanted(1025, 64, META, off_gpu=5) == 32  # 17 row tiles: ceil(528 / 17)
    assert autotune.splits_wanted(0, 64, META, off_gpu=5) == 528  # an empty batch: one row tile
    assert autotune.splits_wanted(64, 128, META, off_gpu=5) == 528
    seen = []
    monkeypatch.setattr(autotune, "sm_count", lambda index: seen.append(index) or 100)
    assert autotune.splits_wanted(1024, 64, torch.device("cuda", 1), off_gpu=5) == 25  # ceil(400 / 16)
    assert autotune.splits_wanted(1024, 64, torch.device("cuda"), off_gpu=5) == 25
    assert seen == [1, 0]
    monkeypatch.setattr(autotune, "interpreting", lambda: True)
    assert autotune.splits_wanted(1024, 64, META, off_gpu=5) == 5


def test_class_splits_on_a_gpu_are_whole_quanta(compiled):
    # 33 splits of 1,000,000 classes: 30,304 a split, rounded up to 256
    assert autotune.class_splits(1_000_000, 1024, META) == 30464
    assert autotune.class_splits(1_000_000, 1024, META) % autotune.SPLIT_QUANTUM == 0
    assert autotune.class_splits(100, 1024, META) == 256  # fewer classes than splits: one quantum
    assert autotune.class_splits(0, 1024, META) == 256
    assert autotune.class_splits(10_000, 64, META) == 256  # 528 splits: 19 classes each, one quantum
    assert autotune.class_splits(200_000, 64, META) == 512  # 379 a split
    assert autotune.class_splits(200_000, 65, META) == 768  # 2 row tiles of 64: 264 splits, 758 a split
    # 529 row tiles, more than 4 programs on each of 132 SMs: one split of every class
    assert autotune.splits_wanted(64 * 529, 64, META, off_gpu=5) == 1
    assert autotune.class_splits(1_000_000, 64 * 529, META) == 1000192
    assert autotune.class_splits(1_000_000, 1024, CPU) == 333568  # three splits off the GPU


def test_class_splits_under_the_interpreter_are_three_of_whole_tiles(monkeypatch):
    monkeypatch.setattr(autotune, "interpreting", lambda: True)
    assert autotune.class_splits(100, 8, CPU) == 48  # 34 a split, rounded up to 16
    assert autotune.class_splits(96, 8, META) == 32
    assert autotune.class_splits(0, 8, CPU) == 16
