"""``shardfc plan --bytes``: a step's HBM bytes kernel by kernel (:mod:`shardfc.tools.plan.traffic`).

The L2 model on hand-made sequences (hits, evictions credited to their writer, freed blocks reused
with no write-back, regions larger than L2 streaming, gathers reading only their rows), then the
headline workload of issue 31 on the meta device: one rank, B = 1024, D = 512, 1M classes, ArcFace,
bf16 compute over fp32 centres, SGD momentum 0.9 and weight decay, the GPU path with the update in
the backward — at most 16 GB a step, and no torch operator touching an ``[n, D]``-sized tensor."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shardfc.cli.plan import main
from shardfc.tools.plan import plan
from shardfc.tools.plan.replay import _MetaStep
from shardfc.tools.plan.traffic import TrafficCounter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the GPU path's replay needs Triton")
MiB = 2**20


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _count(l2: int, body):
    counter = TrafficCounter(l2)
    mode = _MetaStep()
    mode.observer = counter
    with mode:
        body()
    return counter.finish()


def test_a_region_read_twice_costs_hbm_once_and_a_larger_one_streams():
    a, b = _meta(256, 1024), _meta(4096, 1024)  # 1 MiB, 16 MiB

    def body():
        a.sum()
        a.sum()
        b.sum()
        b.sum()

    step = _count(4 * MiB, body)
    reads = [x.read for x in step.launches]
    assert reads == [MiB, 0, 16 * MiB, 16 * MiB]
    assert [x.from_l2 for x in step.launches] == [0, MiB, 0, 0]


def test_dirty_data_is_written_back_when_evicted_credited_to_its_writer():
    a = _meta(256, 1024)
    keep = []

    def body():
        keep.append(a * 2)  # 1 MiB written, stays alive
        for _ in range(4):
            _meta(256, 1024).sum()  # 4 MiB of reads push it out of a 2 MiB L2

    step = _count(2 * MiB, body)
    writer = step.launches[0]
    assert writer.kernel == "mul" and writer.written == MiB


def test_a_freed_block_taken_by_the_next_tensor_of_its_size_is_never_written_back():
    a = _meta(512, 512)

    def body():
        for _ in range(5):
            p = a * 2  # the loop's block of products: written, read, freed before the next
            p.sum()
            del p

    step = _count(4 * MiB, body)
    # only the last block, dirty in L2 when the step ends, is written back
    assert sum(x.written for x in step.launches if x.kernel == "mul") == MiB
    assert sum(x.read for x in step.launches if x.kernel == "sum") == 0  # every read from L2


def test_the_block_alive_when_the_next_is_made_is_written_back():
    """Two blocks alternate when the old one is still referenced: with an L2 of one block, each
    write evicts the other's dirty lines."""
    a = _meta(512, 512)

    def body():
        p = a * 2
        for _ in range(4):
            q = a * 2
            p.sum()
            p = q

    step = _count(MiB + 4096, body)
    assert sum(x.written for x in step.launches if x.kernel == "mul") >= 3 * MiB


def test_a_gather_reads_the_rows_it_returns_and_a_scatter_the_rows_it_writes():
    w = _meta(100_000, 64)  # 25 MB
    idx = torch.empty(10, dtype=torch.int64, device="meta")
    src = _meta(10, 64)

    def body():
        w.index_select(0, idx)
        w.index_add_(0, idx, src)

    step = _count(50 * MiB, body)
    gather, scatter = step.launches
    assert gather.read == 10 * 64 * 4 + 80 and gather.largest == 10 * 64 * 4
    assert scatter.largest == 10 * 64 * 4 and scatter.read <= 2 * (10 * 64 * 4) + 80


HEADLINE = dict(num_classes=1_000_000, dim=512, batch=1024, world_size=1, dtype="float32", optimizer="sgd",
                weight_decay=5e-4, impl="triton", compute_dtype="bfloat16", traffic=True)


@needs_triton
def test_the_headline_step_with_the_update_in_the_backward_moves_at_most_16_GB():
    r = plan(**HEADLINE, fused_update=True)
    t = r["traffic"]
    assert t["hbm_bytes"] <= 16e9, t["hbm_bytes"]
    n, D = HEADLINE["num_classes"], HEADLINE["dim"]
    assert t["largest_torch_region"] < n * D * 2 // 16  # no torch operator near the [n, D] weight or its gradient
    kernels = {k["kernel"] for k in t["kernels"] if k["fused"]}
    assert {"lse_forward", "backward_epilogue", "weight_update"} <= kernels
    assert "weight_grad" not in kernels and not any(k["kernel"] == "_fused_sgd_" for k in t["kernels"])
    # the steady state: the forward uses the operand the last step's update wrote, no pass over W
    assert "operand_rows" not in kernels
    # the weight and its momentum, fp32, read and written once: the floor of the update's bytes;
    # and the next step's bf16 operand and its norms written
    update = next(k for k in t["kernels"] if k["kernel"] == "weight_update")
    assert update["read"] >= 2 * n * D * 4 and update["written"] >= 2 * n * D * 4 + n * D * 2 + n * 4
    # the chunks' products and H stay in L2: written there and overwritten by the next chunk's; only
    # the step's last two chunks' (the last full chunk's, whose block the smaller last chunk does not
    # reuse, and the last one's) are still dirty when the step ends: at most two chunks of products
    B = HEADLINE["batch"]
    written = {k["kernel"]: k["written"] for k in t["kernels"] if k["kernel"] == "backward_epilogue"}
    chunk = 6144  # chunks.chunk_classes at the headline (tests/head/fused/test_chunks.py)
    assert written["backward_epilogue"] <= 2 * B * chunk * 2 < 0.02 * B * n * 2
    # ... and so for H, fp32 [chunk, D]: at most the last two chunks' reach HBM
    assert sum(k["written"] for k in t["kernels"] if k["kernel"] == "mm") <= 2 * chunk * D * 4 < 0.02 * n * D * 4
    # the three GEMM shapes, over the chunks
    gemms = {k["shape"] for k in t["kernels"] if k["kernel"] in ("mm", "addmm") and k["launches"] > 1}
    assert len(gemms) == 3


@needs_triton
def test_the_unfused_step_clears_and_reads_the_gradient_and_moves_more():
    fused = plan(**HEADLINE, fused_update=True)["traffic"]
    unfused = plan(**HEADLINE)["traffic"]
    n, D = HEADLINE["num_classes"], HEADLINE["dim"]
    assert unfused["largest_torch_region"] >= n * D * 4  # the optimizer and zero_grad over the [n, D] .grad
    assert unfused["hbm_bytes"] >= fused["hbm_bytes"] + 2 * n * D * 4


@needs_triton
def test_the_operand_written_by_the_update_saves_the_pass_over_w():
    """The headline step reusing the operand the previous step's update wrote, against the same
    step making it (the first step, or a head that keeps none): the pass over W (read the fp32
    rows, write the bf16 operand) leaves; the update's extra writes (the operand and its norms)
    cost less than it; the step's memory (resting plus peak) is the same."""
    from shardfc.head.fused import chunks

    kept = plan(**HEADLINE, fused_update=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunks.NextOperand, "keep", lambda self, *a: None)
        fresh = plan(**HEADLINE, fused_update=True)
    n, D = HEADLINE["num_classes"], HEADLINE["dim"]
    passes = [k for k in fresh["traffic"]["kernels"] if k["kernel"] == "operand_rows"]
    assert len(passes) == 1 and passes[0]["read"] >= n * D * 4
    assert kept["traffic"]["hbm_bytes"] <= fresh["traffic"]["hbm_bytes"] - n * D * 4
    assert kept["step_peak"] == fresh["step_peak"]


@needs_triton
def test_the_adamw_update_in_the_backward():
    """AdamW fused into the backward: its kernel reads and writes the weight and both moments once
    (and each row's step count), no torch operator touches an ``[n, D]`` tensor, and the step moves
    the gradient's write, clear and reads (≥ 3 × 2 GB) less than with torch's fused AdamW after the
    backward."""
    adamw = dict(HEADLINE, optimizer="adamw")
    fused = plan(**adamw, fused_update=True)["traffic"]
    unfused = plan(**adamw)["traffic"]
    n, D = HEADLINE["num_classes"], HEADLINE["dim"]
    kernels = {k["kernel"]: k for k in fused["kernels"]}
    assert "adamw_update" in kernels and "weight_grad" not in kernels and "_fused_adamw_" not in kernels
    update = kernels["adamw_update"]
    assert update["read"] >= 3 * n * D * 4 + n * 8 and update["written"] >= 3 * n * D * 4 + n * 8
    assert fused["largest_torch_region"] < n * D * 2 // 16
    assert unfused["hbm_bytes"] >= fused["hbm_bytes"] + 3 * n * D * 4


@needs_triton
def test_cli_prints_the_table_and_refuses_a_fused_update_it_cannot_replay(capsys):
    assert main(["--classes", "20000", "--dim", "64", "--batch", "256", "--head-impl", "gemm", "--fused-update",
                 "--bytes", "--l2", "4MiB"]) == 0
    out = capsys.readouterr().out
    assert "HBM bytes a step" in out and "weight_update (fused)" in out and "L2 model of 4.00 MiB" in out
    assert main(["--classes", "20000", "--dim", "64", "--batch", "256", "--head-impl", "gemm", "--fused-update",
                 "--optimizer", "adamw", "--bytes"]) == 0
    assert "adamw_update (fused)" in capsys.readouterr().out
    assert main(["--classes", "1000", "--dim", "64", "--batch", "64", "--fused-update"]) == 2
    assert "fused_update needs impl 'triton' or 'gemm'" in capsys.readouterr().err
    assert main(["--classes", "1000", "--dim", "64", "--batch", "64", "--bytes", "--l2", "lots"]) == 2
    assert "l2_bytes must be a byte count" in capsys.readouterr().err


def test_streamed_regions_go_to_and_from_hbm_and_keep_out_of_the_l2_model():
    """What a kernel loads and stores ``evict_first`` (the rows a row kernel streams: issue 42) is read
    from HBM and written to it, and takes no room in the L2 model: a region read normally afterwards
    still misses, and what was cached before stays cached."""
    from shardfc.head.fused.traffic import span, streamed

    counter = TrafficCounter(4 * MiB)
    reused, rows = _meta(256, 1024), _meta(512, 1024)  # 1 MiB reused, 2 MiB streamed
    counter.kernel("first", [span(reused)], [])
    counter.kernel("stream", streamed([span(rows)]), streamed([span(rows)]))
    counter.kernel("again", [span(reused), span(rows)], [])
    first, stream, again = counter.finish().launches
    assert (first.read, stream.read, stream.written) == (MiB, 2 * MiB, 2 * MiB)
    assert (again.from_l2, again.read) == (MiB, 2 * MiB)  # the reused block stayed; the streamed rows were never cached


def test_chunk_candidates_take_the_slower_of_gpu_and_host_and_pick_the_least():
    from shardfc.tools.plan.traffic import HOST_LAUNCH_US, chunk_candidates, format_chunk_candidates

    def run(launches, ms, peak):
        return dict(launches=launches, hbm_bytes=launches * 10, ms=ms), peak

    # scale 1: GPU-bound; 2: host-bound below 1's GPU time; 4: ties 2 (the smaller scale wins)
    host = lambda n: n * HOST_LAUNCH_US / 1e3  # noqa: E731
    runs = {1: run(1000, 10.0, 100), 2: run(900, 5.0, 200), 4: run(900, 7.2, 300), 8: run(200, 20.0, 400)}
    c = chunk_candidates(runs)
    rows = {r["scale"]: r for r in c["rows"]}
    assert [r["scale"] for r in c["rows"]] == [1, 2, 4, 8] and c["host_launch_us"] == HOST_LAUNCH_US
    assert rows[2]["host_ms"] == pytest.approx(host(900)) and rows[2]["step_ms"] == pytest.approx(max(5.0, host(900)))
    assert rows[1]["step_ms"] == 10.0 and rows[8]["step_ms"] == 20.0 and rows[4]["step_peak"] == 300
    assert c["pick"] == 2  # 7.2 ms for 2 and 4 (host-bound), less than 10: the smaller of the two
    text = format_chunk_candidates(c)
    assert "| 2 (picked) | 900 |" in text and "| 4 | 900 |" in text and "on paper: scale 2;" in text


@needs_triton
def test_plan_bytes_prints_every_chunk_scale_and_refuses_a_scale_it_cannot_take(capsys):
    args = ["--classes", "20000", "--dim", "64", "--batch", "64", "--head-impl", "gemm", "--fused-update", "--bytes"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Chunk sizes (the GPU paths' chunks as multiples of the L2-sized one" in out
    assert all(f"\n| {s}" in out for s in (1, 2, 4, 8)) and "(picked)" in out
    assert main(args + ["--gpu-chunk-scale", "4"]) == 0 and "chunk 4x the L2-sized one" in capsys.readouterr().out
    assert main(args + ["--gpu-chunk-scale", "3"]) == 2
    assert "gpu_chunk_scale must be one of (1, 2, 4, 8), got 3" in capsys.readouterr().err
    assert main(["--classes", "100", "--dim", "8", "--batch", "4", "--gpu-chunk-scale", "2"]) == 2
    assert "gpu_chunk_scale sizes the GPU paths' chunks: it needs impl 'triton' or 'gemm'" in capsys.readouterr().err


def test_a_kernels_span_and_an_operators_view_of_the_same_bytes_are_one_region():
    """A span's part is its byte offset (not its element offset): the rows a kernel read at an offset
    are the rows a torch operator's view of them reads next, from L2."""
    from shardfc.head.fused.traffic import span

    counter = TrafficCounter(4 * MiB)
    mode = _MetaStep()
    mode.observer = counter
    w = _meta(1024, 256)
    rows = w[256:512]  # 256 KiB at byte offset 256 KiB
    with mode:
        counter.kernel("read", [span(rows)], [])
        rows.sum()
    kernel, op = counter.finish().launches
    assert (kernel.read, op.from_l2, op.read) == (256 * 1024, 256 * 1024, 0)


def test_gathered_rows_are_keyed_on_their_index_rows_and_count_only_their_bytes():
    """``gathered`` through an index tensor: ``n`` rows of ``w``'s width and element size; the same
    index rows (even through another view of the index tensor) are the same region, other ones not."""
    from shardfc.head.fused.traffic import gathered

    counter = TrafficCounter(4 * MiB)
    w, idx = _meta(4096, 256), _meta(64, dtype=torch.int64)
    row_bytes = 256 * 4
    counter.kernel("first", [gathered(w, idx, 32, 16)], [])
    counter.kernel("same rows, another view", [gathered(w, idx[16:], 16, 16)], [])
    counter.kernel("other rows", [gathered(w, idx, 0, 16)], [])
    counter.kernel("fewer rows", [gathered(w, idx, 32, 8)], [])
    first, same, other, fewer = counter.finish().launches
    assert (first.read, first.from_l2) == (16 * row_bytes, 0)
    assert (same.read, same.from_l2) == (0, 16 * row_bytes)
    assert (other.read, other.from_l2) == (16 * row_bytes, 0)
    assert (fewer.read, fewer.from_l2) == (8 * row_bytes, 0)


def test_note_passes_each_launch_to_the_recorder_with_its_flops_zero_unless_told():
    from shardfc.head.fused.traffic import note, recording

    seen = []
    note("outside", [], [])
    with recording(lambda *launch: seen.append(launch)):
        note("bare", [], [])
        note("gemm", [], [], 6.0)
    note("after", [], [])
    assert seen == [("bare", [], [], 0.0), ("gemm", [], [], 6.0)]
