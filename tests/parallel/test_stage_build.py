"""Each pipeline rank builds only its stage: the whole model's exact initialisation, a stage's memory."""

from __future__ import annotations

import concurrent.futures
import ctypes
import gc
import logging
import multiprocessing

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardfc.models import build_backbone
from shardfc.parallel import stage_build
from shardfc.parallel.model_split import stages as cut_stages
from shardfc.parallel.pipeline import balanced_split_points
from shardfc.parallel.stage_build import NotReplayable, build_stage, materialise, record_build

SEED = 5


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use():
    """Bytes the C allocator has handed out (glibc's mallinfo2: heap + mmapped blocks), or None."""
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return lambda: fn().uordblks + fn().hblkhd


class MemoryMeter(TorchDispatchMode):
    """The process's allocated memory (every tensor's storage, CPU), sampled after every tensor
    operation while active: ``peak`` and ``now``, in bytes above what it was on entry."""

    def __init__(self, in_use) -> None:
        super().__init__()
        self.in_use = in_use
        self.base = self.peak = 0

    def __enter__(self):
        self.base = self.in_use()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.now)
        return out

    @property
    def now(self) -> int:
        return self.in_use() - self.base


def _whole(name: str, dim: int = 64) -> nn.Module:
    torch.manual_seed(SEED)
    return build_backbone(name, dim)


@pytest.mark.parametrize("name, n_stages", [("iresnet18", 3), ("resnet50", 3), ("mbf", 3), ("mobilefacenet", 2), ("tiny", 2)])
def test_a_stage_is_initialised_as_the_whole_model(name, n_stages):
    whole = _whole(name)
    rng_after = torch.random.get_rng_state()
    points = balanced_split_points(whole, n_stages)
    expected = cut_stages(whole, points)
    for k in range(n_stages):
        torch.manual_seed(SEED)
        built = build_stage(lambda: build_backbone(name, 64), k, lambda m: balanced_split_points(m, n_stages))
        assert built.replayed and built.split_points == points
        mine, theirs = built.stages[k].state_dict(), expected[k].state_dict()
        assert list(mine) == list(theirs)
        assert all(torch.equal(mine[key], theirs[key]) for key in mine), (name, k)
        assert [p.requires_grad for p in built.stages[k].parameters()] == [p.requires_grad for p in expected[k].parameters()]
        # the other stages were never allocated
        others = [t for j, s in enumerate(built.stages) if j != k for t in [*s.parameters(), *s.buffers()]]
        assert others and all(t.device.type == "meta" for t in others)
        # and the generator is where the whole build leaves it: what is drawn next is the same
        assert torch.equal(torch.random.get_rng_state(), rng_after), (name, k)


def _stage_memory(name: str, n_stages: int) -> list[tuple[int, int, int]] | None:
    """For each stage k: (bytes the stage holds, the process's memory after building it, the peak
    while building it), both above what it was before; None without glibc's mallinfo2. Run in a
    fresh process: mallinfo2 walks every free chunk of the heap, so in a process that has run a few
    thousand tests each sample takes tens of milliseconds (the test took 36 s in the suite, 6 to 8 alone),
    and a fresh heap is also the honest place to measure what a rank's build costs."""
    in_use = _malloc_in_use()
    if in_use is None:
        return None
    # What the first build of a process allocates once (the dispatch machinery, CPU thread pools)
    # is not a stage's cost: a small build first, as the process that calls this has already done.
    build_stage(lambda: build_backbone("tiny"), 1, lambda m: balanced_split_points(m, 2))
    out = []
    for k in range(n_stages):
        torch.manual_seed(SEED)
        gc.collect()
        with MemoryMeter(in_use) as meter:
            built = build_stage(lambda: build_backbone(name), k, lambda m: balanced_split_points(m, n_stages))
            stage = built.stages[k]
            mine = sum(t.numel() * t.element_size() for t in [*stage.parameters(), *stage.buffers()])
            gc.collect()
            now = meter.now
        assert built.replayed
        out.append((mine, now, meter.peak))
        del built, stage
    return out


def test_four_stages_of_iresnet100_each_hold_a_quarter_at_construction():
    with torch.device("meta"):
        meta = build_backbone("iresnet100")
    total = sum(t.numel() * t.element_size() for t in [*meta.parameters(), *meta.buffers()])
    points = balanced_split_points(meta, 4)
    assert points == ["layer3.8", "layer3.22", "layer4.1"]  # between blocks: layer3 alone is over half
    assert stage_build._skip_matches(torch.ops.aten.normal_.default, torch.float32)
    assert stage_build._skip_matches(torch.ops.aten.uniform_.default, torch.float32)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        measured = pool.submit(_stage_memory, "iresnet100", 4).result(timeout=300)
    if measured is None:
        pytest.skip("needs glibc's mallinfo2 to measure the process's memory")
    for k, (mine, now, peak) in enumerate(measured):
        print(f"stage {k}: {mine / 2**20:.1f} MiB of {total / 2**20:.1f} ({mine / total:.3f}); memory after "
              f"{now / 2**20:.1f} MiB, peak while building {peak / 2**20:.1f} MiB")
        assert 0.2 * total <= mine <= 0.3 * total, (k, mine / total)
        # Measured: the process's memory holds the stage and, at no point while building, much more
        # (a scratch buffer and the record of the build; the whole model would be 4x the stage).
        assert mine <= now <= mine + (8 << 20), (k, now, mine)
        assert peak <= mine + (16 << 20), (k, peak, mine)
    assert sum(mine for mine, _, _ in measured) == total
    # stage 2, bit for bit the whole model's
    whole = cut_stages(_whole("iresnet100", 512), points)[2].state_dict()
    torch.manual_seed(SEED)
    again = build_stage(lambda: build_backbone("iresnet100"), 2, lambda m: points).stages[2].state_dict()
    assert all(torch.equal(again[key], whole[key]) for key in whole)


class _Tied(nn.Module):
    """A construction the replay cannot follow for one stage: b's weight is copied from a's."""

    segments = (("a", ("a",)), ("b", ("b",)))

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)

    def forward(self, x):
        return self.b(self.a(x))


def test_a_construction_that_cannot_be_replayed_builds_the_whole_model(caplog):
    torch.manual_seed(SEED)
    expected = cut_stages(_Tied(), ["a"])[1].state_dict()
    recorded = record_build(_Tied)
    with pytest.raises(NotReplayable, match="from a tensor outside them"):
        materialise(recorded, cut_stages(recorded.model, ["a"])[1])
    torch.manual_seed(SEED)
    with caplog.at_level(logging.WARNING, logger="shardfc.parallel"):
        built = build_stage(_Tied, 1, lambda m: ["a"])
    assert not built.replayed and "cannot be replayed" in caplog.text
    assert all(torch.equal(built.stages[1].state_dict()[k], v) for k, v in expected.items())


def test_bad_stage_index_is_named():
    with pytest.raises(ValueError, match=r"stage=2 but split_points=\['body'\] cut the model into 2 stages"):
        build_stage(lambda: build_backbone("tiny", 8), 2, lambda m: ["body"])
