"""``shardfc bench``: the shared run of tests/tools/conftest.py (2 gloo ranks, every variant), the
table and JSON it writes, and argument checking before anything is spawned."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import asdict

import pytest
import torch.distributed as dist

from shardfc.cli.bench import main
from shardfc.head.catch_up import SGDClock
from shardfc.tools.bench import FIELDS, VARIANTS, local_batch_sizes, run_bench, runner
from shardfc.tools.bench.memory import LiveTensorBytes
from shardfc.tools.bench.report import MEASURES, markdown_table


def test_cli_succeeds_and_prints_table(bench_run):
    assert bench_run["code"] == 0, bench_run["stderr"]
    table = bench_run["stdout"]
    assert "| variant | step time (s) |" in table
    assert f"memory measure: cpu_live_tensors — {MEASURES['cpu_live_tensors']}" in table
    for v in VARIANTS:
        assert f"| {v} |" in table
    assert "[bench]" in bench_run["stderr"]  # progress on stderr


def test_json_has_exactly_the_documented_fields(bench_run):
    results = json.loads(bench_run["json"].read_text())
    assert [r["variant"] for r in results] == list(VARIANTS)
    for r in results:
        assert tuple(r) == FIELDS
        assert r["step_time_s"] > 0 and r["floor_ratio"] > 0
        peaks = r["peak_bytes_per_rank"]
        assert len(peaks) == bench_run["sizes"]["W"] and all(isinstance(p, int) and p > 0 for p in peaks)
        assert r["balance"] == pytest.approx(max(peaks) / min(peaks))
        assert isinstance(r["comm_bytes_per_rank"], int) and r["comm_bytes_per_rank"] > 0


def test_peaks_rank_the_variants(bench_run):
    """What the variants exist to show: the naive head's rank 0 holds every rank's logits, the
    chunked head far less than the sharded one."""
    peak = {v: r["peak_bytes_per_rank"] for v, r in bench_run["results"].items()}
    B, C, W = (bench_run["sizes"][k] for k in "BCW")
    # the gathered [B, C] logits live on rank 0 only: above what any other rank holds by at least the
    # part that is not that rank's own [B, C / W] shard (a ratio of the two peaks is not: the other
    # ranks' peak moves with the collectives' buffers, 1.44x of it was seen)
    assert peak["naive"][0] > B * C * 4
    assert min(peak["naive"][0] - p for p in peak["naive"][1:]) >= B * C * 4 * (1 - 1 / W)
    assert peak["sharded"][0] > B * (C // W) * 4 > 2 * peak["chunked"][0]
    assert peak["partial"][0] < peak["sharded"][0] / 2


def test_sharded_traffic_is_two_embedding_matrices_plus_statistics(bench_run):
    B, D = bench_run["sizes"]["B"], bench_run["sizes"]["D"]
    target = 2 * B * D * 4 + 3 * B * 4 + B * 8
    for v in ("sharded", "chunked", "partial"):
        assert abs(bench_run["results"][v]["comm_bytes_per_rank"] - target) <= 0.05 * target


def test_plot_is_a_png(bench_run):
    data = bench_run["png"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_one_head_at_a_time(tmp_path, monkeypatch):
    """The worker (run here as the only rank) builds each variant's head, for memory then for
    time, only once the previous one is gone, and its matmul floor copies none of the head.
    (Three variants: the floors of naive and sharded have chunked's shapes.)"""
    variants = ("replicated", "chunked", "partial")
    cfg = asdict(runner._check_config(1, 8, 16, 2000, variants, 1, 1, 0.5, 64, "float32", "arcface", False))
    at_build, at_floor = [], []
    with LiveTensorBytes() as mode:
        real_build, real_time = runner._build, runner._Floor.time

        def build(*args):
            at_build.append(mode.current)
            return real_build(*args)

        def floor_time(floor, head):
            with LiveTensorBytes() as inner:
                dt = real_time(floor, head)
            idle = SGDClock.bound_nbytes(head.weight) if getattr(head, "sample_rate", 1.0) < 1 else 0
            at_floor.append((mode.current, head.weight.untyped_storage().nbytes(), inner.peak, floor, idle))
            return dt

        monkeypatch.setattr(runner, "_build", build)
        monkeypatch.setattr(runner._Floor, "time", floor_time)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            with LiveTensorBytes() as probe:  # what the floor's barrier leaves alive: torch 2.11's gloo, 1 byte
                dist.barrier()
            barrier_left = probe.current
            out = runner._bench_worker(0, 1, cfg)
        finally:
            dist.destroy_process_group()
    assert list(out["variants"]) == list(variants) and len(at_build) == 2 * len(variants)
    assert max(at_build) < 16 * 1024  # nothing of a previous variant's head, optimizer or buffers
    for live, weight, peak, floor, idle in at_floor:
        # the head's weight, gradient, momentum, small inputs; Partial FC's idle-row clock (its step
        # table is made at its longest, 65 KB, so that a captured step's graph holds one address)
        assert live <= 3 * weight + idle + 16 * 1024
        rows, classes, d = floor.rows, floor.classes, 16
        # dZ, a·Wᵀ, dZ·W, dZᵀ·a only
        assert peak == 4 * (2 * rows * classes + rows * d + classes * d) + barrier_left


def test_local_batches_split_the_global_batch():
    assert local_batch_sizes(9, 2) == [5, 4]
    assert local_batch_sizes(10, 4) == [3, 3, 2, 2]
    assert local_batch_sizes(3, 4) == [1, 1, 1, 0]


def test_markdown_table_of_results():
    results = [dict(variant="sharded", step_time_s=0.5, peak_bytes_per_rank=[2**20, 2**21], balance=2.0, comm_bytes_per_rank=10, floor_ratio=1.5)]
    text = markdown_table(results)
    assert "| sharded | 0.5000 | 1.0 / 2.0 | 2.000 | 10 | 1.50 |" in text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--world-size", "0"], "world_size"),
        (["--variants", "sharded,bogus"], "bogus"),
        (["--variants", "sharded,sharded"], "at most once"),
        (["--sample-rate", "1.5", "--variants", "partial"], "sample_rate must be in (0, 1], got 1.5"),
        (["--sample-rate", "0", "--variants", "partial_lazy"], "sample_rate must be in (0, 1], got 0.0"),
        (["--chunk-size", "0"], "chunk_size"),
        # a setting of a variant that is not run was dropped silently
        (["--sample-rate", "0.05"], "sample_rate=0.05 applies to the partial variants, not to variants "
                                    "['sharded', 'chunked']"),
        (["--chunk-size", "64", "--variants", "sharded,partial"], "chunk_size=64 applies to the chunked variant, not "
                                                                  "to variants ['sharded', 'partial']"),
        (["--steps", "0"], "steps"),
        (["--warmup", "-1"], "warmup"),
        (["--dtype", "float8"], "dtype"),
        (["--classes", "1"], "classes"),
        # NCCL without a CUDA device per rank: every rank failed to join, three launches in a row, and the
        # error was a ZeroDivisionError from inside a rank
        (["--backend", "nccl", "--world-size", "9"], "backend 'nccl' needs a CUDA device per rank: world_size=9 but"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(extra, message):
    argv = ["--world-size", "2", "--batch", "4", "--dim", "4", "--classes", "10", "--steps", "1"]
    for i in range(0, len(extra), 2):
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i : i + 2]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 2
    assert message in err.getvalue()


def test_missing_required_argument_exits_2():
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["--world-size", "2"]) == 2


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(batch=0), "batch"),
        (dict(dim=-1), "dim"),
        (dict(variants=[]), "variants"),
        (dict(sample_rate=2.0, variants="partial"), "sample_rate must be in"),
        (dict(sample_rate=0.5), "sample_rate=0.5 applies to the partial variants"),
        (dict(chunk_size=-3, variants="chunked"), "chunk_size must be"),
        (dict(chunk_size="big", variants="chunked"), "chunk_size must be"),
        (dict(chunk_size=8), "chunk_size=8 applies to the chunked variant"),
        (dict(margin="nope"), "nope"),
    ],
)
def test_run_bench_rejects_bad_arguments_before_spawning(kwargs, name):
    args = dict(world_size=2, batch=4, dim=4, classes=10, variants="sharded", steps=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        run_bench(**args)


def test_the_variants_settings_default_to_the_documented_values():
    cfg = runner._check_config(2, 4, 4, 10, "chunked,partial", 1, 0, None, None, "float32", "arcface", False)
    assert (cfg.sample_rate, cfg.chunk_size) == (0.1, 1024)  # bench --help: (default 0.1), (default 1024)


@pytest.mark.parametrize("variants, rate", [("sharded,chunked", None), ("partial", 1.0)])
def test_sparse_grad_needs_the_partial_variant_below_rate_1(variants, rate):
    from shardfc.tools.bench.runner import run_bench

    with pytest.raises(ValueError, match="sparse_grad applies to the partial variant"):
        run_bench(2, 4, 4, 10, variants=variants, sample_rate=rate, sparse_grad=True, progress=False)
