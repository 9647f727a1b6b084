"""Low-precision class centres: bf16/fp16 weights and optimizer state, each update computed in fp32
and rounded back once (to nearest, or stochastically: unbiased and seeded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sgd_only import SGD_MOMENTUM
from shardfc import ShardedMarginHead
from shardfc import margins as M
from shardfc.checkpoint import load_checkpoint, save_checkpoint
from shardfc.head.partial_fc import RowSparseAdamW, RowSparseSGD, head_optimizer
from shardfc.head.rounding import stochastic_round

C, D = 41, 8


# --------------------------------------------------------------------------- stochastic rounding
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(dtype):
    g = torch.Generator().manual_seed(0)
    for base in (1.0, -0.0123, 3.5e-3):
        lo = torch.tensor(base, dtype=dtype)
        hi = torch.nextafter(lo, torch.tensor(float("inf"), dtype=dtype))
        for frac in (0.1, 0.5, 0.93):
            x = lo.float() + frac * (hi.float() - lo.float())
            n = 200_000
            r = stochastic_round(x.expand(n).contiguous(), dtype, g)
            assert r.dtype == dtype
            assert torch.all((r == lo) | (r == hi))
            p_hi = (r == hi).double().mean().item()
            sigma = (frac * (1 - frac) / n) ** 0.5
            assert abs(p_hi - frac) < 5 * sigma, (base, frac, p_hi)  # E[r] = x
    exact = torch.tensor([0.5, -2.0, 0.0], dtype=torch.float32)
    assert torch.equal(stochastic_round(exact, dtype, g), exact.to(dtype))  # representable: unchanged


def test_stochastic_rounding_is_seeded():
    x = torch.randn(10_000) * 0.01
    a = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(5))
    b = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(5))
    c = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.all((a.float() - x).abs() <= (x.abs() * 2**-7) + 1e-30)  # within one ulp


# --------------------------------------------------------------------------- small updates survive
@pytest.mark.parametrize("opt_class", [RowSparseSGD, RowSparseAdamW])
def test_updates_below_half_an_ulp(opt_class):
    """A bf16 weight of 1.0 with updates of 1e-4 (an ulp is 2^-7 = 0.0078): nearest rounding keeps
    1.0 for ever, stochastic rounding follows the fp32 trajectory in the mean."""
    steps, lr = 10, 1e-4
    results = {}
    for rounding in ("nearest", "stochastic"):
        w = torch.nn.Parameter(torch.ones(20_000, 4, dtype=torch.bfloat16))
        kwargs = dict(lr=lr, weight_decay=0.0)
        if opt_class is RowSparseAdamW:
            kwargs.update(betas=(0.0, 0.0), eps=0.0)  # every update is exactly lr·sign(g)
        opt = opt_class([w], rounding=rounding, rounding_seed=1, **kwargs)
        for _ in range(steps):
            w.grad = torch.ones_like(w)
            opt.step()
        results[rounding] = w.detach().double().mean().item()
    assert results["nearest"] == 1.0
    assert abs(results["stochastic"] - (1.0 - steps * lr)) < 2e-5, results


def test_optimizer_rounding_is_seeded_and_checked():
    def run(seed):
        w = torch.nn.Parameter(torch.full((100, 4), 0.3, dtype=torch.bfloat16))
        opt = RowSparseSGD([w], lr=1e-3, momentum=0.9, rounding="stochastic", rounding_seed=seed)
        for _ in range(3):
            w.grad = torch.full_like(w, 0.1)
            opt.step()
        return w.detach().clone(), opt.state[w]["momentum_buffer"].clone()

    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[0], c[0])
    assert a[1].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="rounding must be one of"):
        RowSparseSGD([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1, rounding="up")
    head = ShardedMarginHead(D, C)
    with pytest.raises(ValueError, match="rounding must be one of"):
        head_optimizer(head, "sgd", lr=0.1, rounding="truncate")


@pytest.mark.parametrize("seed", [-1, 2**63, 0.5])
def test_a_rounding_seed_that_would_alias_another_is_refused_by_every_optimizer(seed):
    message = f"^rounding_seed must be an int in \\[0, 2\\*\\*63 - 1\\], got {seed!r}$"
    with pytest.raises(ValueError, match=message):
        RowSparseSGD([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1, rounding_seed=seed)
    for name, dtype in [("sgd", torch.float32), ("adamw", torch.float32), ("sgd", torch.bfloat16)]:
        with pytest.raises(ValueError, match=message):  # torch's own optimizer too (it never reads it)
            head_optimizer(ShardedMarginHead(D, C, dtype=dtype), name, lr=0.1, rounding_seed=seed)
    assert head_optimizer(ShardedMarginHead(D, C, dtype=torch.bfloat16), "sgd", lr=0.1,
                          rounding_seed=2**63 - 1).param_groups[0]["rounding_seed"] == 2**63 - 1


# --------------------------------------------------------------------------- the head
def make_head(dtype, rate=0.5, devices=None, sparse=None, init_seed=0):
    sparse = rate < 1 if sparse is None else sparse
    return ShardedMarginHead(D, C, margin=M.CosFace(16.0, 0.2), sample_rate=rate, sample_seed=2, sparse_grad=sparse,
                             devices=devices, dtype=dtype, init_seed=init_seed)


def train(head, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(13, D, generator=g), torch.randint(0, C, (13,), generator=g)
        opt.zero_grad(set_to_none=False)
        head(x, y).backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("rate", [0.5, 1.0])
def test_low_precision_head_tracks_the_fp32_head(dtype, name, rate):
    """Same start (the fp32 reference starts from the rounded weights), same batches, 8 steps: every
    weight within 8 ulps (of the dtype, at the largest |w|) of the fp32 head's, errors included that
    the training dynamics amplify; the state stays in the low dtype."""
    low, ref = make_head(dtype, rate), make_head(torch.float32, rate)
    with torch.no_grad():
        ref.weight.copy_(low.weight.float())
    kw = dict(lr=0.02, momentum=0.9, weight_decay=5e-4) if name == "sgd" else dict(lr=3e-3, weight_decay=5e-4)
    opt_low, opt_ref = head_optimizer(low, name, **kw), head_optimizer(ref, name, **kw)
    assert isinstance(opt_low, RowSparseSGD if name == "sgd" else RowSparseAdamW)
    train(low, opt_low, range(8))
    train(ref, opt_ref, range(8))
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    err = (low.weight.float() - ref.weight).abs().max().item()
    assert err <= 8 * ulp * ref.weight.abs().max().item(), err
    assert low.weight.dtype == dtype
    # fp16's second moment is fp32 (in fp16 it underflows and the update diverges: RowSparseAdamW)
    wide = {"row_step"} | ({"exp_avg_sq"} if dtype == torch.float16 else set())
    assert all(t.dtype == dtype for k, t in opt_low.state[low.weight].items() if k not in wide)
    if name == "adamw" and dtype == torch.float16:
        assert opt_low.state[low.weight]["exp_avg_sq"].dtype == torch.float32


def test_bf16_state_is_half_the_bytes():
    head = make_head(torch.bfloat16, rate=0.5)
    opt = head_optimizer(head, "sgd", lr=0.1, momentum=0.9)
    train(head, opt, range(1))
    resting = head.weight.untyped_storage().nbytes() + opt.state[head.weight]["momentum_buffer"].untyped_storage().nbytes()
    assert head.weight.grad is None  # sparse_grad: nothing kept between steps
    assert resting == 2 * C * D * 2  # bf16 weight + bf16 momentum: 2·D·2 bytes per class


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_resharded_checkpoint_keeps_the_dtype(tmp_path: Path, name):
    head = make_head(torch.bfloat16, devices=["cpu", "cpu"])
    opt = head_optimizer(head, name, lr=0.1, **SGD_MOMENTUM[name], rounding="stochastic", rounding_seed=3)
    train(head, opt, range(3))
    path = save_checkpoint(tmp_path, 3, common=None, per_rank=None, head_state=head.sharded_state(opt), fingerprint={})
    for devices in (None, ["cpu"] * 3):
        other = make_head(torch.bfloat16, devices=devices, init_seed=9)
        other_opt = head_optimizer(other, name, lr=0.5, **SGD_MOMENTUM[name], rounding="stochastic")
        train(other, other_opt, range(10, 11))
        other.load_sharded_state(load_checkpoint(path, **other.state_layout()).head_state, other_opt)
        assert torch.equal(torch.cat([w.detach() for w in other.shard_weights]),
                           torch.cat([w.detach() for w in head.shard_weights]))
        for w in other.shard_weights:
            assert w.dtype == torch.bfloat16
            for key, t in other_opt.state[w].items():
                if torch.is_tensor(t) and key != "row_step":
                    assert t.dtype == torch.bfloat16, key
        assert other_opt.param_groups[0]["rounding_step"] == 3 and other_opt.param_groups[0]["rounding_seed"] == 3


#: The dtype each optimizer keeps each state in for a head of each dtype (what a fresh one makes).
STATE_DTYPES = {
    torch.float32: {"momentum_buffer": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32},
    torch.bfloat16: {"momentum_buffer": torch.bfloat16, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
    torch.float16: {"momentum_buffer": torch.float16, "exp_avg": torch.float16, "exp_avg_sq": torch.float32},
}


@pytest.mark.parametrize("rate", [1.0, 0.5])  # without sampling an fp32 head gets torch's SGD / AdamW
@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("saved_dtype, dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                (torch.float32, torch.float16), (torch.float16, torch.bfloat16)])
def test_a_state_saved_by_a_head_of_another_dtype_loads_in_this_heads_state_dtypes(saved_dtype, dtype, name, rate):
    """A bf16 head's momentum kept as bf16 under an fp32 head would update in bf16 (and torch's fused
    CUDA step refuses the mix); an fp32 head's kept as fp32 under a bf16 head would take twice the
    memory asked for. Each state is loaded in the dtype a fresh optimizer of this head makes it in."""
    head = make_head(saved_dtype, rate=rate)
    opt = head_optimizer(head, name, lr=0.1, **SGD_MOMENTUM[name])
    train(head, opt, range(3))
    state = head.sharded_state(opt)
    other = make_head(dtype, rate=rate, init_seed=9)
    other_opt = head_optimizer(other, name, lr=0.1, **SGD_MOMENTUM[name])
    fresh = make_head(dtype, rate=rate)
    fresh_opt = head_optimizer(fresh, name, lr=0.1, **SGD_MOMENTUM[name])
    train(fresh, fresh_opt, range(1))
    other.load_sharded_state(state, other_opt)
    w, w_fresh = other.shard_weights[0], fresh.shard_weights[0]
    assert w.dtype == dtype
    loaded = {k: v for k, v in other_opt.state[w].items() if torch.is_tensor(v) and v.dim() >= 1}
    made = {k: v for k, v in fresh_opt.state[w_fresh].items() if torch.is_tensor(v) and v.dim() >= 1}
    # (torch AdamW's scalar step becomes the row-sparse AdamW's per-row count at its next step)
    assert loaded and {k: v.dtype for k, v in loaded.items()} == {k: made[k].dtype for k in loaded}
    assert all(v.dtype == STATE_DTYPES[dtype][k] for k, v in loaded.items() if k in STATE_DTYPES[dtype])
    saved_rows = {k[len("optimizer."):]: v for k, v in state["tensors"].items() if k.startswith("optimizer.")}
    for key, t in loaded.items():  # the saved values, cast once
        if key in saved_rows:
            assert torch.equal(t, saved_rows[key].to(t.dtype)), key
    train(other, other_opt, range(3, 5))  # and it steps on
    assert all(v.dtype == made[k].dtype for k, v in other_opt.state[w].items() if k in made)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_keeps_nan_and_rounds_past_the_largest_value_as_to_nearest(dtype):
    """The docstring's edge cases, each over many draws: NaN stays NaN; a value whose upper neighbour
    overflows, or that overflows itself, rounds as rounding to nearest does."""
    big = torch.finfo(dtype).max
    past = min(big * 1.5, torch.finfo(torch.float32).max)  # rounds to inf (bf16's largest is near fp32's)
    g = torch.Generator().manual_seed(1)
    n = 4096
    for x in (float("nan"), big * (1 + 2**-12), -big * (1 + 2**-12), past, -past, float("inf"), float("-inf")):
        xs = torch.full((n,), x, dtype=torch.float32)
        r = stochastic_round(xs, dtype, g)
        nearest = xs.to(dtype)
        assert torch.equal(r.isnan(), nearest.isnan()) and torch.equal(r[~r.isnan()], nearest[~nearest.isnan()]), x


def test_check_rounding_names_the_choices_and_the_value():
    from shardfc.head.rounding import check_rounding

    assert check_rounding("stochastic") == "stochastic"
    with pytest.raises(ValueError) as err:
        check_rounding("up")
    assert str(err.value) == "rounding must be one of 'nearest', 'stochastic', got 'up'"
