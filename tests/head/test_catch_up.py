"""Partial FC's row-sparse optimizers with ``idle_rows="exact"`` train exactly as torch's dense
optimizers over the whole weight: the same losses, every row (sampled or never), every state, to
fp32 rounding — over long idle gaps, schedules, ``grad_scale``, resumes and reshards, bf16 centres
to their rounding. ``"lazy"`` (the old update) is kept by name and differs."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from shardfc import ShardedMarginHead, head_optimizer
from shardfc import margins as M
from shardfc.checkpoint import load_checkpoint, save_checkpoint
from shardfc.head import catch_up
from shardfc.head.partial_fc import RowSparseSGD
from shardfc.parallel.launch import spawn

D = 6
SGD = dict(lr=0.4, momentum=0.9, weight_decay=5e-3, nesterov=False)
ADAMW = dict(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def make_head(C, rate, dtype=torch.float32, **kw):
    return ShardedMarginHead(D, C, margin=M.CosFace(16.0, 0.2), sample_rate=rate, sample_seed=3, init_seed=5,
                             dtype=dtype, **kw)


def dense_optimizer(head, name, kw):
    cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    return cls(head.parameters(), **kw)


def lr_at(step: int, base: float) -> float:
    return base * (1 + step % 5) / 5  # a schedule that changes every step


def batch(step: int, B: int, C: int, labels_below=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, D, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, labels_below or C, (B,), generator=g)
    return x, y


def train(head, opt, steps, B, C, *, grad_scale=None, labels_below=None, micro=1, sampled=None):
    """Steps ``steps`` of ``micro`` micro-batches each; the losses. ``grad_scale``: the gradient is
    divided by it (the row-sparse optimizer's attribute; by hand for torch's)."""
    base = opt.defaults["lr"]
    losses = []
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, base)
        opt.zero_grad(set_to_none=False)
        for m in range(micro):
            x, y = batch(step * micro + m, B, C, labels_below)
            loss = head(x, y)
            loss.backward()
            losses.append(float(loss.detach()))
        if sampled is not None:
            for w, rows in zip(head.shard_weights, head.sampled_rows or ()):
                sampled.append(rows.clone())
        if grad_scale is not None:
            if isinstance(opt, torch.optim.SGD | torch.optim.AdamW):
                for w in head.shard_weights:
                    w.grad.div_(grad_scale)
            else:
                opt.grad_scale = torch.tensor(grad_scale)
        opt.step()
        opt.__dict__.pop("grad_scale", None)
    return torch.tensor(losses, dtype=torch.float64)


def logical(head, opt) -> dict:
    """Every row of the weight and of each per-row optimizer state, read as any reader reads them."""
    head.catch_up()
    out = {"weight": torch.cat([w.detach().double() for w in head.shard_weights])}
    for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
        if key in opt.state[head.shard_weights[0]]:
            out[key] = torch.cat([opt.state[w][key].double() for w in head.shard_weights])
    return out


def assert_rel(a, b, tol, what=""):
    a, b = a.double(), b.double()
    rel = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    assert rel <= tol, f"{what}: relative difference {rel:.3g} > {tol:g}"


def assert_same_run(dense, sparse, tol=1e-5):
    (dl, ds), (sl, ss) = dense, sparse
    assert_rel(sl, dl, tol, "losses")
    assert ds.keys() == ss.keys()
    for key in ds:
        assert_rel(ss[key], ds[key], tol, key)


OPTIONS = {
    "momentum": ("sgd", {}),
    "nesterov": ("sgd", dict(nesterov=True)),
    "momentum_0": ("sgd", dict(momentum=0.0)),
    "momentum_no_decay": ("sgd", dict(weight_decay=0.0)),
    "adamw": ("adamw", {}),
    "adamw_beta1_0": ("adamw", dict(betas=(0.0, 0.99))),  # no first moment: log β1 = -inf in the tail
    "adamw_unbounded": ("adamw", dict(betas=(0.9, 0.5))),  # β1² ≥ β2: every missed step iterated
}


def dense_state(head, opt) -> dict:
    """The dense run's weight and optimizer state, in :func:`logical`'s form."""
    st = opt.state[head.weight]
    out = {"weight": head.weight.detach().double().clone()}
    return out | {k: st[k].double().clone() for k in ("momentum_buffer", "exp_avg", "exp_avg_sq") if k in st}


@pytest.mark.parametrize("sparse_grad", [False, True], ids=["dense_grad", "sparse_grad"])
@pytest.mark.parametrize("case", list(OPTIONS))
def test_row_sparse_run_equals_the_dense_optimizers_run(case, sparse_grad):
    """C = 61 at r = 0.1 (a batch of 4: 7 of 61 rows a step), 30 steps of a changing rate, 2 micro-batches."""
    name, extra = OPTIONS[case]
    kw = dict(SGD if name == "sgd" else ADAMW, **extra)
    C, B, steps = 61, 4, range(30)
    head = make_head(C, 0.1)
    opt = dense_optimizer(head, name, kw)
    dense = (train(head, opt, steps, B, C, micro=2), dense_state(head, opt))
    head = make_head(C, 0.1, sparse_grad=sparse_grad)
    opt = head_optimizer(head, name, **kw)
    sampled = []
    losses = train(head, opt, steps, B, C, micro=2, sampled=sampled)
    idle = torch.ones(C, dtype=torch.bool)
    idle[sampled[-1]] = False
    assert idle.sum() > C // 2  # most rows sat the last step out
    assert_same_run(dense, (losses, logical(head, opt)))


def _pair(name, kw, C, B, steps, rate, *, labels_below=None, grad_scale=None, dtype=torch.float32, **opt_kw):
    """The dense optimizer's run and the row-sparse one's: ``(losses, logical state)`` each, and the
    row-sparse head, optimizer and the rows each step sampled."""
    head = make_head(C, rate, dtype=torch.float32)
    if dtype != torch.float32:  # the same starting rows as the low-precision head's
        with torch.no_grad():
            head.weight.copy_(head.weight.to(dtype))
    opt = dense_optimizer(head, name, kw)
    dense = (train(head, opt, steps, B, C, labels_below=labels_below, grad_scale=grad_scale), dense_state(head, opt))
    head = make_head(C, rate, dtype=dtype)
    opt = head_optimizer(head, name, **kw, **opt_kw)
    sampled = []
    sl = train(head, opt, steps, B, C, labels_below=labels_below, grad_scale=grad_scale, sampled=sampled)
    return dense, (sl, logical(head, opt)), head, opt, sampled


def _longest_gap(sampled, C) -> int:
    last = torch.full((C,), -1)
    longest = 0
    for step, rows in enumerate(sampled):
        longest = max(longest, int((step - last[rows]).max()))
        last[rows] = step
    return longest


@pytest.mark.parametrize("case", ["nesterov", "adamw"])
def test_rows_idle_for_hundreds_of_steps_and_rows_never_sampled(case):
    """300 classes, 2 a step (the batch's positives; a random negative when they coincide), labels
    among the first 200: a row waits ~100 steps between samples, some several hundred, and most of
    the last 100 rows are never sampled in 400 steps: all equal the dense run's."""
    name, extra = OPTIONS[case]
    kw = dict(SGD if name == "sgd" else ADAMW, **extra)
    C = 300
    dense, sparse, head, opt, sampled = _pair(name, kw, C, 2, range(400), 0.001, labels_below=200)
    assert _longest_gap(sampled, C) >= 250
    never = torch.ones(C, dtype=torch.bool)
    never[torch.cat(sampled)] = False
    assert never[200:].sum() >= 80
    assert_same_run(dense, sparse)
    start = make_head(C, 1.0).weight.detach().double()
    assert not torch.isclose(dense[1]["weight"][never], start[never]).any()  # the never-sampled rows moved


def test_a_full_catch_up_every_few_steps_changes_nothing(monkeypatch):
    """The table restarts after FULL_CATCH_UP_EVERY steps with one pass over the rows: same run."""
    monkeypatch.setattr(catch_up, "FULL_CATCH_UP_EVERY", 7)
    monkeypatch.setattr("shardfc.head.partial_fc.FULL_CATCH_UP_EVERY", 7)
    dense, sparse, _, opt, _ = _pair("sgd", SGD, 200, 2, range(120), 0.01)
    assert_same_run(dense, sparse)
    assert all(c.length <= 8 for c in opt._clocks.values())


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_grad_scale_divides_only_the_gradient(name):
    kw = dict(SGD if name == "sgd" else ADAMW)
    dense, sparse, *_ = _pair(name, kw, 61, 4, range(20), 0.1, grad_scale=3.0)
    assert_same_run(dense, sparse)


def test_the_lazy_update_is_kept_by_name_and_is_not_the_dense_run():
    dense, exact, *_ = _pair("sgd", SGD, 61, 4, range(20), 0.1)
    _, lazy, head, opt, _ = _pair("sgd", SGD, 61, 4, range(20), 0.1, idle_rows="lazy")
    assert_same_run(dense, exact)
    rel = float((lazy[1]["weight"] - dense[1]["weight"]).abs().max() / dense[1]["weight"].abs().max())
    assert rel > 1e-2  # the missed momentum and decay
    before = head.weight.detach().clone()
    head.catch_up()  # nothing is behind under "lazy"
    assert torch.equal(head.weight.detach(), before) and opt.idle_state_bound == 0
    with pytest.raises(ValueError, match="idle_rows must be one of 'exact', 'lazy', got 'eager'"):
        head_optimizer(head, "sgd", lr=0.1, idle_rows="eager")
    with pytest.raises(ValueError, match="idle_rows must be one of"):
        RowSparseSGD(head.parameters(), lr=0.1, idle_rows=None)


def test_unsampled_rows_are_not_touched_until_read():
    """The sparse cost: a step writes the sampled rows only; the rest move when read."""
    head = make_head(200, 0.01)
    opt = head_optimizer(head, "sgd", **SGD)
    train(head, opt, range(3), 2, 200)
    before = head.weight.detach().clone()
    (rows,) = head.sampled_rows or (None,)
    x, y = batch(99, 2, 200)
    head(x, y).backward()
    (rows,) = head.sampled_rows
    untouched = torch.ones(200, dtype=torch.bool)
    untouched[rows] = False
    after = head.weight.detach()
    assert torch.equal(after[untouched], before[untouched]) and not torch.equal(after[rows], before[rows])


# --------------------------------------------------------------------------- AdamW's bound


def test_adamw_exact_steps_bounds_the_dropped_terms():
    """The count it gives makes the bound's geometric tail at most the bound; one step fewer does not."""
    for lr, betas, bound in [(0.05, (0.9, 0.999), 2**-30), (1.0, (0.5, 0.99), 1e-6), (1e-3, (0.9, 0.95), 1e-9)]:
        J = catch_up.adamw_exact_steps(lr, betas, bound)
        b1, b2 = betas
        rho = b1 / math.sqrt(b2)
        K = (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))
        tail = lambda j: lr * K / (1 - b1) * rho ** (j + 1) / (1 - rho)  # noqa: E731
        assert tail(J) <= bound and tail(J - 2) > bound
    assert catch_up.adamw_exact_steps(0.1, (0.99, 0.9)) is None  # β1² ≥ β2: no bound, every step iterated
    assert catch_up.adamw_exact_steps(0.1, (0.5, 0.25)) is None  # β1² = β2: ρ = 1
    assert catch_up.adamw_exact_steps(0.0, (0.9, 0.999)) == 0  # no learning rate
    assert catch_up.adamw_exact_steps(0.1, (0.0, 0.999)) == 0  # β1 = 0: no moment term once idle
    assert catch_up.adamw_exact_steps(1e-15, (0.9, 0.999)) == 0  # the first idle term is below the bound


def test_adamw_after_the_iterated_steps_stays_within_the_stated_bound(monkeypatch):
    """A loose bound (1e-4) cuts the iteration short of the gaps: the weights stay within it of the
    dense run's, and the moments (closed form) equal it."""
    monkeypatch.setattr(catch_up, "ADAMW_DROPPED_BOUND", 1e-4)
    kw = dict(ADAMW, lr=0.01)
    assert catch_up.adamw_exact_steps(kw["lr"], kw["betas"]) < 150
    dense, sparse, _, _, sampled = _pair("adamw", kw, 300, 2, range(400), 0.001)
    gap = _longest_gap(sampled, 300)
    assert gap > 200
    diff = float((sparse[1]["weight"] - dense[1]["weight"]).abs().max())
    assert 0 < diff <= 1e-4 + 1e-6
    for key in ("exp_avg", "exp_avg_sq"):
        # The dense run rounds a moment into fp32 at each of a row's idle steps, the closed form
        # once: they differ by at most one unit roundoff (2**-24) a step of the longest gap.
        assert_rel(sparse[1][key], dense[1][key], (gap + 1) * 2.0**-24, key)


# --------------------------------------------------------------------------- every reader sees caught-up rows


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_every_reader_of_all_rows_sees_the_dense_runs_rows(name):
    """Mid-run: an eval forward, predict, state_dict and sharded_state equal the dense run's; and
    the run goes on equal after them (a full read restarts the step tables)."""
    C, B = 61, 4
    kw = SGD if name == "sgd" else ADAMW
    heads = [make_head(C, 0.1), make_head(C, 0.1)]
    opts = [dense_optimizer(heads[0], name, kw), head_optimizer(heads[1], name, **kw)]
    for head, opt in zip(heads, opts):
        train(head, opt, range(15), B, C)
    x, y = batch(500, 8, C)
    outs = []
    for head, opt in zip(heads, opts):
        head.eval()
        with torch.no_grad():
            loss = float(head(x, y))
        scores, ids = head.predict(x, k=3)
        head.train()
        state = head.sharded_state(opt)["tensors"]
        key = "optimizer.momentum_buffer" if name == "sgd" else "optimizer.exp_avg"
        outs.append((loss, scores, ids, head.state_dict()["weight"].clone(), state["weight"].clone(),
                     state[key].clone()))
    (l0, s0, i0, *t0), (l1, s1, i1, *t1) = outs
    assert math.isclose(l0, l1, rel_tol=1e-5) and torch.equal(i0, i1)
    torch.testing.assert_close(s1, s0, rtol=1e-5, atol=1e-6)
    for a, b in zip(t1, t0):
        assert_rel(a, b, 1e-5)
    later = [train(head, opt, range(15, 25), B, C) for head, opt in zip(heads, opts)]
    assert_same_run((later[0], dense_state(heads[0], opts[0])), (later[1], logical(heads[1], opts[1])))


def test_a_resume_from_sharded_state_or_state_dicts_continues_the_dense_run():
    """12 steps, saved (sharded_state; torch-style state dicts, arcface_torch's form), loaded into a
    new head and optimizer, 12 more: the dense optimizer's 24 steps."""
    C, B = 61, 4
    head = make_head(C, 0.1)
    opt = dense_optimizer(head, "sgd", SGD)
    dense = (train(head, opt, range(24), B, C), dense_state(head, opt))
    for form in ("sharded_state", "state_dict"):
        head = make_head(C, 0.1)
        opt = head_optimizer(head, "sgd", **SGD)
        first = train(head, opt, range(12), B, C)
        if form == "sharded_state":
            saved = copy.deepcopy(head.sharded_state(opt))
        else:
            saved = copy.deepcopy((head.state_dict(), opt.state_dict()))
            assert list(saved[0]) == ["weight"]  # arcface_torch's keys: loads either way
        resumed = make_head(C, 0.1)
        resumed_opt = head_optimizer(resumed, "sgd", **SGD)
        if form == "sharded_state":
            resumed.load_sharded_state(saved, resumed_opt)
        else:
            resumed.load_state_dict(saved[0])
            resumed_opt.load_state_dict(saved[1])
        assert resumed.sample_step == 12  # the negatives drawn next are the ones the run would draw
        second = train(resumed, resumed_opt, range(12, 24), B, C)
        assert_same_run(dense, (torch.cat([first, second]), logical(resumed, resumed_opt)))


def test_a_head_state_dict_carries_the_sampling_step():
    """A torch-style resume (arcface_torch's checkpoint_gpu_*.pt) draws the negatives the run would have drawn."""
    C = 61
    head = make_head(C, 0.1)
    train(head, torch.optim.SGD(head.parameters(), lr=0.1), range(5), 4, C)
    saved = torch.nn.Module.state_dict(head)
    fresh = make_head(C, 0.1)
    fresh.load_state_dict(saved)
    assert fresh.sample_step == 5 and list(saved) == ["weight"]
    x, y = batch(77, 4, C)
    head(x, y)
    fresh(x, y)
    assert torch.equal(head.sampled_rows[0], fresh.sampled_rows[0])


def test_a_torch_optimizer_on_a_partial_fc_head_keeps_no_rows_from_steps_gone_by():
    """arcface_torch's route: nothing takes the sampled rows; they must not pile up step after step."""
    head = make_head(61, 0.1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    train(head, opt, range(20), 4, 61, micro=2)
    assert len(head._pending_rows[0]) == 2  # the last step's two micro-batches, not forty


# --------------------------------------------------------------------------- bf16 centres


@pytest.mark.parametrize("name", ["sgd"])
def test_bf16_centres_follow_the_dense_run_to_their_rounding(name):
    """bf16 centres and momentum, each catch-up and update rounded once (to nearest) into bf16,
    against the dense fp32 run from the same starting rows: within a few bf16 units in the last
    place of the largest entry (2^-8 relative each), where the lazy update is far off."""
    C, B, steps = 61, 4, range(20)
    kw = SGD if name == "sgd" else ADAMW
    dense, exact, *_ = _pair(name, kw, C, B, steps, 0.1, dtype=torch.bfloat16)
    _, lazy, *_ = _pair(name, kw, C, B, steps, 0.1, dtype=torch.bfloat16, idle_rows="lazy")
    scale = dense[1]["weight"].abs().max()
    err = float((exact[1]["weight"] - dense[1]["weight"]).abs().max() / scale)
    lazy_err = float((lazy[1]["weight"] - dense[1]["weight"]).abs().max() / scale)
    assert err <= 8 * 2**-8 and lazy_err > 5 * err
    assert_rel(exact[0], dense[0], 2e-2, "losses")


def test_bf16_adamw_catch_up_is_the_fp32_one_rounded_once():
    """AdamW's bf16 trajectories diverge from any other rounding's by O(lr) per element (it turns a
    gradient's sign into a step), so bf16 AdamW is held one catch-up at a time: from the same bf16
    rows, moments and gaps, the bf16 catch-up equals the fp32 one rounded once, to one unit in the
    last place."""
    torch.manual_seed(0)
    n = 9
    rows = torch.tensor([0, 3, 4, 8])
    start = {k: v for k, v in dict(w=torch.randn(n, D) * 0.1, m=torch.randn(n, D) * 1e-3,
                                   v=torch.rand(n, D) * 1e-5).items()}
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        p = start["w"].to(torch.bfloat16).to(dtype)
        m, v = start["m"].to(torch.bfloat16).to(dtype), start["v"].to(torch.bfloat16).to(dtype)
        step = torch.full((n,), 3.0, dtype=torch.float64)
        clock = catch_up.AdamWClock(p)
        for k in range(12):
            clock.record(0.05 * (1 + k % 3), (0.9, 0.999), 1e-8, 0.1)
        clock.stamps.copy_(torch.tensor([0, 5, 0, 11, 2, 12, 7, 9, 1], dtype=torch.int32))
        clock.catch_up_(p, (m, v, step), rows, lambda x, dt: x.to(dt))
        out[dtype] = (p, m, v, step)
    for low, high in zip(out[torch.bfloat16][:3], out[torch.float32][:3]):
        assert low.dtype == torch.bfloat16
        rounded = high.to(torch.bfloat16).float()
        ulp = rounded.abs() * 2**-7
        assert bool(((low.float() - rounded).abs() <= ulp).all())
    assert torch.equal(out[torch.bfloat16][3], out[torch.float32][3])
    assert out[torch.bfloat16][3][rows].tolist() == [15.0, 4.0, 13.0, 14.0]  # 3 + the gaps 12, 1, 10, 11


# --------------------------------------------------------------------------- 2 gloo ranks, resharded to 3


def _ranks_then_save(rank, world, root, steps):
    """Both runs in one world: the dense optimizer's and the row-sparse one's, each saved."""
    out = {}
    for name in ("dense", "exact"):
        head = make_head(37, 0.2, group=torch.distributed.group.WORLD)
        opt = torch.optim.SGD(head.parameters(), **SGD) if name == "dense" else head_optimizer(head, "sgd", **SGD)
        losses = train(head, opt, range(steps), 3, 37)
        save_checkpoint(f"{root}/{name}", steps, common={}, per_rank=None, head_state=head.sharded_state(opt),
                        fingerprint={})
        out[name] = (losses, _logical_of(head, opt, name))
    return out


def _logical_of(head, opt, name):
    return dense_state(head, opt) if name == "dense" else logical(head, opt)


def _resume_on_three(rank, world, root, steps):
    out = {}
    for name in ("dense", "exact"):
        head = make_head(37, 0.2, group=torch.distributed.group.WORLD)
        opt = torch.optim.SGD(head.parameters(), **SGD) if name == "dense" else head_optimizer(head, "sgd", **SGD)
        path = next(Path(root, name).glob("step_*"))
        loaded = load_checkpoint(path, class_range=head.class_range, num_classes=37, rank=rank)
        head.load_sharded_state(loaded.head_state, opt)
        losses = train(head, opt, range(loaded.step, loaded.step + steps), 2, 37)
        out[name] = (losses, _logical_of(head, opt, name))
    return out


def test_two_gloo_ranks_then_resharded_to_three(tmp_path: Path):
    """On 2 ranks (37 classes: 19 + 18), 8 steps, saved; resumed on 3 (13 + 12 + 12), 6 more: the
    row-sparse runs equal the dense ones at the save and after the reshard."""
    for part in (spawn(_ranks_then_save, 2, str(tmp_path), 8, backend="gloo"),
                 spawn(_resume_on_three, 3, str(tmp_path), 6, backend="gloo")):
        dense, exact = [(torch.cat([r[name][0] for r in part]),
                         {k: torch.cat([r[name][1][k] for r in part]) for k in part[0][name][1]})
                        for name in ("dense", "exact")]
        assert_same_run(dense, exact)


def test_a_pickled_or_copied_head_holds_the_caught_up_rows():
    """torch.save(head) (the whole module) and copy.deepcopy: the rows as the dense run has them,
    and no tie to the original's optimizer."""
    import io

    head = make_head(61, 0.1)
    opt = head_optimizer(head, "sgd", **SGD)
    train(head, opt, range(6), 4, 61)
    buf = io.BytesIO()
    torch.save(head, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    copied = copy.deepcopy(head)
    expected = logical(head, opt)["weight"]
    for other in (loaded, copied):
        assert torch.equal(other.weight.detach().double(), expected)
        assert other._idle_rows_optimizer is None
