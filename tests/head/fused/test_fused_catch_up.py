"""The fused path under Partial FC with the exact idle-row update: the update applied in the
backward (``fused_update=True``) and the row-sparse SGD's Triton kernel, on the GPU implementations,
train as torch's dense optimizer over the whole weight does with the torch implementation: the same
losses, every row, every state, to fp32 rounding (AdamW: to its normalisation of that rounding).
The catch-up runs before the fused forward in its own kernel (``shardfc.head.fused.idle_rows``),
held here to the torch form of the same catch-up as well."""

from __future__ import annotations

import copy

import pytest
import torch
from fused_pairs import DEVICE, MARGINS, C, D

import shardfc
from shardfc.head import partial_fc

B = 6
STEPS = 5
OPT_KW = {"sgd": dict(lr=0.5, momentum=0.9, weight_decay=5e-3, nesterov=False),
          "adamw": dict(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)}


def _run(impl: str, optimizer: str, dense: bool, **kw):
    torch.manual_seed(0)
    head = shardfc.ShardedMarginHead(D, C, margin=copy.deepcopy(MARGINS["arcface"]), impl=impl, device=DEVICE,
                                     sample_rate=0.1, sample_seed=4, **kw.pop("head", {}))
    if dense:
        cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
        opt = cls(head.parameters(), **OPT_KW[optimizer])
    else:
        opt = partial_fc.head_optimizer(head, optimizer, **OPT_KW[optimizer], **kw)
        if isinstance(opt, partial_fc.RowSparseSGD):
            opt.fused = impl != "torch"  # the row-sparse SGD's own kernel where the backward does not update
        opt.catch_up_kernel = impl != "torch"  # as on CUDA: the idle rows' kernel
    losses = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = OPT_KW[optimizer]["lr"] * (1.0 if step % 2 else 0.4)
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randn(B, D, generator=g, dtype=torch.float64).float() * 3
        y = torch.randint(0, C, (B,), generator=g)
        opt.zero_grad(set_to_none=False)
        loss = head(x.to(DEVICE), y.to(DEVICE))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    head.catch_up()
    state = opt.state[head.weight]
    keys = [k for k in ("momentum_buffer", "exp_avg", "exp_avg_sq") if k in state]
    return head, torch.tensor(losses), [head.weight.detach().double().cpu()] + [state[k].double().cpu() for k in keys]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("fused_update", [True, False], ids=["update_in_backward", "update_in_step"])
def test_the_fused_path_trains_as_the_dense_optimizer(optimizer, fused_update):
    _, dense_losses, dense = _run("torch", optimizer, dense=True)
    head, losses, sparse = _run("triton", optimizer, dense=False, fused_update=fused_update)
    assert head.last_update == ("fused" if fused_update else head.last_update)
    assert _rel(losses, dense_losses) <= 1e-5
    assert len(sparse) == len(dense)
    # AdamW divides by √v: the kernels' and torch's fp32 summation orders of a small gradient differ
    # by its rounding, which the normalisation lifts to the update's scale (test_fused_update's
    # AdamW trajectory holds the same 1e-4); SGD's stay at fp32 rounding.
    tol = 1e-5 if optimizer == "sgd" else 1e-4
    for a, b in zip(sparse, dense):
        assert _rel(a, b) <= tol


def _train_pair(optimizer: str, steps: int, C_: int, opt_kw: dict, dtype=torch.float32, labels_below=None):
    """The same Partial FC run with the idle rows caught up by the kernel and by torch (4 classes a
    step of C_): both heads and optimizers."""
    out = []
    for kernel in (True, False):
        torch.manual_seed(0)
        head = shardfc.ShardedMarginHead(D, C_, margin=copy.deepcopy(MARGINS["cosface"]), impl="torch",
                                         device=DEVICE, sample_rate=0.01, sample_seed=2, dtype=dtype)
        opt = partial_fc.head_optimizer(head, optimizer, **opt_kw)
        opt.catch_up_kernel = kernel
        last_seen, opt.longest_gap = torch.zeros(C_, dtype=torch.int64), 0
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = opt_kw["lr"] * (1 + step % 3) / 3
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, D, generator=g).to(dtype)
            y = torch.randint(0, labels_below or C_, (4,), generator=g)
            opt.zero_grad(set_to_none=False)
            head(x.to(DEVICE), y.to(DEVICE)).backward()
            (rows,) = head.sampled_rows
            opt.longest_gap = max(opt.longest_gap, int((step - last_seen[rows.cpu()]).max()))
            last_seen[rows.cpu()] = step
            opt.step()
        head.catch_up()
        out.append((head, opt))
    return out


def _state_of(head, opt):
    st = opt.state[head.weight]
    return {"weight": head.weight.detach()} | {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim()}


KERNEL_CASES = {
    "momentum": ("sgd", dict(OPT_KW["sgd"])),
    "nesterov": ("sgd", dict(OPT_KW["sgd"], nesterov=True)),
    "no_momentum": ("sgd", dict(OPT_KW["sgd"], momentum=0.0)),
    "adamw": ("adamw", dict(OPT_KW["adamw"])),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_the_catch_up_kernel_equals_the_torch_catch_up(case):
    """Over 40 classes, 4 sampled a step, labels among the first 25: gaps of tens of steps and rows
    never sampled (SGD 40 steps, AdamW 20: the interpreter runs its loop slowly). Weights and every
    per-row state equal to fp32 rounding."""
    optimizer, kw = KERNEL_CASES[case]
    (kh, ko), (th, to) = _train_pair(optimizer, 40 if optimizer == "sgd" else 20, 40, kw, labels_below=25)
    a, b = _state_of(kh, ko), _state_of(th, to)
    assert a.keys() == b.keys()
    for key in a:
        assert _rel(a[key].double().cpu(), b[key].double().cpu()) <= 1e-5, key
    assert torch.equal(ko._clocks[kh.weight].stamps, to._clocks[th.weight].stamps) if ko._clocks else True


def test_the_adamw_kernel_past_its_iterated_steps(monkeypatch):
    """A bound loose enough that the kernel stops iterating before the longest gaps: the closed-form
    tail agrees with the torch form's."""
    from shardfc.head import catch_up

    monkeypatch.setattr(catch_up, "ADAMW_DROPPED_BOUND", 1e-3)
    kw = dict(OPT_KW["adamw"], lr=0.01, betas=(0.5, 0.99))
    assert catch_up.adamw_exact_steps(kw["lr"], kw["betas"]) < 15
    (kh, ko), (th, to) = _train_pair("adamw", 30, 40, kw, labels_below=20)
    assert to.longest_gap > catch_up.adamw_exact_steps(kw["lr"], kw["betas"])  # the tail is reached
    a, b = _state_of(kh, ko), _state_of(th, to)
    for key in a:
        assert _rel(a[key].double().cpu(), b[key].double().cpu()) <= 1e-5, key


def test_the_sgd_kernel_rounds_bf16_centres_once_to_nearest():
    (kh, ko), (th, to) = _train_pair("sgd", 25, 60, OPT_KW["sgd"], dtype=torch.bfloat16, labels_below=40)
    a, b = _state_of(kh, ko), _state_of(th, to)
    for key in a:
        assert a[key].dtype == torch.bfloat16
        diff = (a[key].float() - b[key].float()).abs()
        ulp = b[key].float().abs().clamp(min=1e-30) * 2**-7
        assert bool((diff <= ulp).all()), key  # at most one bf16 unit apart (fp32 arithmetic orders)


def _clock_with_history(n_rows: int, dim: int, steps: int, with_momentum: bool):
    """An SGD clock of ``steps`` recorded steps whose rows sit at assorted stamps, the weight and its
    momentum random: what the launcher is handed between two steps."""
    from shardfc.head.catch_up import SGDClock

    g = torch.Generator().manual_seed(steps)
    p = torch.randn(n_rows, dim, generator=g).to(DEVICE)
    buf = torch.randn(n_rows, dim, generator=g).to(DEVICE) if with_momentum else None
    clock = SGDClock(p)
    for s in range(steps):
        clock.record(0.1 * (1 + s % 3), 0.9 if with_momentum else 0.0, 5e-3, False, always=True)
        clock.mark_current(torch.tensor([s % n_rows, (3 * s + 1) % n_rows], device=DEVICE))
    return p, buf, clock


@pytest.mark.parametrize("with_momentum", [True, False])
@pytest.mark.parametrize("rows", [None, [7, 0, 12, 3], [5]], ids=["every_row", "some_rows", "one_row"])
def test_the_sgd_launcher_catches_up_the_rows_it_is_given_to_the_device_s_now(with_momentum, rows):
    """``catch_up_sgd_`` called directly against the clock's torch form on the same state: the rows
    given (or every row), and only them, brought to now and stamped with ``now`` read on the device."""
    from shardfc.head.fused.idle_rows import catch_up_sgd_

    p, buf, clock = _clock_with_history(13, 5, 9, with_momentum)
    idx = None if rows is None else torch.tensor(rows, device=DEVICE)
    ref_p, ref_buf, ref_clock = p.clone(), None if buf is None else buf.clone(), copy.deepcopy(clock)
    ref_clock.catch_up_(ref_p, (ref_buf,), idx, lambda x, dtype: x.to(dtype), kernel=False)
    stamps_before = clock.stamps.clone()
    catch_up_sgd_(p, buf, idx, clock.stamps, clock.table, clock.now)
    assert _rel(p.double().cpu(), ref_p.double().cpu()) <= 1e-6
    if buf is not None:
        assert _rel(buf.double().cpu(), ref_buf.double().cpu()) <= 1e-6
    now = int(clock.now)
    touched = torch.zeros(13, dtype=torch.bool, device=DEVICE)
    touched[idx if idx is not None else slice(None)] = True
    assert bool((clock.stamps[touched] == now).all())
    assert torch.equal(clock.stamps[~touched], stamps_before[~touched])


def test_the_sgd_launcher_on_the_meta_device_tells_the_plan_what_it_would_touch():
    from shardfc.head.fused import traffic
    from shardfc.head.fused.idle_rows import catch_up_sgd_

    seen = []
    p, buf = torch.empty(100, 8, device="meta"), torch.empty(100, 8, device="meta")
    stamps, table, now = (torch.empty(100, dtype=torch.int32, device="meta"),
                          torch.empty(4, 2, 2, dtype=torch.float64, device="meta"),
                          torch.empty(1, dtype=torch.int32, device="meta"))
    record = lambda kernel, reads, writes, flops: seen.append((kernel, [(r.part[0], r.nbytes) for r in reads],  # noqa: E731
                                                               [(w.part[0], w.nbytes) for w in writes]))
    with traffic.recording(record):
        catch_up_sgd_(p, buf, torch.arange(10, device="meta"), stamps, table, now)
        catch_up_sgd_(p, None, None, stamps, table, now)
        catch_up_sgd_(p, buf, torch.arange(0, device="meta"), stamps, table, now)  # no rows: nothing
    rows10, span = ("rows", 10 * 8 * 4), ("span", 100 * 8 * 4)  # the sampled rows gathered; every row a span
    assert seen == [("catch_up_sgd", [rows10, rows10, ("span", 10 * 8)], [rows10, rows10]),
                    ("catch_up_sgd", [span], [span])]


def _adamw_clock_with_history(n_rows: int, dim: int, steps: int, dtype=torch.float32):
    """An AdamW clock of ``steps`` recorded steps (lr, betas and weight decay changing step to step)
    whose rows sit at assorted stamps, with per-row step counts: the weight and its moments random."""
    from shardfc.head.catch_up import AdamWClock

    g = torch.Generator().manual_seed(steps)
    p = torch.randn(n_rows, dim, generator=g).to(dtype).to(DEVICE)
    m = (torch.randn(n_rows, dim, generator=g) * 0.1).to(dtype).to(DEVICE)
    v = (torch.rand(n_rows, dim, generator=g) * 0.01 + 1e-4).to(dtype).to(DEVICE)
    row_step = torch.randint(0, 6, (n_rows,), generator=g).double().to(DEVICE)
    clock = AdamWClock(p)
    for s in range(steps):
        clock.record(0.05 * (1 + s % 3), (0.5 + 0.1 * (s % 2), 0.9), 1e-3 * (1 + s % 2), 0.1 * (1 + s % 2))
        clock.mark_current(torch.tensor([s % n_rows, (3 * s + 1) % n_rows], device=DEVICE))
    return p, m, v, row_step, clock


@pytest.mark.parametrize("iterate", [3, 100], ids=["tail_after_3", "every_step_iterated"])
@pytest.mark.parametrize("rows", [None, [7, 0, 12, 3], [5]], ids=["every_row", "some_rows", "one_row"])
def test_the_adamw_launcher_catches_up_the_rows_it_is_given_as_the_torch_form(rows, iterate):
    """``catch_up_adamw_`` called directly against the clock's torch form on the same state and the
    same number of iterated steps (3: the rest of a gap of up to 8 steps the closed-form tail, whose
    moments' term is far from negligible here, so iterating more or fewer steps shows; 100: more
    than were recorded): the rows given (or every row), and only them, brought to now, their step
    counts advanced by their gaps and their stamps set to now."""
    from shardfc.head.fused.idle_rows import catch_up_adamw_

    p, m, v, row_step, clock = _adamw_clock_with_history(13, 5, 9)
    clock.exact_steps = iterate
    idx = None if rows is None else torch.tensor(rows, device=DEVICE)
    ref = [t.clone() for t in (p, m, v, row_step)]
    ref_clock = copy.deepcopy(clock)
    ref_clock.catch_up_(ref[0], tuple(ref[1:]), idx, lambda x, dtype: x.to(dtype), kernel=False)
    before = [t.clone() for t in (p, m, v, row_step)]
    stamps_before = clock.stamps.clone()
    catch_up_adamw_(p, m, v, row_step, idx, clock.stamps, clock.table, clock.length - 1, iterate)
    touched = torch.zeros(13, dtype=torch.bool, device=DEVICE)
    touched[idx if idx is not None else slice(None)] = True
    for got, want, old in zip((p, m, v, row_step), ref, before):
        assert _rel(got.double().cpu(), want.double().cpu()) <= 1e-6
        assert torch.equal(got[~touched], old[~touched])
        assert not torch.equal(got[touched], old[touched])  # the rows given were behind: they moved
    assert bool((clock.stamps[touched] == clock.length - 1).all())
    assert torch.equal(clock.stamps[~touched], stamps_before[~touched])


def test_the_adamw_launcher_iterates_the_steps_it_is_told_not_more():
    """The closed-form tail differs from iterating (the moments' term, large here): 1 step iterated
    and the rest as tail is not the same as every step iterated, and each equals its torch form."""
    from shardfc.head.fused.idle_rows import catch_up_adamw_

    results = []
    for iterate in (1, 8):
        p, m, v, row_step, clock = _adamw_clock_with_history(13, 5, 9)
        catch_up_adamw_(p, m, v, row_step, None, clock.stamps, clock.table, clock.length - 1, iterate)
        results.append(p)
    assert _rel(results[0].double().cpu(), results[1].double().cpu()) > 1e-3


def test_the_adamw_launcher_rounds_bf16_once_to_nearest():
    """bf16 weights and moments: each within half a bf16 unit of the torch form's fp32 result before
    its rounding (the two fp32 computations apart by a few fp32 units at most), as rounding to
    nearest leaves it; the interpreter truncates a bf16 store unless the kernel rounds first."""
    from shardfc.head.fused.idle_rows import catch_up_adamw_

    p, m, v, row_step, clock = _adamw_clock_with_history(13, 5, 9, dtype=torch.bfloat16)
    clock.exact_steps = 3
    ref, unrounded = [t.clone() for t in (p, m, v, row_step)], []

    def rnd(x, dtype):
        unrounded.append(x.clone())
        return x.to(dtype)

    copy.deepcopy(clock).catch_up_(ref[0], tuple(ref[1:]), None, rnd, kernel=False)
    catch_up_adamw_(p, m, v, row_step, None, clock.stamps, clock.table, clock.length - 1, 3)
    assert len(unrounded) == 3  # one block of rows: the weight and the two moments
    for got, exact in zip((p, m, v), unrounded):
        assert got.dtype == torch.bfloat16
        exact = exact.float()
        half_unit = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 9)  # bf16: 8 significant bits
        assert bool(((got.float() - exact).abs() <= half_unit + exact.abs() * 2.0**-18).all())


def test_the_adamw_launcher_on_the_meta_device_tells_the_plan_what_it_would_touch():
    from shardfc.head.fused import traffic
    from shardfc.head.fused.idle_rows import catch_up_adamw_

    seen = []
    p, m, v = (torch.empty(100, 8, device="meta") for _ in range(3))
    step, stamps, table = (torch.empty(100, dtype=torch.float64, device="meta"),
                           torch.empty(100, dtype=torch.int32, device="meta"),
                           torch.empty(4, 8, dtype=torch.float64, device="meta"))
    record = lambda kernel, reads, writes, flops: seen.append((kernel, [(r.part[0], r.nbytes) for r in reads],  # noqa: E731
                                                               [(w.part[0], w.nbytes) for w in writes]))
    with traffic.recording(record):
        catch_up_adamw_(p, m, v, step, torch.arange(10, device="meta"), stamps, table, 3, 2)
        catch_up_adamw_(p, m, v, step, None, stamps, table, 3, 2)
        catch_up_adamw_(p, m, v, step, torch.arange(0, device="meta"), stamps, table, 3, 2)  # no rows: nothing
    rows10, span = ("rows", 10 * 8 * 4), ("span", 100 * 8 * 4)  # the sampled rows gathered; every row a span
    assert seen == [("catch_up_adamw", [rows10] * 3 + [("span", 10 * 8)], [rows10] * 3),
                    ("catch_up_adamw", [span] * 3, [span] * 3)]
