"""``shardfc plan --bytes``' count at its edges (:mod:`shardfc.tools.plan.traffic`), each against bytes
worked by hand on tiny tensors: the L2 model's capacity, LRU order and write-backs, what each kind of
torch operator reads and writes, GEMM shapes and FLOPs, the tables. ``test_plan_bytes.py`` holds the
model on real steps."""

from __future__ import annotations

import gc

import pytest
import torch

from shardfc.head.fused.traffic import span, streamed
from shardfc.tools.plan.traffic import (
    HBM_BYTES_PER_S,
    MATMUL_FLOPS_PER_S,
    SMALL_ROW_BYTES,
    Launch,
    StepTraffic,
    TrafficCounter,
    _distinct,
    _mutated,
    chunk_candidates,
    format_chunk_candidates,
    format_traffic,
    summarise,
)
from tools.test_plan_bytes import _count, _meta  # tests/ is on sys.path (its conftest.py)

aten = torch.ops.aten


def _ops(l2: int, body):
    """The launches of ``body``'s torch operators, counted with an L2 of ``l2`` bytes."""
    return _count(l2, body).launches


# ------------------------------------------------------------------ the L2 model, through kernels
def test_l2_full_to_the_byte_keeps_everything():
    counter = TrafficCounter(100)
    a, b, c = _meta(15), _meta(10), _meta(25)  # 60, 40 and 100 bytes
    counter.kernel("fill", [span(a), span(b)], [])
    counter.kernel("again", [span(a), span(b)], [])
    counter.kernel("whole", [span(c)], [])  # exactly the L2: cached (evicting both), not streamed
    counter.kernel("whole again", [span(c)], [])
    fill, again, whole, whole_again = counter.finish().launches
    assert (fill.read, fill.from_l2) == (100, 0)
    assert (again.read, again.from_l2) == (0, 100)  # two hits add up
    assert (whole.read, whole_again.read, whole_again.from_l2) == (100, 0, 100)


def test_least_recently_used_goes_first():
    counter = TrafficCounter(100)
    a, b, d = _meta(10), _meta(10), _meta(10)  # 40 bytes each
    counter.kernel("a, b", [span(a), span(b)], [])
    counter.kernel("a", [span(a)], [])  # a used last: b is the least recent
    counter.kernel("d", [span(d)], [])  # 120 > 100: b goes
    counter.kernel("a, b", [span(a), span(b)], [])
    launches = counter.finish().launches
    assert (launches[3].from_l2, launches[3].read) == (40, 40)


def test_write_backs_are_credited_to_the_writer_when_evicted_or_at_the_end():
    counter = TrafficCounter(100)
    a, b, r = _meta(10), _meta(10), _meta(15)
    counter.kernel("writes a", [], [span(a)])  # 40 dirty
    counter.kernel("writes b", [], [span(b)])  # 40 dirty
    counter.kernel("reads r", [span(r)], [])  # 60 more: a is written back
    counter.kernel("big", [], [span(_meta(30))])  # 120 > L2: streams to HBM at once
    wa, wb, rr, big = counter.finish().launches  # b written back at the end
    assert (wa.written, wb.written, rr.read, rr.written, big.written) == (40, 40, 60, 0, 120)
    assert (wa.read, wb.read) == (0, 0)


def test_a_region_rewritten_in_l2_is_written_back_once_by_its_last_writer():
    counter = TrafficCounter(100)
    a = _meta(10)
    counter.kernel("first", [], [span(a)])
    counter.kernel("second", [], [span(a)])
    counter.kernel("fill", [span(_meta(15))], [])  # 40 + 60 = 100: still fits, nothing evicted
    first, second, fill = counter.finish().launches
    assert (first.written, second.written, fill.read) == (0, 40, 60)


def test_streamed_regions_and_flops():
    counter = TrafficCounter(100)
    a = _meta(10)
    counter.kernel("stream", streamed([span(a)]), streamed([span(a)]), 7.0)
    counter.kernel("plain", [span(a)], [])
    stream, plain = counter.finish().launches
    assert (stream.read, stream.written, stream.flops, stream.largest, stream.fused) == (40, 40, 7.0, 40, True)
    assert (plain.read, plain.from_l2, plain.flops) == (40, 0, 0.0)


def test_a_tensor_first_seen_by_a_read_never_takes_a_freed_block():
    counter = TrafficCounter(1000)
    x = _meta(10)
    counter.kernel("writes x", [], [span(x)])  # dirty in L2
    del x
    gc.collect()
    y = _meta(10)  # made before the step (an input): not a block the step's allocator hands out
    counter.kernel("reads y", [span(y)], [])
    writer, reader = counter.finish().launches
    assert (reader.read, reader.from_l2) == (40, 0) and writer.written == 40


def test_a_freed_block_is_taken_by_the_next_output_of_its_size_and_never_written_back():
    a, b = _meta(10), _meta(20)
    outs = []

    def body():
        t = a * 2  # 40 bytes, dirty
        del t
        gc.collect()
        outs.append(b * 2)  # 80 bytes: another size, a new block
        outs.append(a + 1)  # 40 bytes: takes t's block, replacing its lines
    mul, mul2, add = _ops(1000, body)
    assert (mul.written, mul2.written, add.written) == (0, 80, 40)


def test_evictions_and_rewrites_give_back_their_room():
    counter = TrafficCounter(100)
    a, b, c = _meta(5), _meta(12), _meta(15)  # 20, 48 and 60 bytes
    counter.kernel("a, b", [span(a), span(b)], [])  # 68 used
    counter.kernel("c", [span(c)], [])  # 128: a goes (48 + 60 = 108, still over), then b
    counter.kernel("b", [span(b)], [])
    launches = counter.finish().launches
    assert (launches[2].read, launches[2].from_l2) == (48, 0)  # b had been evicted with a

    counter = TrafficCounter(100)
    counter.kernel("a, c", [span(a), span(c)], [])  # 80 used
    counter.kernel("writes c", [], [span(c)])  # c rewritten in L2: its 60 given back, then taken: 80
    counter.kernel("a", [span(a)], [])  # still there
    launches = counter.finish().launches
    assert (launches[2].read, launches[2].from_l2) == (0, 20) and launches[1].written == 60


def test_operator_arguments_given_by_name():
    counter = TrafficCounter(1000)
    a, b = _meta(10), _meta(10)
    counter.op(aten.add.Tensor, (a,), {"other": b}, _meta(10))
    counter.op(aten.add_.Tensor, (), {"self": a, "other": b}, a)
    by_name, in_place = counter.finish().launches
    assert (by_name.read, by_name.written) == (80, 40)
    assert in_place.read + in_place.from_l2 == 80 and in_place.largest == 40


def test_a_fused_optimizer_writes_its_parameters_and_buffers_not_its_gradients():
    p, g, m = [_meta(4)], [_meta(4)], [_meta(4)]
    got = _mutated(aten._fused_sgd_.default, (p, g, m), dict(weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0,
                                                              nesterov=False, maximize=False, is_first_step=False))
    assert got == [p, m]


def test_the_counter_starts_empty():
    counter = TrafficCounter(40)
    counter.kernel("fits", [span(_meta(10))], [])
    counter.kernel("again", [span(_meta(10))], [])  # another 40 bytes: the first is evicted
    assert [x.read for x in counter.finish().launches] == [40, 40]
    assert TrafficCounter(40).finish().launches == []


# ------------------------------------------------------------------ what torch operators touch
def test_an_operator_reads_each_argument_once_and_writes_its_result():
    a, keep = _meta(10), []
    (add,) = _ops(1000, lambda: keep.append(a + a))
    assert (add.kernel, add.fused, add.read, add.from_l2, add.written, add.largest) == ("add", False, 40, 0, 40, 40)


def test_out_is_written_not_read():
    a, b, o = _meta(10), _meta(10), _meta(10)
    (add,) = _ops(1000, lambda: torch.add(a, b, out=o))
    assert (add.read, add.written) == (80, 40)


def test_a_wrapped_python_number_is_no_memory_but_a_0_dim_tensor_is():
    a, s, keep = _meta(10), _meta(()), []
    add_number, add_tensor = _ops(1000, lambda: keep.extend([a + torch.tensor(2.0), a + s]))
    assert add_number.read == 40 and (add_tensor.read, add_tensor.from_l2) == (4, 40)  # a from L2 the second time


def test_copy_reads_its_source_only_and_zero_writes_only():
    dst, src = _meta(10), _meta(20)[:10]

    def body():
        dst.copy_(src)
        dst.zero_()
    copy, zero = _ops(1000, body)
    # copy reads src (not dst); zero_ rewrites copy's dirty lines in L2, so only zero_'s go to HBM
    assert (copy.read, copy.written, copy.largest, zero.read, zero.written) == (40, 0, 40, 0, 40)


def test_an_operator_that_touches_nothing_is_no_launch():
    keep = []
    assert _ops(1000, lambda: keep.append(torch.empty(4, device="meta"))) == []
    assert _ops(1000, lambda: keep.append(_meta(0) * 2)) == []  # zero bytes: no launch


def test_gathers_read_the_rows_they_return_keyed_on_their_index():
    w, i1, i2, keep = _meta(100, 4), _meta(3, dtype=torch.int64), _meta(3, dtype=torch.int64), []

    def body():
        keep.append(w.index_select(0, i1))
        keep.append(w.index_select(0, i1))  # the same rows: from L2
        keep.append(w.index_select(0, i2))  # other rows (another index tensor): from HBM
        keep.append(w[i1])  # aten.index: the index list's tensors are read too
    first, same, other, indexed = _ops(100_000, body)
    rows = 3 * 4 * 4
    assert (first.read, first.from_l2) == (rows + 24, 0)
    assert (same.read, same.from_l2) == (0, rows + 24)
    assert (other.read, other.from_l2) == (rows + 24, 0)
    assert indexed.kernel == "index" and indexed.read + indexed.from_l2 == rows + 24


def test_scatters_read_and_write_the_rows_they_touch():
    dest, idx, idx2, src = _meta(10, 4), _meta(3, dtype=torch.int64), _meta(3, dtype=torch.int64), _meta(3, 4)

    def body():
        dest.index_add_(0, idx, src)
        dest.index_add_(0, idx2, src)  # other rows: dest's rows from HBM again
        dest.index_fill_(0, idx, 1.0)  # writes its rows without reading them
    add1, add2, fill = _ops(100_000, body)
    rows = 3 * 4 * 4
    assert (add1.read, add1.from_l2) == (rows + 24 + rows, 0)
    assert (add2.read, add2.from_l2) == (rows + 24, rows)  # only src came from L2
    assert (fill.read, fill.from_l2, fill.largest) == (0, 24, rows)
    # each scatter's rows are their own region (keyed on every tensor argument): all written back
    assert [x.written for x in (add1, add2, fill)] == [rows, rows, rows]


@pytest.mark.parametrize("body, touched, others", [
    (lambda d: d.index_put_((_meta(3, dtype=torch.int64),), _meta(3, 4, 2)), 3 * 4 * 2 * 4, 24 + 96),
    (lambda d: d.scatter_add_(0, _meta(2, 3, 2, dtype=torch.int64), _meta(3, 4, 2)), 2 * 3 * 2 * 4, 96 + 96),
    (lambda d: d.scatter_(0, _meta(2, 3, 2, dtype=torch.int64), _meta(3, 4, 2)), 2 * 3 * 2 * 4, 96 + 96),
    (lambda d: d.scatter_reduce_(0, _meta(2, 3, 2, dtype=torch.int64), _meta(3, 4, 2), "sum"), 2 * 3 * 2 * 4, 96 + 96),
    (lambda d: d.index_copy_(1, _meta(2, dtype=torch.int64), _meta(10, 2, 2)), 2 * 10 * 2 * 4, 16 + 160),
])
def test_the_bytes_each_scatter_touches(body, touched, others):
    dest = _meta(10, 4, 2)
    (launch,) = _ops(100_000, lambda: body(dest))
    assert launch.written == touched and type(launch.written) is int
    assert launch.read == touched + others  # its rows of dest, then the index and the source


def test_index_put_without_indices_and_a_scatter_into_a_dimension_of_one():
    from shardfc.tools.plan.traffic import _scattered_bytes

    dest = _meta(10, 4)
    for name in ("index_put_", "_index_put_impl_"):
        assert _scattered_bytes(name, dest, (dest, [None], _meta(10, 4))) == 160  # all of dest, once
        assert _scattered_bytes(name, dest, (dest, [_meta(3, dtype=torch.int64)], _meta(3, 4))) == 48
        assert _scattered_bytes(name, dest, (dest, [None, _meta(2, dtype=torch.int64)], _meta(10, 2))) == 80
    assert _scattered_bytes("index_copy_", _meta(10, 1, 2), (None, 1, _meta(1, dtype=torch.int64))) == 80


def test_in_place_arguments_by_schema():
    a, b = _meta(4), _meta(4)
    assert _mutated(aten.add_.Tensor, (), {"self": a, "other": b}) == [a]
    assert _mutated(aten.add.out, (a, b), {"out": _meta(4)}) == []  # out is the result, counted as such
    assert _mutated(aten.add.Tensor, (a, b), {}) == []


@pytest.mark.parametrize("fn, flops, shape", [
    (lambda: _meta(3, 5) @ _meta(5, 7), 2 * 3 * 5 * 7, "[3x5]·[5x7]"),
    (lambda: torch.addmm(_meta(3, 7), _meta(3, 5), _meta(5, 7)), 2 * 3 * 5 * 7, "[3x5]·[5x7]"),
    (lambda: torch.bmm(_meta(2, 3, 5), _meta(2, 5, 7)), 2 * 2 * 3 * 5 * 7, "[3x5]·[5x7] x2"),
    (lambda: torch.baddbmm(_meta(4, 3, 7), _meta(4, 3, 5), _meta(4, 5, 7)), 2 * 4 * 3 * 5 * 7, "[3x5]·[5x7] x4"),
])
def test_gemm_flops_and_shapes(fn, flops, shape):
    keep = []
    (gemm,) = _ops(100_000, lambda: keep.append(fn()))
    assert (gemm.flops, gemm.shape) == (flops, shape)


def test_distinct_bytes_of_views():
    assert _distinct(torch.empty(3, 1).expand(3, 5)) == 3  # a broadcast dimension counts once
    assert _distinct(torch.empty(1).expand(0)) == 0  # no elements, whatever the strides say
    assert _distinct(torch.empty(2, 3)[:, ::2]) == 4


# ------------------------------------------------------------------ the tables
def _launch(kernel, fused=False, read=0, written=0, from_l2=0, flops=0.0, largest=0, shape=""):
    return Launch(kernel, fused, read, written, from_l2, flops, largest, shape)


def test_launch_time_on_paper_is_the_slower_of_bytes_and_flops():
    assert _launch("k", read=2.9e9, written=2.9e9).ms == pytest.approx(2.0)
    assert _launch("k", read=1, flops=1.2e12).ms == pytest.approx(2.0)


def test_the_table_groups_by_kernel_and_shape_and_the_summary_adds_up():
    step = StepTraffic(1024, [
        _launch("mm", read=10, written=5, from_l2=1, flops=4.0, largest=10, shape="[1x2]·[2x2]"),
        _launch("add", read=3, largest=7),
        _launch("mm", read=20, written=1, from_l2=2, flops=6.0, largest=20, shape="[1x2]·[2x2]"),
        _launch("mm", read=1, shape="[9x9]·[9x9]", largest=1),
        _launch("fused_bwd", fused=True, read=100, largest=500),
    ])
    rows = step.table()
    assert [(r["kernel"], r["shape"], r["launches"]) for r in rows] == [
        ("mm", "[1x2]·[2x2]", 2), ("add", "", 1), ("mm", "[9x9]·[9x9]", 1), ("fused_bwd", "", 1)]
    assert {k: rows[0][k] for k in ("read", "written", "from_l2", "flops", "fused")} == dict(
        read=30, written=6, from_l2=3, flops=10.0, fused=False)
    assert rows[0]["ms"] == pytest.approx(step.launches[0].ms + step.launches[2].ms)
    assert step.total() == 30 + 6 + 3 + 1 + 100 == step.total("hbm")
    assert step.total("from_l2") == 3
    s = summarise(step)
    assert {k: s[k] for k in ("l2_bytes", "launches", "read", "written", "from_l2", "hbm_bytes", "flops")} == dict(
        l2_bytes=1024, launches=5, read=134, written=6, from_l2=3, hbm_bytes=140, flops=10.0)
    assert s["largest_torch_region"] == 20 and s["ms"] == pytest.approx(sum(x.ms for x in step.launches))
    assert summarise(StepTraffic(8))["largest_torch_region"] == 0


def test_the_bytes_table():
    big, small = SMALL_ROW_BYTES, 1024
    traffic = dict(
        l2_bytes=50 * 2**20, launches=1234, read=3 * 2**30, written=2**30, from_l2=2**20, flops=2.5e12, ms=1.234,
        hbm_bytes=4 * 2**30, largest_torch_region=2**20,
        kernels=[
            dict(kernel="mm", shape="[1x2]·[2x3]", fused=False, launches=2, read=small, written=0, from_l2=0, flops=1e12, ms=0.5),
            dict(kernel="add", shape="", fused=False, launches=3, read=big - 1, written=0, from_l2=0, flops=0.0, ms=0.25),
            dict(kernel="fwd", shape="", fused=True, launches=1, read=small, written=0, from_l2=0, flops=0.0, ms=0.125),
            dict(kernel="mul", shape="", fused=False, launches=1, read=big, written=0, from_l2=0, flops=0.0, ms=0.1),
            dict(kernel="neg", shape="", fused=False, launches=4, read=1, written=2, from_l2=3, flops=0.0, ms=0.0625),
            dict(kernel="sub", shape="", fused=False, launches=1, read=1, written=big, from_l2=0, flops=0.0, ms=0.0),
            dict(kernel="div", shape="", fused=False, launches=1, read=2, written=0, from_l2=big, flops=0.0, ms=0.0),
        ])
    assert format_traffic(traffic).splitlines() == [
        f"HBM traffic of one step (rank 0; L2 model of 50.00 MiB; time on paper at {HBM_BYTES_PER_S / 1e12:.1f} TB/s "
        f"and {MATMUL_FLOPS_PER_S / 1e12:.0f} TFLOP/s, launch overheads left out):",
        "",
        "| kernel | shape | launches | HBM read | HBM written | from L2 | TFLOP | ms on paper |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        "| mm | [1x2]·[2x3] | 2 | 1.00 KiB | 0 B | 0 B | 1.000 | 0.500 |",
        "| fwd (fused) |  | 1 | 1.00 KiB | 0 B | 0 B | 0.000 | 0.125 |",
        "| mul |  | 1 | 16.00 MiB | 0 B | 0 B | 0.000 | 0.100 |",
        "| sub |  | 1 | 1 B | 16.00 MiB | 0 B | 0.000 | 0.000 |",
        "| div |  | 1 | 2 B | 0 B | 16.00 MiB | 0.000 | 0.000 |",
        "| 2 other torch operators |  | 7 | 16.00 MiB | 2 B | 3 B | 0.000 | 0.312 |",
        "| **step** | | **1,234** | **3.00 GiB** | **1.00 GiB** | 1.00 MiB | 2.500 | **1.23** |",
        "HBM bytes a step: 4.29 GB (largest region a torch operator touched: 1.00 MiB)",
    ]


def test_chunk_candidates_ties_to_a_nanosecond_and_none_to_pick_from():
    def run(ms):
        return dict(launches=10, hbm_bytes=10**9, ms=ms), 2**30

    c = chunk_candidates({2: run(5.0), 1: run(5.0 + 4e-7), 4: run(9.0)})
    assert c["pick"] == 1  # within a nanosecond of 2's: the smaller scale
    assert chunk_candidates({2: run(5.0), 1: run(5.0 + 2e-6)})["pick"] == 2
    assert chunk_candidates({}) == dict(host_launch_us=8.0, rows=[], pick=None)
    assert format_chunk_candidates(c).splitlines() == [
        "Chunk sizes (the GPU paths' chunks as multiples of the L2-sized one; host issue at 8 µs a launch; a step "
        "takes the slower of GPU and host):",
        "",
        "| scale | launches | HBM bytes | GPU ms on paper | host issue ms | step ms on paper | step peak |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        "| 1 (picked) | 10 | 1.00 GB | 5.00 | 0.08 | 5.00 | 1.00 GiB |",
        "| 2 | 10 | 1.00 GB | 5.00 | 0.08 | 5.00 | 1.00 GiB |",
        "| 4 | 10 | 1.00 GB | 9.00 | 0.08 | 9.00 | 1.00 GiB |",
        "on paper: scale 1; impl='auto' times every scale on the device and keeps the fastest",
    ]
