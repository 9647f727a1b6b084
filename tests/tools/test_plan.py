"""``shardfc.tools.plan``: the plan is the real head's step replayed on the meta device.

It equals the same step measured on real CPU tensors, it follows a change in the head's buffers
by itself, it matches what ``shardfc bench`` measures on 2 gloo ranks within 10% (the shared run of
conftest.py), its parts add up, the largest C and B fit the budget, and errors are clear."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import pickle

import pytest
import torch
import torch.distributed as dist

import shardfc.head.function as head_function
from shardfc.cli.plan import main
from shardfc.head import catch_up
from shardfc.tools import plan as plan_module
from shardfc.tools.plan import PARTS, parse_bytes, plan
from shardfc.tools.plan import replay as replay_module


# --------------------------------------------------------------------------- the plan is the step
@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(grads_kept=False),
        dict(sample_rate=0.25),
        dict(sample_rate=0.25, grads_kept=False, optimizer="adamw"),
        dict(optimizer="adamw"),
        dict(dtype="bfloat16", margin="sphereface"),
        dict(dtype="float64", margin="softmax", sample_rate=0.25),
        dict(chunk_size=256),
        dict(chunk_size=256, grads_kept=False),
        dict(sample_rate=0.25, sparse_grad=True),
        dict(sample_rate=0.25, sparse_grad=True, chunk_size=256, dtype="bfloat16", optimizer="adamw"),
        dict(sample_rate=0.25, sparse_grad=True, grads_kept=False, dtype="float16"),
        dict(dtype="bfloat16", optimizer="adamw"),
        dict(subcenters=3),
        dict(subcenters=2, sample_rate=0.25, sparse_grad=True, dtype="bfloat16"),
        dict(subcenters=3, sample_rate=0.25, chunk_size=256, optimizer="adamw"),
    ],
)
def test_plan_equals_the_step_measured_on_real_tensors(options, measured_step_peak):
    """W = 1: the replay on meta tensors allocates what the real CPU step does, byte for byte, but
    for the chunked loop, where the replay puts every target in every chunk (a few [B] index
    tensors more)."""
    options = dict(options)
    kept = options.pop("grads_kept", True)
    optimizer = options.pop("optimizer", "sgd")
    predicted = plan(4000, 32, 64, 1, optimizer=optimizer, grad_in_place=kept, **options)["step_peak"]
    measured = measured_step_peak(4000, 32, 64, kept, optimizer, **options)
    if "chunk_size" in options:
        assert measured <= predicted <= measured + 16 * 64 * 8
    else:
        assert predicted == measured


def test_plan_follows_a_change_in_the_head(monkeypatch):
    """A kernel that keeps one more [B, n] buffer from the forward to the backward: the plan grows
    by exactly its bytes, with nothing in the planner told about it."""
    C, D, B, W = 40_000, 64, 256, 2
    before = plan(C, D, B, W)
    real_forward = head_function.shard_forward

    def forward_with_an_extra_buffer(a, w, local_labels, norms, cfg, rows=None):
        stats = real_forward(a, w, local_labels, norms, cfg)
        stats.extra = torch.empty(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
        return stats

    monkeypatch.setattr(head_function, "shard_forward", forward_with_an_extra_buffer)
    after = plan(C, D, B, W)
    extra = B * math.ceil(C / W) * 4
    assert after["step_peak"] - before["step_peak"] == extra
    assert after["parts"]["activations"] - before["parts"]["activations"] == extra
    assert after["parts"]["communication"] == before["parts"]["communication"]


def test_a_replay_shows_a_bar_of_its_operators_on_a_terminal(bars):
    """A step at 10^9 classes replays a million operators (minutes with --bytes): one bar a replay,
    named by its classes and batch, advanced every BAR_EVERY operators and closed at the end; the
    plan is the same with it."""
    ops = []

    class Counted(replay_module._MetaStep):  # the operators the replay ran, counted apart from the bar
        def _call(self, func, args, kwargs):
            ops.append(func)
            return super()._call(func, args, kwargs)

    plain_kwargs = dict(num_classes=50_000, dim=16, batch=8, world_size=2, chunk_size=1000)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replay_module, "_MetaStep", Counted)
        with_bar = plan(**plain_kwargs)
    assert [(kw["desc"], kw["unit"], kw["total"], kw["closed"]) for kw in bars] == [
        ("replaying a step of 50,000 classes, batch 8", "op", None, True)]
    every = replay_module.BAR_EVERY
    assert len(ops) >= 2 * every and bars[0]["updated"] == len(ops) // every * every  # 25 chunks: thousands
    assert plan(**plain_kwargs) == with_bar and len(bars) == 2


def test_a_value_the_replay_cannot_know_is_an_error(monkeypatch):
    real_forward = head_function.shard_forward

    def forward_reading_a_value(a, w, local_labels, norms, cfg, rows=None):
        int(local_labels.sum())
        return real_forward(a, w, local_labels, norms, cfg)

    monkeypatch.setattr(head_function, "shard_forward", forward_reading_a_value)
    with pytest.raises(replay_module.ReplayError, match="_local_scalar_dense"):
        plan(1000, 16, 32, 2)
    assert not dist.is_initialized()  # the fake group is gone even so


def test_remembered_shapes_change_nothing(monkeypatch):
    configs = [dict(chunk_size=300), dict(sample_rate=0.1, grad_in_place=False)]
    cached = [plan(20_000, 32, 96, 3, **c) for c in configs]
    monkeypatch.setattr(replay_module._MetaStep, "call", lambda self, func, args, kwargs: self._run(func, args, kwargs))
    assert [plan(20_000, 32, 96, 3, **c) for c in configs] == cached


def test_collective_buffers_are_communication():
    C, D, B = 40_000, 64, 256
    single, two = plan(C, D, B, 1), plan(C, D, B, 2)
    assert single["parts"]["communication"] == 0
    # at the backward's peak: the gathered [B, D] embeddings and the rank's own [B/2, D] it sent
    # (both saved for the backward), the [B, D] gradient to reduce-scatter, the gathered labels and
    # the [B] statistics
    matrices = 2 * B * D * 4 + B // 2 * D * 4
    assert matrices <= two["parts"]["communication"] <= matrices + 16 * B


def test_no_process_group_is_left_behind():
    plan(1000, 16, 32, 4)
    assert not dist.is_initialized()


def test_in_a_process_group_the_replay_runs_in_a_fresh_process(monkeypatch, tmp_path):
    calls = []

    def fresh(fn, *args, **kwargs):
        pickle.dumps((fn, args, kwargs))  # what the spawned process receives
        calls.append(fn)
        return "from a fresh process"

    monkeypatch.setattr(plan_module, "_in_fresh_process", fresh)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert plan(1000, 16, 32, 2) == "from a fresh process" and calls == [plan]
        assert dist.is_initialized() and dist.get_world_size() == 2 - 1  # the caller's group, untouched
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- plan vs bench
@pytest.mark.parametrize("variant", ["sharded", "chunked", "partial"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16 + sparse gradient"])
def test_plan_matches_bench_within_10_percent(request, variant, precision):
    """The bench's CPU measure counts live tensors on every machine: no skip."""
    bf16 = precision != "float32"
    run = request.getfixturevalue("bench_run_bf16_sparse" if bf16 else "bench_run")
    assert run["code"] == 0, run["stderr"]
    s = run["sizes"]
    partial = dict(sample_rate=s["RATE"], sparse_grad=True) if bf16 else dict(sample_rate=s["RATE"])
    options = {"chunked": dict(chunk_size=s["CHUNK"]), "partial": partial}.get(variant, {})
    dtype = "bfloat16" if bf16 else "float32"
    predicted = plan(s["C"], s["D"], s["B"], s["W"], dtype, "sgd", grad_in_place=True, **options)["step_peak"]
    measured = max(run["results"][variant]["peak_bytes_per_rank"])
    assert abs(measured - predicted) <= 0.10 * predicted, (variant, measured, predicted)


# --------------------------------------------------------------------------- parts
CONFIGS = [
    dict(num_classes=40_000, dim=64, batch=256, world_size=2),
    dict(num_classes=40_000, dim=64, batch=256, world_size=2, chunk_size=1024),
    dict(num_classes=100_003, dim=128, batch=1000, world_size=8, chunk_size=4096, dtype="bfloat16"),
    dict(num_classes=100_000, dim=128, batch=255, world_size=3, sample_rate=0.1, optimizer="adamw"),
    dict(num_classes=100_000, dim=128, batch=255, world_size=3, optimizer="adamw"),
    dict(num_classes=5000, dim=32, batch=64, world_size=1, optimizer="sgd_nomomentum", margin="softmax"),
    dict(num_classes=50_000, dim=64, batch=128, world_size=4, weight_decay=5e-4, chunk_size="auto", chunk_budget_bytes=2**18),
]


@pytest.mark.parametrize("grads_kept", [True, False])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_parts_add_up(cfg, grads_kept):
    r = plan(**cfg, grad_in_place=grads_kept)
    parts = r["parts"]
    assert set(parts) == set(PARTS) and r["grad_in_place"] is grads_kept
    assert r["total"] == sum(parts.values()) == r["resting"] + r["step_peak"]
    n = math.ceil(cfg["num_classes"] / cfg["world_size"])
    assert r["n_local"] == n and r["local_batch"] == math.ceil(cfg["batch"] / cfg["world_size"])
    s = {"float32": 4, "bfloat16": 2}[cfg.get("dtype", "float32")]
    nd = n * cfg["dim"] * s
    assert parts["weights"] == nd
    sparse = cfg.get("sample_rate", 1.0) < 1.0
    state = {"sgd": nd, "sgd_nomomentum": 0, "adamw": 2 * nd + (8 * n if sparse else 4)}  # + per-row / scalar step
    name = cfg.get("optimizer", "sgd")
    if sparse:  # the exact idle-row update: a 4-byte stamp a row and a step table at its longest
        entry = 8 if name == "adamw" else 4
        state[name] += 4 * n + (catch_up.FULL_CATCH_UP_EVERY + 2) * entry * 8
    assert parts["optimizer_state"] == state[name]
    if grads_kept:  # the [n, D] .grad rests like the weights; the step adds into it
        assert parts["gradients"] == nd
        assert r["resting"] == parts["weights"] + parts["gradients"] + parts["optimizer_state"]
        assert r["step_peak"] == parts["activations"] + parts["communication"]
    else:  # the step allocates it: part of the peak if alive then (not when the forward peaks)
        assert parts["gradients"] in (0, nd)
        assert r["resting"] == parts["weights"] + parts["optimizer_state"]
        assert r["step_peak"] == parts["gradients"] + parts["activations"] + parts["communication"]


def test_model_shapes():
    base = dict(num_classes=100_000, dim=128, batch=256, world_size=4)
    n = 25_000
    full = plan(**base)["step_peak"]
    chunked = plan(**base, chunk_size=1024)["step_peak"]
    partial = plan(**base, sample_rate=0.1)
    assert chunked < full / 8 and partial["step_peak"] < full / 4
    assert partial["n_sampled"] == 2500 and partial["n_local"] == n
    # the unchunked peak holds the [B, n] logits: it grows with B, the chunked one by far less
    assert plan(**{**base, "batch": 512})["step_peak"] - full >= 256 * n * 4
    assert plan(**{**base, "batch": 512}, chunk_size=1024)["step_peak"] - chunked < 256 * n * 4 / 8


def test_gradients_kept_or_not():
    base = dict(num_classes=400_000, dim=128, batch=256, world_size=4)
    grad = 100_000 * 128 * 4  # the [n, D] weight gradient of rank 0
    # kept: nothing of size [n, D] in the step (chunked: O(B·chunk) and [block, D] blocks)
    chunked = plan(**base, chunk_size=1024)
    assert chunked["step_peak"] < grad / 8
    # not kept: the step allocates the gradient
    freed = plan(**base, chunk_size=1024, grad_in_place=False)
    assert freed["step_peak"] > grad and freed["parts"]["gradients"] == grad
    assert abs(freed["total"] - chunked["total"]) < grad * 0.05  # the same bytes, resting or not
    # Partial FC: index_add_ into .grad, or a dense zeros [n, D]
    assert plan(**base, sample_rate=0.1)["step_peak"] < grad / 2
    assert plan(**base, sample_rate=0.1, grad_in_place=False)["step_peak"] > grad


# --------------------------------------------------------------------------- budget
@pytest.mark.parametrize("chunk", [None, 1024])
def test_largest_classes_and_batch_fit_the_budget(chunk):
    base = dict(dim=256, batch=128, world_size=2, chunk_size=chunk)
    r = plan(num_classes=10_000, budget_bytes="32MiB", **base)
    budget = r["budget_bytes"]
    assert budget == 32 * 2**20 and r["fits"]
    c = r["max_classes"]
    assert plan(num_classes=c, **base)["total"] <= budget < plan(num_classes=c + 1, **base)["total"]
    b = r["max_batch"]
    assert plan(num_classes=10_000, **{**base, "batch": b})["total"] <= budget
    assert plan(num_classes=10_000, **{**base, "batch": b + 1})["total"] > budget
    bigger = plan(num_classes=10_000, budget_bytes="48MiB", **base)
    assert bigger["max_classes"] > c and bigger["max_batch"] > b  # monotone in the budget


def test_largest_finds_the_boundary_of_any_nondecreasing_total():
    def check(f, budget):
        calls = []

        def total(x):
            calls.append(x)
            assert len(calls) < 200, "the search does not converge"
            return f(x)

        x = plan_module._largest(total, budget, 1)
        assert f(x) <= budget < f(x + 1)

    check(lambda x: 1000 + 384 * x, 17_179_868_428)
    check(lambda x: 1000 + 641 * min(x, 2048) + 384 * x + 7 * -(-x // 4), 10**10)
    check(lambda x: x * x, 10**12)
    check(lambda x: 5 * (x // 100), 10**9)
    check(lambda x: 100 if x < 50 else 10**20, 1000)


def test_budget_holding_weights_but_no_batch_reports_zero():
    r = plan(num_classes=2_000_000, dim=32, batch=256, world_size=1, budget_bytes="600MiB")
    assert not r["fits"] and r["max_batch"] == 0 and r["max_classes"] < 2_000_000


def test_budget_too_small_for_one_class():
    with pytest.raises(ValueError, match="too small for even one class"):
        plan(num_classes=1000, dim=128, batch=256, world_size=2, budget_bytes=1000)


# --------------------------------------------------------------------------- arguments and CLI
@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(chunk_size=0), "chunk_size must be a positive integer, 'auto' or None, got 0"),
        (dict(chunk_size=-5), "chunk_size must be a positive integer, 'auto' or None, got -5"),
        (dict(sample_rate=0.0), "sample_rate must be in (0, 1], got 0.0"),
        (dict(sample_rate=1.5), "sample_rate must be in (0, 1], got 1.5"),
        (dict(optimizer="lamb"), "optimizer"),
        (dict(dtype="int8"), "dtype"),
        (dict(world_size=0), "world_size"),
        (dict(budget_bytes="lots"), "budget"),
        (dict(memory_model="resident"), "'resident' model was removed"),
        (dict(grad_in_place="yes"), "grad_in_place"),
        (dict(sparse_grad=True), "sparse_grad needs Partial FC"),
        (dict(sparse_grad=1, sample_rate=0.5), "sparse_grad must be True or False"),
        (dict(subcenters=0), "subcenters must be a positive integer, got 0"),
        (dict(impl="auto"), "impl must be one of torch, triton, gemm, got 'auto'"),
        (dict(impl="triton", sms=0), "sms must be a positive integer, got 0"),
        (dict(margin="nope"), "nope"),
    ],
)
def test_bad_arguments(kwargs, text):
    args = dict(num_classes=1000, dim=64, batch=32, world_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        plan(**args)
    assert text in str(e.value)


def test_parse_bytes():
    assert parse_bytes("16GiB") == 16 * 2**30 == parse_bytes("16G")
    assert parse_bytes("500MB") == 500_000_000
    assert parse_bytes("1e9") == 10**9 and parse_bytes(123) == 123


def test_cli_prints_a_table(tmp_path):
    out, path = io.StringIO(), tmp_path / "plan.json"
    argv = ["--classes", "20000", "--dim", "128", "--batch", "256", "--world-size", "4", "--chunk-size", "1024",
            "--budget", "32MiB", "--json", str(path)]
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    text = out.getvalue()
    for label in ("weights", "gradients", "optimizer state", "logits / activations", "communication buffers", "largest C", "largest global B"):
        assert label in text
    kept = json.loads(path.read_text())
    assert kept["grad_in_place"] is True and kept == plan(20_000, 128, 256, 4, chunk_size=1024, budget_bytes="32MiB")
    assert "gradients + optimizer state" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv[:-2] + ["--no-grads-kept", "--json", str(path)]) == 0
    assert "gradients freed between steps" in out.getvalue()
    freed = json.loads(path.read_text())
    assert freed["grad_in_place"] is False and freed["step_peak"] > freed["parts"]["gradients"] > 0
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["--classes", "10", "--dim", "4", "--batch", "4", "--chunk-size", "0"]) == 2
        assert main(["--classes", "10", "--dim", "4", "--batch", "4", "--sample-rate", "2"]) == 2
        assert main(["--classes", "10", "--dim", "4", "--batch", "4", "--budget", "10"]) == 2
    assert "chunk_size" in err.getvalue() and "sample_rate" in err.getvalue() and "one class" in err.getvalue()


def test_subcenters_count_classes_and_cost_k_rows_each():
    """K = 3: the same classes (n_local, n_sampled), three weight rows and their state each; the CLI
    passes --subcenters through."""
    base = dict(num_classes=9_000, dim=32, batch=64, world_size=3, sample_rate=0.1, sparse_grad=True)
    one, three = plan(**base), plan(**base, subcenters=3)
    assert three["n_local"] == one["n_local"] == 3_000 and three["n_sampled"] == one["n_sampled"]
    assert three["parts"]["weights"] == 3 * one["parts"]["weights"] == 3 * 3_000 * 32 * 4
    table = (catch_up.FULL_CATCH_UP_EVERY + 2) * catch_up.SGDClock.ENTRY * 8  # the idle-row table: one a shard
    assert three["parts"]["optimizer_state"] - table == 3 * (one["parts"]["optimizer_state"] - table)
    assert three["parts"]["optimizer_state"] - table == 3 * 3_000 * (32 * 4 + 4)  # momentum and a stamp a row
    assert three["bytes_per_class"] == pytest.approx(3 * one["bytes_per_class"] - 2 * table / 3_000)
    # the compact gradient: K rows per sampled class
    assert three["parts"]["gradients"] == 3 * one["parts"]["gradients"] == 3 * one["n_sampled"] * 32 * 4
    out = io.StringIO()
    argv = ["--classes", "9000", "--dim", "32", "--batch", "64", "--world-size", "3", "--sample-rate", "0.1",
            "--sparse-grad", "--subcenters", "3"]
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    assert "3 sub-centres per class" in out.getvalue()
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(argv[:-1] + ["0"]) == 2
    assert "subcenters must be a positive integer, got 0" in err.getvalue()


# --------------------------------------------------------------------------- the fused kernels' step
# (equal to the fused step measured on real tensors: tests/head/fused/test_fused_plan.py)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the test extra)")


@needs_triton
@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_fused_plan_holds_no_logits(impl):
    """The GPU step's activations are a few class chunks' buffers plus, per class, its row in the
    compute dtype (the step's GEMM operand: 4·D bytes in fp32) and a few bytes (its inverse norm,
    the forward's partial statistics), where the torch step grows by a [B, n] fp32 buffer. Above
    chunks.OPERAND_BYTES (here at a million classes) each chunk makes its own operand instead, and
    the step holds a few hundred MiB, not the torch path's 3.9 GiB."""
    D, B = 512, 1024
    n = 33 * 128 * 30  # 126,720 classes: 33 splits of 3,840 at 132 SMs (a multiple of the 128-class quantum)
    one, two = (plan(c, D, B, impl=impl) for c in (n, 2 * n))
    # per class: its operand row, its inverse norm and (gemm) the forward's [B, splits] partial
    # statistics, 16 splits of 640 classes per L2-sized chunk: 3 arrays x 4 bytes x B / 640 ≈ 19 bytes
    assert 4 * D * n < two["parts"]["activations"] - one["parts"]["activations"] <= (4 * D + 8 + 12 * B / 640) * n
    assert plan(n, D, B)["parts"]["activations"] >= B * n * 4 > one["parts"]["activations"]
    big = plan(1_000_000, D, B, impl=impl)
    assert big["step_peak"] < 300 * 2**20 and plan(1_000_000, D, B)["step_peak"] > 3 * 2**30


@needs_triton
def test_fused_plan_sizes_the_partial_sums_by_sms():
    """The fused forward's [B, splits] fp32 partial statistics (max, sum-exp) follow the SM count
    (4 programs per SM over B/64 row tiles); the step's peak is the backward's chunk buffers, which
    do not, so the plan at twice the SMs is no smaller."""
    D, B, n = 512, 1024, 33 * 128 * 30
    at = {sms: plan(n, D, B, impl="triton", sms=sms) for sms in (132, 264)}
    assert at[264]["parts"]["activations"] >= at[132]["parts"]["activations"]
    assert at[132]["sms"] == 132 and plan(n, D, B)["sms"] is None


@needs_triton
def test_fused_plan_cli_and_its_errors(monkeypatch):
    out = io.StringIO()
    argv = ["--classes", "20000", "--dim", "128", "--batch", "256", "--world-size", "4"]
    with contextlib.redirect_stdout(out):
        assert main(argv + ["--head-impl", "triton", "--sms", "114"]) == 0  # (--chunk-size: the torch path's only)
        assert main(argv) == 0
    fused_text, torch_text = out.getvalue().split("| **total**", 2)[0], out.getvalue()
    assert "impl triton, 114 SMs" in fused_text and "chunk 1x the L2-sized one" in fused_text
    assert "--head-impl triton or gemm plans those" in torch_text.split("head: C=")[-1]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv + ["--head-impl", "triton", "--dtype", "float64"]) == 2
        assert main(argv + ["--head-impl", "triton", "--dim", "2048"]) == 0  # no width limit any more
    assert "impl='triton' cannot run: the kernels keep fp32 statistics" in err.getvalue()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ValueError, match=r"impl='triton' replays the GPU kernels' step, which needs Triton installed"):
        plan(1000, 64, 32, impl="triton")


@needs_triton
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_gpu_plan_replays_the_fused_optimizer_a_cuda_run_builds(optimizer, monkeypatch):
    """fp32 centres on CUDA get torch's fused SGD/AdamW (head_optimizer), which update in place; the
    unfused step (the CPU's) allocates a gradient's size or two (weight decay, AdamW's denominator):
    at a million classes, where the GPU forward holds a few hundred MiB, that is the step's peak."""
    args = dict(num_classes=1_000_000, dim=512, batch=64, optimizer=optimizer, weight_decay=5e-4, impl="triton")
    fused = plan(**args)
    weights = fused["parts"]["weights"]  # 1.95 GiB
    monkeypatch.setattr(replay_module, "fused_as_on_cuda", contextlib.nullcontext)
    unfused = plan(**args)
    assert fused["step_peak"] < weights / 2 and unfused["step_peak"] >= weights
    assert fused["resting"] == unfused["resting"]  # the same state: momentum, or AdamW's two moments


def test_the_fused_sgd_step_allocates_nothing_on_real_tensors():
    """The replay's rule for torch's fused SGD (no meta kernel: in place, nothing allocated), checked
    against the fused kernel on real CPU tensors; the unfused step with weight decay allocates."""
    from shardfc.tools.bench.memory import LiveTensorBytes

    for fused, expected in ((True, 0), (None, 1000 * 16 * 4)):
        p = torch.nn.Parameter(torch.randn(1000, 16))
        p.grad = torch.randn(1000, 16)
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=5e-4, fused=fused, foreach=False)
        opt.step()  # the momentum buffer: resting state
        with LiveTensorBytes() as mode:
            opt.step()
        assert mode.peak == expected, fused


def test_a_head_larger_than_torch_can_index_is_the_commands_error():
    # the replay's meta rows failed to allocate: a TypeError traceback ("Overflow when unpacking long long")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["--classes", str(10**20), "--dim", "64", "--batch", "128"]) == 2
    assert err.getvalue() == (f"shardfc plan: error: num_classes={10**20} x subcenters=1 x embedding_dim=64 = 6.400e+21 "
                              "weights of 4 bytes: more than a torch tensor can hold (2**63 - 1 bytes)\n")
