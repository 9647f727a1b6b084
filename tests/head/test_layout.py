"""Tests for shardfc.head.layout: contiguous class ranges per shard."""

from __future__ import annotations

import pytest

from shardfc.head.layout import class_range, class_ranges


@pytest.mark.parametrize(
    ("num_classes", "num_shards", "expected"),
    [
        (1, 1, [(0, 1)]),
        (12, 4, [(0, 3), (3, 6), (6, 9), (9, 12)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (7, 3, [(0, 3), (3, 5), (5, 7)]),
        (3, 5, [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]),
        (5, 5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    ],
)
def test_known_layouts(num_classes: int, num_shards: int, expected: list[tuple[int, int]]) -> None:
    assert class_ranges(num_classes, num_shards) == [range(a, b) for a, b in expected]


@pytest.mark.parametrize("num_classes", [1, 2, 3, 7, 10, 64, 1001])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8, 13])
def test_ranges_partition_classes(num_classes: int, num_shards: int) -> None:
    ranges = class_ranges(num_classes, num_shards)
    assert len(ranges) == num_shards
    # Contiguous, in rank order, covering [0, C) exactly.
    assert ranges[0].start == 0 and ranges[-1].stop == num_classes
    for prev, cur in zip(ranges, ranges[1:]):
        assert prev.stop == cur.start
    base, extra = divmod(num_classes, num_shards)
    assert [len(r) for r in ranges] == [base + 1] * extra + [base] * (num_shards - extra)
    assert all(r.step == 1 for r in ranges)
    assert [class_range(num_classes, num_shards, i) for i in range(num_shards)] == ranges


def test_fewer_classes_than_shards_gives_empty_tail() -> None:
    ranges = class_ranges(2, 4)
    assert [len(r) for r in ranges] == [1, 1, 0, 0]
    assert ranges[2] == range(2, 2) and ranges[3] == range(2, 2)


@pytest.mark.parametrize("bad", [0, -3, 1.5, "4", True, None])
def test_num_classes_validation(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"num_classes must be a positive integer, got {bad!r}"):
        class_ranges(bad, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"^num_classes must be a positive integer, got {bad!r}"):
        class_range(bad, 2, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 2.0, False])
def test_num_shards_validation(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"num_shards must be a positive integer, got {bad!r}"):
        class_ranges(10, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"^num_shards must be a positive integer, got {bad!r}"):
        class_range(10, bad, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 3, 10, 1.0])
def test_index_validation(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"index must be an int in \[0, num_shards=3\), got {bad!r}"):
        class_range(10, 3, bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the shared ids and the seeded rows
def test_overlap_is_the_shared_ids_or_an_empty_range_at_the_later_start() -> None:
    from shardfc.head.layout import overlap

    assert overlap(range(0, 10), range(5, 20)) == range(5, 10)
    assert overlap(range(5, 20), range(0, 10)) == range(5, 10)
    assert overlap(range(0, 10), range(2, 4)) == range(2, 4)
    assert overlap(range(0, 3), range(7, 9)) == range(7, 7)  # none: empty at the later start
    assert overlap(range(7, 9), range(0, 3)) == range(7, 7)
    assert overlap(range(0, 4), range(4, 6)) == range(4, 4)


def _rows_by_definition(start: int, stop: int, dim: int, seed: int, block: int):
    """Rows [start, stop) drawn as the docstring says: each block of ``block`` rows whole from a CPU
    generator seeded by ``mix_seed(seed, block index)``, times 0.01."""
    import torch

    from shardfc.seeding import mix_seed

    blocks = [torch.randn(block, dim, generator=torch.Generator().manual_seed(mix_seed(seed, b))) * 0.01
              for b in range(stop // block + 1)]
    return torch.cat(blocks)[start:stop]


def test_init_rows_are_the_seeded_blocks_whatever_the_cut(monkeypatch) -> None:
    import torch

    from shardfc.head import layout

    monkeypatch.setattr(layout, "INIT_BLOCK", 8)  # small blocks: every cut below crosses some
    whole = layout.init_rows(0, 30, 5, seed=11)
    assert whole.dtype == torch.float32 and whole.shape == (30, 5) and whole.device.type == "cpu"
    assert torch.equal(whole, _rows_by_definition(0, 30, 5, 11, 8))
    for start, stop in ((0, 1), (7, 9), (8, 16), (3, 29), (16, 30), (29, 30)):
        assert torch.equal(layout.init_rows(start, stop, 5, seed=11), whole[start:stop]), (start, stop)
    assert layout.init_rows(12, 12, 5, seed=11).shape == (0, 5)
    assert not torch.equal(layout.init_rows(0, 30, 5, seed=12), whole)
    # any device but CUDA: the CPU's draw, on the CPU
    assert torch.equal(layout.init_rows(3, 29, 5, seed=11, device="meta"), whole[3:29])
    assert torch.equal(layout.init_rows(3, 29, 5, seed=11, device=torch.device("cpu")), whole[3:29])


def test_seeded_rows_of_a_range_and_of_its_subcentres(monkeypatch) -> None:
    import torch

    from shardfc.head import layout

    monkeypatch.setattr(layout, "INIT_BLOCK", 8)
    plain = layout.seeded_rows(seed=4, subcenters=1, dim=3)
    assert torch.equal(plain(range(5, 11)), layout.init_rows(5, 11, 3, seed=4))
    three = layout.seeded_rows(seed=4, subcenters=3, dim=3)(range(5, 11))
    assert three.shape == (6, 3, 3)  # class c's K rows are logical rows [cK, (c + 1)K)
    assert torch.equal(three.reshape(18, 3), layout.init_rows(15, 33, 3, seed=4))
