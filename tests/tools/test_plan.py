"""``shardfc.tools.plan``: the parts add up, the largest C and B fit, errors are clear, and the prediction
matches what ``shardfc bench`` measures (2 gloo ranks, B=256, C=40000, D=64) within 10%.

The bench keeps gradients between steps (``zero_grad(set_to_none=False)``), which is the plan's
default ``grad_in_place=True``."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from shardfc.tools.plan import PARTS, main, parse_bytes, plan

CONFIGS = [
    dict(num_classes=40_000, dim=64, batch=256, world_size=2),
    dict(num_classes=40_000, dim=64, batch=256, world_size=2, chunk_size=1024),
    dict(num_classes=1_000_003, dim=512, batch=1000, world_size=8, chunk_size=4096, dtype="bfloat16"),
    dict(num_classes=100_000, dim=128, batch=255, world_size=3, sample_rate=0.1, optimizer="adamw"),
    dict(num_classes=5000, dim=32, batch=64, world_size=1, optimizer="sgd_nomomentum", margin="softmax"),
    dict(num_classes=50_000, dim=64, batch=128, world_size=4, weight_decay=5e-4, memory_model="resident"),
    dict(num_classes=100_000, dim=128, batch=255, world_size=3, sample_rate=0.1, memory_model="resident", dtype="bfloat16"),
]


@pytest.mark.parametrize("grads_kept", [True, False])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_parts_add_up(cfg, grads_kept):
    r = plan(**cfg, grad_in_place=grads_kept)
    parts = r["parts"]
    assert set(parts) == set(PARTS) and r["grad_in_place"] is grads_kept
    assert r["total"] == sum(parts.values()) == r["resting"] + r["step_peak"]
    n = math.ceil(cfg["num_classes"] / cfg["world_size"])
    assert r["n_local"] == n
    s = {"float32": 4, "bfloat16": 2}[cfg.get("dtype", "float32")]
    assert parts["weights"] == n * cfg["dim"] * s
    if grads_kept:  # the [n, D] .grad rests like the weights; the step holds blocks of it at most
        assert parts["gradients"] == n * cfg["dim"] * s
        assert r["resting"] == parts["weights"] + parts["gradients"] + parts["optimizer_state"]
        assert r["step_peak"] == parts["activations"] + parts["communication"]
    else:
        assert 0 < parts["gradients"] <= n * cfg["dim"] * s
        assert r["resting"] == parts["weights"] + parts["optimizer_state"]
        assert r["step_peak"] == parts["gradients"] + parts["activations"] + parts["communication"]


def test_model_shapes():
    base = dict(num_classes=400_000, dim=128, batch=256, world_size=4)
    full = plan(**base)["step_peak"]
    chunked = plan(**base, chunk_size=1024)["step_peak"]
    partial = plan(**base, sample_rate=0.1)["step_peak"]
    assert chunked < full / 2 and partial < full / 2
    # the unchunked peak holds the [B, n] logits: it grows with B, the chunked one barely does
    assert plan(**{**base, "batch": 512})["step_peak"] - full > 256 * 100_000 * 4 * 0.99
    # allocated counts grad_w from its allocation, resident from its first write
    assert plan(**base, memory_model="allocated")["step_peak"] >= plan(**base, memory_model="resident")["step_peak"]
    assert plan(**base, optimizer="adamw")["parts"]["optimizer_state"] == 2 * 100_000 * 128 * 4
    assert plan(**base, optimizer="sgd_nomomentum")["parts"]["optimizer_state"] == 0


def test_gradients_kept_or_not():
    base = dict(num_classes=400_000, dim=128, batch=256, world_size=4)
    grad = 100_000 * 128 * 4  # the [n, D] weight gradient of rank 0
    block = 8192 * 128 * 4  # shard_math.WGRAD_BLOCK rows
    for model in ("allocated", "resident"):
        # kept: nothing of size [n, D] in the step (chunked: O(B·chunk) + two [chunk, D] blocks)
        chunked = plan(**base, chunk_size=1024, memory_model=model)
        assert chunked["step_peak"] < grad / 8
        # not kept: the step allocates the gradient (resident: filled block by block)
        no = plan(**base, chunk_size=1024, memory_model=model, grad_in_place=False)
        assert no["step_peak"] > grad and no["parts"]["gradients"] > 0.99 * grad
        assert no["total"] - chunked["total"] < grad * 0.05  # the same bytes, resting or not
        # unchunked: the [B, n] logits + two [block, D] gradient blocks vs logits + the gradient
        kept = plan(**base, memory_model=model)["step_peak"]
        freed = plan(**base, memory_model=model, grad_in_place=False)["step_peak"]
        assert abs((freed - kept) - (grad - 2 * block)) < 0.05 * grad
        # Partial FC: index_add_ into .grad, or a dense zeros [n, D]
        partial = plan(**base, sample_rate=0.1, memory_model=model)
        assert partial["step_peak"] < grad / 2
        assert plan(**base, sample_rate=0.1, memory_model=model, grad_in_place=False)["step_peak"] > grad
    # allocated counts the empty [n, D] from its allocation, resident as it is filled
    assert plan(**base, chunk_size=1024, grad_in_place=False)["step_peak"] >= plan(
        **base, chunk_size=1024, grad_in_place=False, memory_model="resident")["step_peak"]


@pytest.mark.parametrize("chunk", [None, 2048])
def test_largest_classes_and_batch_fit_the_budget(chunk):
    base = dict(dim=128, batch=256, world_size=4, chunk_size=chunk)
    r = plan(num_classes=400_000, budget_bytes="1GiB", **base)
    budget = r["budget_bytes"]
    assert budget == 2**30 and r["fits"]
    c = r["max_classes"]
    assert plan(num_classes=c, **base)["total"] <= budget < plan(num_classes=c + 1, **base)["total"]
    b = r["max_batch"]
    assert plan(num_classes=400_000, **{**base, "batch": b})["total"] <= budget
    assert plan(num_classes=400_000, **{**base, "batch": b + 1})["total"] > budget
    bigger = plan(num_classes=400_000, budget_bytes="2GiB", **base)
    assert bigger["max_classes"] > c and bigger["max_batch"] > b  # monotone in the budget
    assert plan(num_classes=400_000, budget_bytes="512MiB", **base)["max_classes"] < c


def test_budget_holding_weights_but_no_batch_reports_zero():
    r = plan(num_classes=2_000_000, dim=128, batch=256, world_size=1, budget_bytes="1GiB")
    assert not r["fits"] and r["max_batch"] == 0 and r["max_classes"] < 2_000_000


def test_budget_too_small_for_one_class():
    with pytest.raises(ValueError, match="too small for even one class"):
        plan(num_classes=1000, dim=128, batch=256, world_size=2, budget_bytes=1000)


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
        (dict(memory_model="virtual"), "memory_model"),
        (dict(grad_in_place="yes"), "grad_in_place"),
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
    argv = ["--classes", "1000000", "--dim", "512", "--batch", "1024", "--world-size", "8", "--chunk-size", "4096",
            "--budget", "16GiB", "--json", str(path)]
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    text = out.getvalue()
    for label in ("weights", "gradients", "optimizer state", "logits / activations", "communication buffers", "largest C", "largest global B"):
        assert label in text
    assert path.exists() and json.loads(path.read_text())["grad_in_place"] is True
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


# --------------------------------------------------------------------------- plan vs bench
MW, MB, MD, MC, CHUNK = 2, 256, 64, 40_000, 1024


@pytest.fixture(scope="module")
def measured():
    from shardfc.tools.bench import run_bench

    variants = ["sharded", "chunked", "partial"]
    details: dict = {}
    results = run_bench(MW, MB, MD, MC, variants, steps=2, warmup=1, sample_rate=0.1, chunk_size=CHUNK,
                        dtype="float32", margin="arcface", progress=False, details=details)
    return {r["variant"]: r for r in results}, details


@pytest.mark.parametrize("variant", ["sharded", "chunked", "partial"])
def test_plan_matches_bench_within_10_percent(measured, variant):
    results, details = measured
    measure = details["memory_measure"]
    if measure == "cpu_rss_sampled":
        pytest.skip("clear_refs is not writable here: the sampled resident set can miss the peak")
    model = "resident" if measure.startswith("cpu") else "allocated"
    kwargs = dict(chunk_size=CHUNK) if variant == "chunked" else dict(sample_rate=0.1) if variant == "partial" else {}
    predicted = plan(MC, MD, MB, MW, "float32", "sgd", memory_model=model, grad_in_place=True, **kwargs)["step_peak"]
    got = max(results[variant]["peak_bytes_per_rank"])
    assert abs(got - predicted) <= 0.10 * predicted, (variant, got, predicted)


def test_sharded_traffic_is_two_embedding_matrices_plus_statistics(measured):
    results, _ = measured
    target = 2 * MB * MD * 4 + 3 * MB * 4 + MB * 8
    for v in ("sharded", "chunked"):
        assert abs(results[v]["comm_bytes_per_rank"] - target) <= 0.05 * target
