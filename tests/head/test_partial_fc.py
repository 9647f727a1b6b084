"""Partial FC: sampling keeps positives and is reproducible; updates touch only sampled rows."""

import copy
import math

import pytest
import torch

import shardfc
from sgd_only import SGD_MOMENTUM
from shardfc import margins as M
from shardfc.head import sampling
from shardfc.head.partial_fc import (
    RowSparseAdamW,
    RowSparseSGD,
    head_optimizer,
    load_optimizer_rows,
    num_sampled,
    optimizer_rows,
    sample_rows,
)

C, D = 200, 8


def _batch(seed, B=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)


def test_sampling_keeps_positives_and_counts():
    pos = torch.tensor([3, 50, 51, 199])
    rows = sample_rows(pos, 200, 0.1, step=0, seed=0)
    assert rows.numel() == math.ceil(0.1 * 200)
    assert torch.isin(pos, rows).all() and torch.equal(rows, rows.sort().values)
    many = torch.arange(0, 200, 4)  # 50 positives > ⌈0.1·200⌉
    assert torch.equal(sample_rows(many, 200, 0.1, step=1, seed=0), many)
    assert num_sampled(10, 0.01, 0) == 1 and num_sampled(10, 1.0, 0) == 10


def test_sampling_reproducible_from_seed():
    def rows_for(seed):
        head = shardfc.ShardedMarginHead(D, C, sample_rate=0.2, sample_seed=seed)
        out = []
        for step in range(3):
            x, y = _batch(step)
            head(x, y)
            (rows,) = head.sampled_rows
            out.append(rows.clone())
            assert set(head.take_sampled_rows()) == {head.weight}
            assert head.sampled_rows is None  # taken
        return out

    a, b, c = rows_for(5), rows_for(5), rows_for(6)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))
    assert not torch.equal(a[0], a[1])  # a new sample every step


def test_sampling_every_class_equals_the_full_head():
    """A rate just under 1 samples all C classes through the sampling path: loss and gradients are the full head's."""
    x, y = _batch(0)
    x = x.double()
    full = shardfc.ShardedMarginHead(D, C, dtype=torch.float64, label_smoothing=0.1)
    part = shardfc.ShardedMarginHead(D, C, sample_rate=1 - 1e-9, dtype=torch.float64, label_smoothing=0.1)
    assert num_sampled(C, part.sample_rate, 0) == C
    grads = []
    for head in (full, part):
        xi = x.clone().requires_grad_(True)
        loss = head(xi, y)
        loss.backward()
        grads.append((loss.detach(), xi.grad, head.weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert isinstance(head_optimizer(part, "sgd", lr=0.1), RowSparseSGD)
    assert isinstance(head_optimizer(shardfc.ShardedMarginHead(D, C, sample_rate=1.0), "sgd", lr=0.1), torch.optim.SGD)


def test_eval_mode_uses_every_class():
    x, y = _batch(0)
    full = shardfc.ShardedMarginHead(D, C).eval()
    part = shardfc.ShardedMarginHead(D, C, sample_rate=0.1).eval()
    assert torch.equal(full(x, y), part(x, y))


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("sgd", dict(momentum=0.9, weight_decay=5e-4)),
        ("sgd", dict(momentum=0.9, weight_decay=5e-4, nesterov=True)),
        ("sgd", dict(momentum=0.0, weight_decay=1e-2)),
        ("adamw", dict(weight_decay=0.05)),
    ],
)
@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]])
@pytest.mark.parametrize("chunk", [None, 16])
def test_update_is_row_sparse(name, kwargs, devices, chunk):
    head = shardfc.ShardedMarginHead(D, C, margin=M.CosFace(), sample_rate=0.1, devices=devices, chunk_size=chunk)
    opt = head_optimizer(head, name, lr=0.1, **kwargs)
    assert isinstance(opt, (RowSparseSGD, RowSparseAdamW))
    for step in range(4):
        before = [w.detach().clone() for w in head.parameters()]
        states = [{k: v.clone() for k, v in opt.state[w].items()} for w in head.parameters()]
        x, y = _batch(step)
        opt.zero_grad()
        head(x, y).backward()
        sampled = [rows.clone() for rows in head.sampled_rows]
        opt.step()
        for w, old, state, rows in zip(head.parameters(), before, states, sampled):
            untouched = torch.ones(w.shape[0], dtype=torch.bool)
            untouched[rows] = False
            assert torch.equal(w.detach()[untouched], old[untouched])  # bit-identical
            assert not torch.equal(w.detach()[rows], old[rows])
            for key, value in opt.state[w].items():
                if key in state:
                    assert torch.equal(value[untouched], state[key][untouched]), key
                else:  # created this step: zero outside the sampled rows
                    assert (value[untouched] == 0).all(), key
        assert head.sampled_rows is None  # consumed by the step


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_row_sparse_optimizers_equal_torch_when_every_row_is_sampled(name):
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(30, 4))
    p2 = torch.nn.Parameter(p1.detach().clone())

    def every_row():
        return {p1: torch.arange(30)}

    if name == "sgd":
        ours = RowSparseSGD([p1], lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True, sampled_rows=every_row)
        ref = torch.optim.SGD([p2], lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
    else:
        ours = RowSparseAdamW([p1], lr=0.01, weight_decay=0.05, sampled_rows=every_row)
        ref = torch.optim.AdamW([p2], lr=0.01, weight_decay=0.05)
    for step in range(5):
        g = torch.randn(30, 4)
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p1.detach(), p2.detach(), rtol=1e-5, atol=1e-6)


def test_optimizer_argument_errors():
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.5)
    with pytest.raises(ValueError, match="'sgd' or 'adamw', got 'adam'"):
        head_optimizer(head, "adam", lr=0.1)
    with pytest.raises(ValueError, match="nesterov needs momentum"):
        head_optimizer(head, "sgd", lr=0.1, momentum=0.0, nesterov=True)


def test_partial_fc_gradient_accumulates_in_place_like_dense_indexing():
    grads = {}
    for in_place in (True, False):
        head = shardfc.ShardedMarginHead(D, C, sample_rate=0.2, dtype=torch.float64, weight_grad_in_place=in_place)
        for step in range(3):  # micro-steps: each a new sample, gradients summed
            x, y = _batch(step)
            head(x.double(), y).backward()
        grads[in_place] = head.weight.grad
        (rows,) = head.sampled_rows
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-12, atol=1e-15)
    untouched = torch.ones(C, dtype=torch.bool)
    untouched[rows] = False  # the union of the three samples
    assert (grads[True][untouched] == 0).all() and (grads[True][rows].abs().sum(1) > 0).all()


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_step_after_a_full_forward_is_dense(name):
    """Evaluation mode scores every class, so its gradient is dense: the step updates every row,
    exactly as torch's optimizer does (a forward without autograd records nothing)."""
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.1, dtype=torch.float64)
    ref_head = shardfc.ShardedMarginHead(D, C, dtype=torch.float64)  # same init, sample_rate 1
    opt = head_optimizer(head, name, lr=0.1, **SGD_MOMENTUM[name], weight_decay=5e-4)
    ref = head_optimizer(ref_head, name, lr=0.1, **SGD_MOMENTUM[name], weight_decay=5e-4)
    assert isinstance(ref, (torch.optim.SGD, torch.optim.AdamW))
    for step in range(2):
        x, y = _batch(step)
        for h, o in ((head, opt), (ref_head, ref)):
            o.zero_grad()
            h.eval()(x.double(), y).backward()
        assert head.sampled_rows == [None]  # every row took part
        opt.step()
        ref.step()
        torch.testing.assert_close(head.weight, ref_head.weight, rtol=1e-12, atol=1e-14)
        assert head.sampled_rows is None


def test_no_grad_forward_records_nothing_and_zero_grad_forgets():
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.1)
    opt = head_optimizer(head, "sgd", lr=0.1, momentum=0.9)
    x, y = _batch(0)
    head(x, y).backward()
    (rows,) = head.sampled_rows
    with torch.no_grad():  # e.g. a validation loss between backward and step: not part of the step
        head(x, y)
        head.eval()(x, y)
    head.train()
    assert torch.equal(head.sampled_rows[0], rows)
    before = head.weight.detach().clone()
    opt.step()
    untouched = torch.ones(C, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(head.weight.detach()[untouched], before[untouched])
    head(x, y).backward()
    opt.zero_grad()  # the gradient is gone, and so are its rows (e.g. a step the fp16 scaler skips)
    assert head.sampled_rows is None


def test_fused_optimizer_only_for_cuda_fp32():
    from shardfc.head.partial_fc import fused_optimizer_ok

    assert fused_optimizer_ok([torch.zeros(3)]) is None
    assert fused_optimizer_ok([]) is None
    head = shardfc.ShardedMarginHead(4, 10)
    opt = shardfc.head_optimizer(head, "sgd", lr=0.1)
    assert not opt.param_groups[0].get("fused")


def test_fused_optimizer_choice_with_the_device_stubbed(monkeypatch):
    """The CUDA choice, decided on the CPU: parameters that say they are CUDA fp32 get torch's fused
    SGD/AdamW, any other mix gets torch's default; head_optimizer passes the choice on."""
    from types import SimpleNamespace

    from shardfc.head import partial_fc

    cuda32, cuda16 = SimpleNamespace(is_cuda=True, dtype=torch.float32), SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert partial_fc.fused_optimizer_ok([cuda32, cuda32]) is True
    assert partial_fc.fused_optimizer_ok([cuda32, cuda16]) is None
    assert partial_fc.fused_optimizer_ok([cuda32, torch.zeros(3)]) is None
    made = {}
    for name in ("SGD", "AdamW"):
        monkeypatch.setattr(torch.optim, name, lambda params, name=name, **kw: made.setdefault(name, kw))
    monkeypatch.setattr(partial_fc, "fused_optimizer_ok", lambda params: True)
    head = shardfc.ShardedMarginHead(4, 10)
    shardfc.head_optimizer(head, "sgd", lr=0.1)
    shardfc.head_optimizer(head, "adamw", lr=0.1)
    assert made["SGD"]["fused"] is True and made["AdamW"]["fused"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_head_optimizer_is_fused_on_cuda():
    head = shardfc.ShardedMarginHead(4, 10, device="cuda")
    for name in ("sgd", "adamw"):
        assert shardfc.head_optimizer(head, name, lr=0.1).param_groups[0]["fused"] is True
    bf16 = shardfc.ShardedMarginHead(4, 10, device="cuda", dtype=torch.bfloat16)
    assert not shardfc.head_optimizer(bf16, "sgd", lr=0.1).param_groups[0].get("fused")


def test_sampling_reads_nothing_and_its_size_depends_on_the_batch_size_only(monkeypatch):
    """Partial FC's per-step sample: no read back to the host (it was a count of every shard's
    positives, read with one .tolist(), and before that a torch.unique and an int() per shard), and a
    fixed count per shard, ⌈r·n⌉ or the global batch size when larger, whatever the labels."""
    head = shardfc.ShardedMarginHead(8, 100, sample_rate=0.2, devices=["cpu", "cpu", "cpu"])
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "cpu"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name: reads.append(_n) or _r(self, *a))
    g = torch.Generator().manual_seed(0)
    for y in (torch.randint(0, 100, (12,), generator=g), torch.full((12,), 5), torch.arange(0, 36, 3),
              torch.full((12,), -1)):
        local = [torch.where((y >= r.start) & (y < r.stop), y - r.start, -1) for r in head.shard_ranges]
        rows, sub_labels, total = head._sample_classes(y, local)
        expected = [num_sampled(len(r), 0.2, 12) for r in head.shard_ranges]
        assert [r.numel() for r in rows] == expected == [12, 12, 12] and total == 36
        for r, lab, sub in zip(rows, local, sub_labels):  # every positive sampled, labels re-indexed into the sample
            assert torch.equal(torch.where(lab >= 0, r[sub.clamp(min=0)], -1), lab)
    assert reads == []


def test_more_positives_than_the_rate_allows_are_all_kept_and_the_loss_is_exact():
    """⌈0.05·200⌉ = 10 classes, but a batch of 32 samples of 32 distinct classes: the shard keeps 32
    (the batch size), every positive among them, and the loss is the dense loss over those classes."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, D, generator=g, dtype=torch.float64)
    y = torch.randperm(C, generator=g)[:32]
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.05, dtype=torch.float64, label_smoothing=0.1)
    loss = head(x, y)
    (rows,) = head.sampled_rows
    assert rows.numel() == 32 and torch.isin(y, rows).all()
    sub = torch.searchsorted(rows, y)
    ref = shardfc.reference_loss(x, head.weight.detach()[rows], sub, head.margin, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- the counter-based draw


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_draw_is_the_documented_hash_of_row_seed_and_step():
    """``draw_keys`` against the construction it documents, written again here with Python's
    integers (no int64 to wrap): per step two words from the step and the seed, per row two rounds of
    lowbias32; positives above every key."""
    from shardfc.head.sampling import PRESENT_KEY, draw_keys, mix32
    from shardfc.seeding import mix_seed

    words = [0, 1, 2, 0xDEADBEEF, 0x80000000, 0xFFFFFFFF, 12345]
    assert mix32(torch.tensor(words)).tolist() == [_lowbias32(w) for w in words]
    present = torch.zeros(9, dtype=torch.bool)
    present[[2, 7]] = True
    for seed, step in [(0, 0), (5, 3), (2**62, 2**33 + 1)]:
        s1, s2 = mix_seed(seed) % 2**32, mix_seed(seed) // 2**32 % 2**32  # the stream's two words
        a = _lowbias32(((step & 0xFFFFFFFF) ^ s1))
        b = _lowbias32(a ^ s2)
        expect = [PRESENT_KEY if r in (2, 7) else _lowbias32(_lowbias32(r ^ a) ^ b) for r in range(9)]
        assert draw_keys(present, step, seed).tolist() == expect
        assert draw_keys(present, torch.tensor([step]), seed).tolist() == expect  # from a device counter too
    # Past one block of the torch form (DRAW_ROWS rows at a time): every block keys its own rows
    n = sampling.DRAW_ROWS + 5
    s1, s2 = mix_seed(4) % 2**32, mix_seed(4) // 2**32 % 2**32
    a = _lowbias32(9 ^ s1)
    b = _lowbias32(a ^ s2)
    tail = draw_keys(torch.zeros(n, dtype=torch.bool), 9, 4)[-10:].tolist()
    assert tail == [_lowbias32(_lowbias32(r ^ a) ^ b) for r in range(n - 10, n)]
    # sample_rows' stream is seed 0 unless given
    assert torch.equal(sample_rows(torch.tensor([3]), 200, 0.1, step=2), sample_rows(torch.tensor([3]), 200, 0.1, 2, 0))


def test_the_draw_is_uniform_and_new_every_step():
    """Over 3,000 steps every negative row is drawn as often as a uniform sample draws it (within 6
    binomial standard deviations), positives always, and consecutive samples overlap as two
    independent ones do (within 6 deviations of the hypergeometric mean)."""
    from shardfc.head.sampling import sample_present

    n, keep, steps = 400, 40, 3000
    present = torch.zeros(n, dtype=torch.bool)
    present[:8] = True
    counts = torch.zeros(n)
    overlap, previous = 0.0, None
    for t in range(steps):
        rows = sample_present(present, keep, t, seed=11)
        assert rows.numel() == keep and torch.equal(rows, rows.unique())
        counts[rows] += 1
        neg = set(rows.tolist()) - set(range(8))
        if previous is not None:
            overlap += len(neg & previous)
        previous = neg
    assert torch.all(counts[:8] == steps)
    p = (keep - 8) / (n - 8)
    sd = math.sqrt(steps * p * (1 - p))
    assert (counts[8:] - steps * p).abs().max() <= 6 * sd
    m = keep - 8  # per step: m of n - 8 negatives; the overlap of two independent draws has mean m²/(n-8)
    mean, var = m * m / (n - 8), m * p * (1 - p) * (n - 8 - m) / (n - 9)
    assert abs(overlap - (steps - 1) * mean) <= 6 * math.sqrt((steps - 1) * var)


def test_a_step_number_set_on_the_host_is_the_one_the_device_counter_draws():
    """``sample_step`` set by hand (as a loaded checkpoint sets it) is what the next draw reads: the
    device's counter is rewritten, and the sample is that step's of a run that got there itself."""
    run = shardfc.ShardedMarginHead(D, C, sample_rate=0.2, sample_seed=3)
    for step in range(4):
        run.forget_sampled_rows()
        run(*_batch(step))
    at_3 = run.sampled_rows[0]
    jumped = shardfc.ShardedMarginHead(D, C, sample_rate=0.2, sample_seed=3)
    jumped(*_batch(0))  # its counter made, at step 0, then advanced to 1
    jumped.forget_sampled_rows()
    jumped.sample_step = 3
    jumped(*_batch(3))
    assert torch.equal(jumped.sampled_rows[0], at_3) and jumped.sample_step == 4
    (counter,) = jumped.draw_tensors()
    assert int(counter) == 4 and jumped._draw_steps._held["cpu"][1] == 4  # the host's mirror of it too
    assert jumped._draw_steps.on(torch.device("cpu"), 4) is counter  # the tensor the draw reads, no number


def test_each_param_group_has_its_own_device_numbers_and_the_idle_step_matrix_is_fp64():
    """The numbers a kernel or the idle clock reads are per group (two groups at two learning rates
    must not share one tensor) and the idle step's matrix keeps the eager record's fp64."""
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.2, devices=["cpu", "cpu"])
    w0, w1 = head.shard_weights
    opt = RowSparseSGD([{"params": [w0], "lr": 0.1}, {"params": [w1], "lr": 0.01}], lr=0.1, momentum=0.9,
                       sampled_rows=head.take_sampled_rows)
    g0, g1 = opt.param_groups
    cpu = torch.device("cpu")
    t0, t1 = opt._device_scalars(g0, cpu, (0.1, 0.9, 0.0)), opt._device_scalars(g1, cpu, (0.01, 0.9, 0.0))
    assert t0 is not t1 and t0.tolist() != t1.tolist()
    opt.zero_grad()
    head(*_batch(0)).backward()
    opt.step()
    c0, c1 = opt._clocks[w0], opt._clocks[w1]
    m0, m1 = opt._step_record_scalars(c0, g0), opt._step_record_scalars(c1, g1)
    assert m0 is not m1 and m0.dtype == m1.dtype == torch.float64
    from shardfc.head.catch_up import sgd_idle_matrix

    assert m1.tolist() == [v for row in sgd_idle_matrix(0.01, 0.9, 0.0, False) for v in row]


def test_a_dense_step_after_sampled_ones_leaves_no_row_behind():
    """A step of every row (an evaluation-mode forward in training) brings every row to now: the
    idle clock goes, so no later catch-up applies the steps a row already took."""
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.2)
    opt = head_optimizer(head, "sgd", lr=0.1, momentum=0.9)
    for step, training in enumerate([True, True, False]):
        head.train(training)
        opt.zero_grad()
        head(*_batch(step)).backward()
        opt.step()
        assert bool(opt._clocks) == training


@pytest.mark.parametrize("momentum, weight_decay, nesterov", [(0.0, 0.0, False), (0.9, 0.1, False), (0.9, 0.1, True)])
def test_a_bf16_sgd_step_is_the_fp32_step_rounded_once(momentum, weight_decay, nesterov):
    # Two dense steps of bf16 weights: the weights, gradient and momentum are read into fp32, the
    # step is formed there and only its results are rounded (to nearest) to bf16 — bit for bit the
    # plain fp32 formula (a product formed in bf16, as `lr * g` of a bf16 g, would round early).
    gen = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter(torch.randn(6, 40, generator=gen).to(torch.bfloat16))
    opt = RowSparseSGD([p], lr=0.37, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    w, buf = p.detach().float(), torch.zeros(6, 40)
    for _ in range(2):
        grad = torch.randn(6, 40, generator=gen).to(torch.bfloat16)
        p.grad = grad.clone()
        opt.step()
        g = grad.float() + weight_decay * w if weight_decay else grad.float()
        if momentum:
            b = buf * momentum + g
            buf = b.to(torch.bfloat16).float()
            g = g + momentum * b if nesterov else b
        w = (w - 0.37 * g).to(torch.bfloat16).float()
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach().float(), w)
        if momentum:
            assert torch.equal(opt.state[p]["momentum_buffer"].float(), buf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_adamw_step_is_formed_in_fp32_with_fp32_bias_corrections(dtype):
    # Two dense steps: weights and moments read into fp32, the bias corrections (from the fp64 per-row
    # step count) taken to fp32 before they meet the moments, results rounded (to nearest) once.
    gen = torch.Generator().manual_seed(3)
    lr, (b1, b2), eps, wd = 0.05, (0.8, 0.95), 1e-6, 0.1
    p = torch.nn.Parameter(torch.randn(5, 48, generator=gen).to(dtype))
    opt = RowSparseAdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    w, m, v = p.detach().float().clone(), torch.zeros(5, 48), torch.zeros(5, 48)
    for step in (1, 2):
        grad = torch.randn(5, 48, generator=gen).to(dtype)
        p.grad = grad.clone()
        opt.step()
        g = grad.float()
        m = m.lerp(g, 1 - b1)
        v = v.mul(b2).addcmul(g, g, value=1 - b2)
        t = torch.full((5,), float(step), dtype=torch.float64)
        bias1 = (1 - b1**t).float().unsqueeze(1)
        bias2_sqrt = (1 - b2**t).sqrt().float().unsqueeze(1)
        w = (w * (1 - lr * wd) - (lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps)).to(dtype).float()
        m, v = m.to(dtype).float(), v.to(dtype).float()
        assert p.dtype == dtype
        assert torch.equal(p.detach().float(), w)
        assert torch.equal(opt.state[p]["exp_avg"].float(), m)
        assert torch.equal(opt.state[p]["exp_avg_sq"].float(), v)


def test_the_idle_clock_holds_full_catch_up_every_entries_and_restarts_at_the_next_step(monkeypatch):
    # The table opens with one entry; each sampled step with momentum adds one; once it holds more
    # than FULL_CATCH_UP_EVERY the step catches every row up and the table restarts at one entry.
    monkeypatch.setattr("shardfc.head.partial_fc.FULL_CATCH_UP_EVERY", 3)
    p = torch.nn.Parameter(torch.randn(6, 4))
    rows = torch.tensor([0, 1])
    opt = RowSparseSGD([p], lr=0.1, momentum=0.9, sampled_rows=lambda: {p: rows})
    lengths = []
    for _ in range(6):
        p.grad = torch.randn(6, 4)
        opt.step()
        lengths.append(opt._clocks[p].length)
    assert lengths == [2, 3, 1, 2, 3, 1]


def test_sampled_steps_of_sgd_without_momentum_or_decay_record_nothing_for_idle_rows():
    # Such a step leaves an idle row as it is: nothing to record, the table keeps its opening entry.
    p = torch.nn.Parameter(torch.randn(6, 4))
    rows = torch.tensor([0, 1])
    opt = RowSparseSGD([p], lr=0.1, sampled_rows=lambda: {p: rows})
    for _ in range(3):
        p.grad = torch.randn(6, 4)
        opt.step()
    assert opt._clocks[p].length == 1


def test_adamw_defaults_are_torchs():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    ours, torchs = RowSparseAdamW([p]).defaults, torch.optim.AdamW([p]).defaults
    assert {k: ours[k] for k in ("lr", "betas", "eps", "weight_decay")} == {
        k: torchs[k] for k in ("lr", "betas", "eps", "weight_decay")}
    assert ours["rounding_seed"] == RowSparseSGD([p], lr=0.1).defaults["rounding_seed"] == 0


@pytest.mark.parametrize("kw, text", [
    (dict(lr=-0.1), "lr must be >= 0, got -0.1"),
    (dict(lr=math.nan), "lr must be finite, got nan"),
    (dict(eps=-1e-8), "eps must be >= 0, got -1e-08"),
    (dict(eps=math.inf), "eps must be finite, got inf"),
    (dict(weight_decay=-0.01), "weight_decay must be >= 0, got -0.01"),
    (dict(weight_decay=math.nan), "weight_decay must be finite, got nan"),
    (dict(betas=(1.0, 0.9)), "betas[0] must be in [0, 1), got 1.0"),
    (dict(betas=(-0.1, 0.9)), "betas[0] must be in [0, 1), got -0.1"),
    (dict(betas=(0.9, 1.0)), "betas[1] must be in [0, 1), got 1.0"),
    (dict(betas=(0.9, -0.1)), "betas[1] must be in [0, 1), got -0.1"),
    (dict(betas=(0.9, math.nan)), "betas[1] must be a finite number, got nan"),
    (dict(betas=(0.9,)), "betas must be two numbers in [0, 1), got (0.9,)"),
    (dict(betas="ab"), "betas must be two numbers in [0, 1), got 'ab'"),
])
def test_adamw_refuses_each_hyper_parameter_out_of_range_alone(kw, text):
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError) as err:
        RowSparseAdamW([p], **kw)
    assert str(err.value) == text


def test_adamw_takes_a_zero_learning_rate_and_betas_of_zero():
    p = torch.nn.Parameter(torch.ones(2, 2))
    opt = RowSparseAdamW([p], lr=0.0, betas=(0.0, 0.0))
    p.grad = torch.ones(2, 2)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(2, 2))


def test_adamw_continues_torchs_adamw_from_its_state():
    # torch's state keeps one scalar `step`: it becomes every row's count, so the next step's bias
    # corrections are torch's fourth step's (equal up to fp32 rounding of the same formula).
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(4, 8, generator=gen) for _ in range(4)]
    a = torch.nn.Parameter(torch.randn(4, 8, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=0.05, foreach=False)
    for g in grads[:3]:
        a.grad = g.clone()
        ref.step()
    opt = RowSparseAdamW([b], lr=0.05)
    tensors, extras = optimizer_rows(ref, [a])
    assert set(tensors) == {"exp_avg", "exp_avg_sq"} and extras["step"] == 3  # the scalar step is no row tensor
    load_optimizer_rows(opt, [b], [(0, 4)], tensors, extras)
    b.data.copy_(a.detach())
    a.grad, b.grad = grads[3].clone(), grads[3].clone()
    ref.step()
    opt.step()
    assert "step" not in opt.state[b]
    assert torch.equal(opt.state[b]["row_step"], torch.full((4,), 4.0, dtype=torch.float64))
    # A step moves a weight by about lr = 0.05; the two fp32 forms differ by a few ulps of that.
    torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=8 * 0.05 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_load_state_dict_continues_torchs_optimizer_from_its_state_dict(kind):
    """torch's own SGD / AdamW state_dict loads (its groups hold none of the rounding settings: this
    optimizer's stay) and the next step is torch's."""
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(4, 8, generator=gen) for _ in range(4)]
    a = torch.nn.Parameter(torch.randn(4, 8, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    if kind == "sgd":
        ref = torch.optim.SGD([a], lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False)
        opt = RowSparseSGD([b], lr=0.5, momentum=0.5, rounding_seed=9)
    else:
        ref = torch.optim.AdamW([a], lr=0.05, foreach=False)
        opt = RowSparseAdamW([b], lr=0.5, rounding_seed=9)
    for g in grads[:3]:
        a.grad = g.clone()
        ref.step()
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # a state_dict holds the optimizer's own tensors
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["rounding_seed"] == 9
    b.data.copy_(a.detach())
    a.grad, b.grad = grads[3].clone(), grads[3].clone()
    ref.step()
    opt.step()
    torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=8 * 0.05 * torch.finfo(torch.float32).eps)


def test_load_state_dict_refuses_a_state_of_another_optimizer_or_another_head():
    """torch's load_state_dict takes them: an SGD state in an AdamW failed at its first step (KeyError
    'betas'), a momentum of 20 rows in a head of 30 with an IndexError, or not at all while the
    sampled rows stayed below 20."""
    def trained(kind, classes, **kw):
        head = shardfc.ShardedMarginHead(D, classes, sample_rate=0.5, dtype=torch.float64)
        opt = head_optimizer(head, kind, lr=0.1, **kw)
        x, y = _batch(0)
        head(x.double(), y % classes).backward()
        opt.step()
        return head, opt

    _, sgd = trained("sgd", 20, momentum=0.9)
    _, adamw = trained("adamw", 20)
    head, fresh_adamw = trained("adamw", 20)
    before = {k: v.clone() for k, v in fresh_adamw.state[head.weight].items()}
    with pytest.raises(ValueError) as e:
        fresh_adamw.load_state_dict(sgd.state_dict())
    assert str(e.value) == ("RowSparseAdamW.load_state_dict: param group 0 has no 'betas', 'eps': a state saved by "
                            "another kind of optimizer (its settings: lr, momentum, nesterov, rounding, rounding_seed, "
                            "rounding_step, weight_decay)")
    assert all(torch.equal(v, before[k]) for k, v in fresh_adamw.state[head.weight].items())  # left as it was
    with pytest.raises(ValueError, match=r"^RowSparseSGD.load_state_dict: param group 0 has no 'momentum', 'nesterov': "):
        trained("sgd", 20, momentum=0.9)[1].load_state_dict(adamw.state_dict())
    _, wider = trained("sgd", 30, momentum=0.9)
    with pytest.raises(ValueError) as e:
        wider.load_state_dict(sgd.state_dict())
    assert str(e.value) == ("RowSparseSGD.load_state_dict: the state 'momentum_buffer' of parameter 0 has shape (20, 8), "
                            "the parameter (30, 8): a state saved for another head (other classes, another shard, or "
                            "another embedding width)")
    other_width = shardfc.ShardedMarginHead(D + 1, 20, sample_rate=0.5)
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 has shape \(20, 8\), the parameter \(20, 9\)"):
        head_optimizer(other_width, "adamw", lr=0.1).load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match=r"^RowSparseSGD.load_state_dict: expected an optimizer's state_dict "
                                         r"\(keys 'state' and 'param_groups'\), got list$"):
        sgd.load_state_dict([])
    trained("sgd", 20, momentum=0.9)[1].load_state_dict(sgd.state_dict())  # its own kind and shape: taken
    own = adamw.state_dict()
    assert own["state"][0]["row_step"].shape == (20,)  # one count a row: 1-D, of the parameter's rows
    trained("adamw", 20)[1].load_state_dict(own)
    short = copy.deepcopy(own)
    short["state"][0]["row_step"] = short["state"][0]["row_step"][:15]
    with pytest.raises(ValueError, match=r"'row_step' of parameter 0 has shape \(15,\), the parameter \(20, 8\)"):
        trained("adamw", 20)[1].load_state_dict(short)
    # a state kept under an index no parameter has (torch keeps it as it is) is passed over, not the
    # states after it
    orphan = copy.deepcopy(sgd.state_dict())
    orphan["state"] = {7: {"momentum_buffer": torch.zeros(3)}, **orphan["state"]}
    trained("sgd", 20, momentum=0.9)[1].load_state_dict(orphan)
    orphan["state"][0]["momentum_buffer"] = torch.zeros(19, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'momentum_buffer' of parameter 0 has shape \(19, 8\)"):
        trained("sgd", 20, momentum=0.9)[1].load_state_dict(orphan)
    no_params = copy.deepcopy(sgd.state_dict())
    del no_params["param_groups"][0]["params"]
    with pytest.raises(KeyError, match="params"):  # torch's own refusal
        trained("sgd", 20, momentum=0.9)[1].load_state_dict(no_params)


@pytest.mark.parametrize("sample_rate", [1.0, 0.5], ids=["torch", "row-sparse"])
@pytest.mark.parametrize("saved_by, loaded_into", [("sgd", "adamw"), ("adamw", "sgd")])
def test_a_sharded_state_of_the_other_kind_of_optimizer_is_refused_before_anything_is_written(
        saved_by, loaded_into, sample_rate):
    """``load_sharded_state(state, optimizer)`` restores the saved param groups and state as they are:
    an SGD state into an AdamW failed at its first step (KeyError 'exp_avg'), and an AdamW state into
    an SGD trained on silently with AdamW's learning rate and (decoupled) weight decay as SGD's,
    beside moments nothing read. Refused, naming both kinds and the ways out, the head and its
    optimizer left as they were; the same kind is taken."""
    def trained(kind):
        head = shardfc.ShardedMarginHead(D, C, sample_rate=sample_rate)
        opt = head_optimizer(head, kind, lr=0.1, weight_decay=5e-4, **({"momentum": 0.9} if kind == "sgd" else {}))
        x, y = _batch(0)
        head(x, y).backward()
        opt.step()
        return head, opt

    state = _sharded_state_of(*trained(saved_by))
    head, opt = trained(loaded_into)
    weight, groups = head.weight.detach().clone(), copy.deepcopy(opt.param_groups[0])
    kept = {k: v.clone() for k, v in opt.state[head.weight].items()}
    kinds = {"sgd": ("SGD", "'momentum'"), "adamw": ("AdamW", "'betas'")}
    opt_state_keys = {"sgd": {"momentum_buffer"},
                      "adamw": {"exp_avg", "exp_avg_sq", "step" if sample_rate == 1 else "row_step"}}
    theirs, setting = kinds[saved_by]
    with pytest.raises(ValueError) as e:
        head.load_sharded_state(state, opt)
    assert str(e.value) == (
        f"the saved head optimizer state is {theirs}'s (its param group 0 has {setting}), this optimizer is "
        f"{type(opt).__name__}: load it into an {theirs} optimizer, or load the head without its optimizer state "
        "(its optimizer then starts fresh)")
    assert torch.equal(head.weight.detach(), weight) and opt.param_groups[0].keys() == groups.keys()
    assert all(torch.equal(v, kept[k]) for k, v in opt.state[head.weight].items())
    # without its param groups (a hand-made state), the state's tensors tell the kind
    del state["extras"]["optimizer.param_groups"]
    with pytest.raises(ValueError, match=f"AdamW's state; this optimizer is {type(opt).__name__}" if saved_by == "adamw"
                       else f"SGD's state; this optimizer is {type(opt).__name__}"):
        head.load_sharded_state(state, opt)
    head.load_sharded_state(state)  # the rows alone: taken
    same_head, same_opt = trained(saved_by)
    same_head.load_sharded_state(_sharded_state_of(*trained(saved_by)), same_opt)
    assert same_opt.state[same_head.weight].keys() == opt_state_keys[saved_by]


def _sharded_state_of(head, opt):
    state = head.sharded_state(opt)
    assert any(k.startswith("optimizer.") for k in state["tensors"]), "no optimizer state saved: nothing to check"
    return state


@pytest.mark.parametrize("setting", [dict(dampening=0.1), dict(maximize=True)])
def test_a_sharded_state_of_torchs_sgd_with_a_setting_the_row_sparse_sgd_lacks_is_refused(setting):
    head = shardfc.ShardedMarginHead(D, C)
    torch_sgd = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, **setting)
    x, y = _batch(0)
    head(x, y).backward()
    torch_sgd.step()
    state = head.sharded_state(torch_sgd)
    sparse = shardfc.ShardedMarginHead(D, C, sample_rate=0.5)
    named = ", ".join(f"{key}={value!r}" for key, value in setting.items())
    with pytest.raises(ValueError) as e:
        sparse.load_sharded_state(state, head_optimizer(sparse, "sgd", lr=0.1, momentum=0.9))
    assert str(e.value) == (f"the saved head optimizer state's param group 0 has {named}, which RowSparseSGD does not "
                            "implement: its steps would not be those the state was saved for")


@pytest.mark.parametrize("kind, setting", [("sgd", dict(dampening=0.1)), ("sgd", dict(maximize=True)),
                                           ("adamw", dict(amsgrad=True)), ("adamw", dict(maximize=True)),
                                           ("adamw", dict(amsgrad=True, maximize=True))])
def test_load_state_dict_refuses_a_torch_setting_it_does_not_implement(kind, setting):
    p = torch.nn.Parameter(torch.randn(4, 8))
    ref = (torch.optim.SGD([p], lr=0.1, momentum=0.9, **setting) if kind == "sgd"
           else torch.optim.AdamW([p], lr=0.1, **setting))
    p.grad = torch.ones_like(p)
    ref.step()
    opt = RowSparseSGD([torch.nn.Parameter(p.detach().clone())], lr=0.1) if kind == "sgd" else \
        RowSparseAdamW([torch.nn.Parameter(p.detach().clone())])
    named = ", ".join(f"{key}={value!r}" for key, value in sorted(setting.items()))
    with pytest.raises(ValueError) as e:
        opt.load_state_dict(ref.state_dict())
    assert str(e.value) == (f"{type(opt).__name__}.load_state_dict: param group 0 has {named}, which "
                            f"{type(opt).__name__} does not implement: its steps would not be those the state was saved for")


def test_why_a_backward_cannot_update_a_parameter_follows_its_own_groups_rounding():
    # On the meta device the kernel serves bf16 weights rounded to nearest, not stochastically.
    a, b, outsider = (torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16, device="meta")) for _ in range(3))
    opt = RowSparseSGD([{"params": [a]}, {"params": [b], "rounding": "stochastic"}], lr=0.1)
    assert opt.fused_update_unavailable(a) is None
    assert opt.fused_update_unavailable(b) == "rounding='stochastic' (the kernel rounds to nearest)"
    assert opt.fused_update_unavailable(outsider) is None  # not a parameter: the defaults' rounding


def test_catch_up_kernel_true_refuses_a_parameter_it_cannot_serve_naming_why():
    p = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
    rows = torch.tensor([0, 1])
    opt = RowSparseSGD([p], lr=0.1, momentum=0.9, rounding="stochastic", sampled_rows=lambda: {p: rows})
    opt.catch_up_kernel = True
    p.grad = torch.ones(6, 4, dtype=torch.bfloat16)
    opt.step()  # the first sampled step: no row behind yet
    with pytest.raises(ValueError) as err:
        opt.step()
    assert str(err.value) == "catch_up_kernel=True cannot serve this parameter: rounding='stochastic' (the kernel rounds to nearest)"


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_kernel_serves_a_parameter_by_choice_and_says_why_not(monkeypatch, rounding):
    import importlib.util

    from shardfc.head.partial_fc import kernel_serves

    p = torch.zeros(4, 8, dtype=torch.bfloat16, device="meta")  # the kernel fits it, but it is not CUDA
    fits = rounding == "nearest"
    assert kernel_serves(False, p, rounding, "x=True") is False
    assert kernel_serves(None, p, rounding, "x=True") is False  # automatic: CUDA only
    if fits:
        assert kernel_serves(True, p, rounding, "x=True") is True
    else:
        with pytest.raises(ValueError) as err:
            kernel_serves(True, p, rounding, "x=True")
        assert str(err.value) == "x=True cannot serve this parameter: rounding='stochastic' (the kernel rounds to nearest)"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    assert kernel_serves(None, p, rounding, "x=True") is False and kernel_serves(False, p, rounding, "x=True") is False
    with pytest.raises(ValueError) as err:
        kernel_serves(True, p, rounding, "x=True")
    assert str(err.value) == "x=True cannot serve this parameter: Triton is not installed (pip install 'shardfc[gpu]')"
    opt = RowSparseSGD([torch.nn.Parameter(p)], lr=0.1, rounding=rounding)
    assert opt.fused_update_unavailable(opt.param_groups[0]["params"][0]) == "Triton is not installed (pip install 'shardfc[gpu]')"


def test_stochastic_rounding_draws_by_seed_step_and_parameter_and_a_catch_up_draws_its_own():
    from shardfc.head.partial_fc import _CATCH_UP_DRAWS
    from shardfc.head.rounding import round_to
    from shardfc.seeding import mix_seed

    ps = [torch.nn.Parameter(torch.zeros(64, 8, dtype=torch.bfloat16)) for _ in range(2)]
    opt = RowSparseSGD(ps, lr=0.1, rounding="stochastic", rounding_seed=7)
    (group,) = opt.param_groups
    group["rounding_step"] = 3
    x = 1 + torch.rand(64, 8, generator=torch.Generator().manual_seed(0)) / 64  # between bf16's grid points

    def drawn(*seed):
        return round_to(x, torch.bfloat16, "stochastic", torch.Generator().manual_seed(mix_seed(*seed)))

    cpu = torch.device("cpu")
    draws = {(i, c): opt._rounder(group, i, cpu, catch_up=c)(x, torch.bfloat16) for i in (0, 1) for c in (False, True)}
    for i in (0, 1):
        assert torch.equal(draws[i, False], drawn(7, 3, i))
        assert torch.equal(draws[i, True], drawn(7, 3, i, _CATCH_UP_DRAWS))
        assert torch.equal(opt._rounder(group, i, cpu)(x, torch.bfloat16), draws[i, False])  # a step's by default
    values = list(draws.values())
    assert all(not torch.equal(a, b) for k, a in enumerate(values) for b in values[k + 1:])
    group["rounding"] = "nearest"
    assert torch.equal(opt._rounder(group, 0, cpu, catch_up=True)(x, torch.bfloat16), x.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["row_indices", "row_grad", "dense"])
def test_a_step_over_several_update_blocks_gives_each_row_its_own_gradient(monkeypatch, kind):
    # Blocks of 2 rows (UPDATE_BLOCK is 65536): 5 sampled rows in 3 blocks, each row its gradient's
    # row; a dense step: 8 rows (more than the 4 columns) in 4 blocks.
    from shardfc.head.sampling import RowGrad

    monkeypatch.setattr("shardfc.head.partial_fc.UPDATE_BLOCK", 2)
    gen = torch.Generator().manual_seed(11)
    p = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    rows = torch.tensor([0, 2, 3, 5, 6]) if kind != "dense" else torch.arange(8)
    values = torch.randn(rows.numel(), 4, generator=gen)
    start = p.detach().clone()
    if kind == "row_grad":
        entry = {p: RowGrad(rows, values)}
    else:
        entry = {p: rows} if kind == "row_indices" else {}
        p.grad = torch.zeros(8, 4).index_copy_(0, rows, values)
    opt = RowSparseSGD([p], lr=0.5, sampled_rows=lambda: entry, idle_rows="lazy")
    opt.step()
    expected = start.clone()
    expected[rows] = start[rows] - 0.5 * values
    assert torch.equal(p.detach(), expected)


def test_backward_update_hands_the_step_once_a_step_and_only_where_the_kernel_serves():
    # On the meta device the kernel serves fp32 and bf16 rounded to nearest (nothing is launched here).
    p = torch.nn.Parameter(torch.zeros(4, 8, device="meta"))
    q = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16, device="meta"))
    opt = RowSparseSGD([{"params": [p]}, {"params": [q], "rounding": "stochastic"}], lr=0.1, momentum=0.9,
                       weight_decay=0.01, nesterov=True)
    assert opt.backward_update(p) is None  # fused_update off: the step updates p
    opt.fused_update = True
    assert opt.backward_update(q) is None  # stochastic rounding of bf16: the kernel cannot
    u = opt.backward_update(p)
    assert u.param is p and u.momentum_buffer is opt.state[p]["momentum_buffer"]
    assert (u.lr, u.momentum, u.weight_decay, u.nesterov) == (0.1, 0.9, 0.01, True)
    assert u.hyper is not None and u.hyper.shape == (3,) and u.hyper.device == p.device
    with pytest.raises(RuntimeError) as err:
        opt.backward_update(p)
    assert str(err.value) == (
        "the head's optimizer step already ran in an earlier backward of this step "
        "(head_optimizer(..., fused_update=True) updates the weights in the backward): "
        "accumulating gradients over several backward passes needs fused_update=False "
        "(shardfc train chooses it by itself when grad_accum > 1)")
    opt.zero_grad()  # a new step
    assert opt.backward_update(p) is not None
    with pytest.raises(ValueError) as err:
        opt.backward_update(torch.nn.Parameter(torch.zeros(4, 8, device="meta")))
    assert str(err.value) == "backward_update: the tensor is not a parameter of this optimizer"


def test_adamw_backward_update_carries_its_state_and_numbers():
    p = torch.nn.Parameter(torch.zeros(4, 8, device="meta"))
    opt = RowSparseAdamW([p], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    opt.fused_update = True
    u = opt.backward_update(p)
    state = opt.state[p]
    assert u.exp_avg is state["exp_avg"] and u.exp_avg_sq is state["exp_avg_sq"] and u.row_step is state["row_step"]
    assert (u.lr, u.betas, u.eps, u.weight_decay) == (0.01, (0.8, 0.9), 1e-6, 0.05)
    assert u.hyper is not None and u.hyper.shape == (len(u.hyper_values()),) and u.hyper.device == p.device


@pytest.mark.parametrize("kw, error, text", [
    (dict(lr=-0.1), ValueError, "lr must be >= 0, got -0.1"),
    (dict(lr=math.inf), ValueError, "lr must be finite, got inf"),
    (dict(lr="0.1"), TypeError, "lr must be a real number, got '0.1' (str)"),
    (dict(lr=0.1, momentum=-0.5), ValueError, "momentum must be >= 0, got -0.5"),
    (dict(lr=0.1, momentum=math.nan), ValueError, "momentum must be finite, got nan"),
    (dict(lr=0.1, weight_decay=-0.5), ValueError, "weight_decay must be >= 0, got -0.5"),
    (dict(lr=0.1, weight_decay=math.nan), ValueError, "weight_decay must be finite, got nan"),
    (dict(lr=0.1, nesterov=True), ValueError, "nesterov needs momentum > 0"),
    (dict(lr=0.1, fused=2), TypeError, "fused must be None (automatic), True or False, got 2"),
    (dict(lr=0.1, fused="yes"), TypeError, "fused must be None (automatic), True or False, got 'yes'"),
])
def test_sgd_refuses_each_bad_argument_alone(kw, error, text):
    with pytest.raises(error) as err:
        RowSparseSGD([torch.nn.Parameter(torch.zeros(2, 2))], **kw)
    assert str(err.value) == text


@pytest.mark.parametrize("fused", [None, True, False])
def test_sgd_keeps_its_fused_choice_and_takes_a_zero_learning_rate(fused):
    assert RowSparseSGD([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.0, fused=fused).fused is fused


def test_zero_grad_sets_the_gradients_to_none_by_default_as_torchs_optimizers_do():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = RowSparseSGD([p], lr=0.1)
    p.grad = torch.ones(2, 2)
    opt.zero_grad()
    assert p.grad is None
    p.grad = torch.ones(2, 2)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(2, 2))


class _SampledStandIn(torch.nn.Module):
    """A head under Partial FC as head_optimizer sees it: a sample rate below 1 and its rows' source."""

    sample_rate = 0.5

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 2))

    def take_sampled_rows(self):
        return {}


def test_head_optimizer_passes_its_numbers_and_defaults_to_the_optimizer_it_picks():
    dense = torch.nn.Linear(2, 4)
    sgd = head_optimizer(dense, "sgd", lr=0.1)
    assert type(sgd) is torch.optim.SGD
    assert (sgd.defaults["momentum"], sgd.defaults["weight_decay"], sgd.defaults["nesterov"]) == (0.9, 5e-4, False)
    assert head_optimizer(dense, "sgd", lr=0.1, nesterov=True).defaults["nesterov"] is True
    adamw = head_optimizer(dense, "adamw", lr=0.1, betas=(0.5, 0.6), eps=1e-3)
    assert type(adamw) is torch.optim.AdamW and (adamw.defaults["betas"], adamw.defaults["eps"]) == ((0.5, 0.6), 1e-3)
    assert head_optimizer(dense, "adamw", lr=0.1).defaults["eps"] == 1e-8
    sampled = head_optimizer(_SampledStandIn(), "adamw", lr=0.1, betas=(0.5, 0.6), eps=1e-3, rounding="stochastic")
    assert type(sampled) is RowSparseAdamW
    assert {k: sampled.defaults[k] for k in ("betas", "eps", "rounding", "rounding_seed")} == {
        "betas": (0.5, 0.6), "eps": 1e-3, "rounding": "stochastic", "rounding_seed": 0}


def test_head_optimizer_refusals_name_what_they_got():
    with pytest.raises(TypeError) as err:
        head_optimizer(torch.nn.Linear(2, 4), "sgd", lr=0.1, fused_update=1)
    assert str(err.value) == "fused_update must be True or False, got 1"
    with pytest.raises(TypeError) as err:
        head_optimizer(torch.nn.Linear(2, 4), "sgd", lr=0.1, fused_update=True)
    assert str(err.value) == "fused_update=True needs a ShardedMarginHead, got Linear"


# --------------------------------------------------------------------------- a sharded head's optimizer state


def _adamw_shards(*rows, steps=2, lr=0.05):
    """Shards of ``rows`` rows each under one torch AdamW that took ``steps`` steps."""
    gen = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(n, 3, generator=gen)) for n in rows]
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def test_optimizer_rows_joins_the_shards_rows_in_order_and_keeps_a_shared_value_once():
    params, opt = _adamw_shards(3, 2)
    tensors, extras = optimizer_rows(opt, params)
    assert set(tensors) == {"exp_avg", "exp_avg_sq"}
    for key in tensors:
        assert torch.equal(tensors[key], torch.cat([opt.state[p][key] for p in params]))
    assert set(extras) == {"step", "param_groups"} and torch.equal(extras["step"], torch.tensor(2.0))
    extras["step"] += 1  # a copy: the optimizer's own count stays
    assert all(torch.equal(opt.state[p]["step"], torch.tensor(2.0)) for p in params)
    (group,) = extras["param_groups"]
    assert "params" not in group and group["lr"] == 0.05 and group["betas"] == (0.9, 0.999)
    # One CPU shard's rows are its own tensors (no copy, as documented)
    (one,), one_opt = _adamw_shards(4)
    tensors, _ = optimizer_rows(one_opt, [one])
    assert tensors["exp_avg"].data_ptr() == one_opt.state[one]["exp_avg"].data_ptr()


def test_optimizer_rows_of_shards_without_state_is_the_param_groups_alone():
    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(1, 2))]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    tensors, extras = optimizer_rows(opt, params)
    assert tensors == {} and set(extras) == {"param_groups"} and extras["param_groups"][0]["momentum"] == 0.9
    assert optimizer_rows(opt, []) == ({}, extras)  # no shard on this process


def test_optimizer_rows_refuses_state_that_is_not_one_shards_worth():
    params, opt = _adamw_shards(3, 2)
    a, b = params
    saved = dict(opt.state[b])
    del opt.state[b]["exp_avg"]
    with pytest.raises(ValueError) as err:
        optimizer_rows(opt, params)
    assert str(err.value) == ("the optimizer holds state ['exp_avg_sq', 'step'] for one shard but "
                              "['exp_avg', 'exp_avg_sq', 'step'] for another")
    opt.state[b] = dict(saved, step=torch.tensor(3.0))
    with pytest.raises(ValueError, match=r"^optimizer state 'step' differs between shards: \[tensor\(2\.\), tensor\(3\.\)\]$"):
        optimizer_rows(opt, params)
    opt.state[b] = dict(saved, exp_avg=torch.zeros(5, 3))  # not b's 2 rows
    with pytest.raises(ValueError) as err:
        optimizer_rows(opt, params)
    assert str(err.value) == "optimizer state 'exp_avg' is a per-row tensor for some shards only"
    # Values that are not tensors are compared as values; one shard's tensor against another's number is no match
    for mine, theirs in [(2, 3), (torch.tensor(2.0), 2.0), (2.0, torch.tensor(2.0)), (torch.tensor([2.0, 2.0]), torch.tensor([2.0]))]:
        opt.state[a], opt.state[b] = dict(saved, step=mine), dict(saved, step=theirs)
        opt.state[a]["exp_avg"] = opt.state[a]["exp_avg_sq"] = torch.zeros(3, 3)
        with pytest.raises(ValueError, match="^optimizer state 'step' differs between shards"):
            optimizer_rows(opt, params)
    opt.state[b]["step"] = opt.state[a]["step"] = [[7]]  # any value: the caller gets a copy of its own
    _, extras = optimizer_rows(opt, params)
    extras["step"][0].append(8)
    assert opt.state[a]["step"] == [[7]]


def test_load_optimizer_rows_gives_each_shard_its_rows_and_its_own_copy_of_the_rest():
    source, src_opt = _adamw_shards(3, 2, lr=0.05)
    tensors, extras = optimizer_rows(src_opt, source)
    tensors = {**tensors, "row_step": torch.arange(5, dtype=torch.float64)}  # a saved dtype is kept
    params = [torch.nn.Parameter(torch.zeros(n, 3)) for n in (1, 4)]
    opt = RowSparseAdamW(params, lr=0.5)
    load_optimizer_rows(opt, params, [(0, 1), (1, 5)], tensors, extras)
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["params"] == params
    for p, (lo, hi) in zip(params, [(0, 1), (1, 5)]):
        for key, t in tensors.items():
            assert torch.equal(opt.state[p][key], t[lo:hi]) and opt.state[p][key].dtype == t.dtype
        assert torch.equal(opt.state[p]["step"], torch.tensor(2.0))
    # The optimizer's own storage and its own copies: stepping writes into neither the caller's tensors nor the other shard's
    before = {k: v.clone() for k, v in tensors.items()}
    opt.state[params[0]]["exp_avg"].add_(1.0)
    opt.state[params[0]]["step"].add_(1.0)
    assert all(torch.equal(tensors[k], before[k]) for k in tensors)
    assert torch.equal(extras["step"], torch.tensor(2.0)) and torch.equal(opt.state[params[1]]["step"], torch.tensor(2.0))
    # A non-tensor extra is copied per shard as well, to the bottom (an optimizer of neither head kind:
    # an AdamW refuses a state it does not keep)
    history = [[1], [2]]
    other = torch.optim.Adagrad(params)
    load_optimizer_rows(other, params, [(0, 1), (1, 5)], {}, {"history": history})
    other.state[params[0]]["history"][0].append(3)
    assert other.state[params[1]]["history"] == [[1], [2]] == history and set(other.state[params[1]]) == {"history"}
    # Saved before the first step: no state at all, and any the shards held is gone
    load_optimizer_rows(opt, params, [(0, 1), (1, 5)], {}, {})
    assert all(p not in opt.state for p in params)
    fresh = RowSparseAdamW(params, lr=0.5)  # nor does a shard without state stop it
    load_optimizer_rows(fresh, params, [(0, 1), (1, 5)], {}, {"param_groups": [{"lr": 0.25, "params": [0, 1]}]})
    assert fresh.state == {} and fresh.param_groups[0]["lr"] == 0.25 and fresh.param_groups[0]["params"] == params


def test_load_optimizer_rows_marks_every_row_current():
    p = torch.nn.Parameter(torch.zeros(4, 2))
    opt = RowSparseSGD([p], lr=0.1, momentum=0.9, sampled_rows=lambda: {p: torch.tensor([1])})
    p.grad = torch.ones(4, 2)
    opt.step()
    assert opt._clocks  # rows 0, 2, 3 sat a step out
    tensors, extras = optimizer_rows(opt, [p])
    load_optimizer_rows(opt, [p], [(0, 4)], tensors, extras)
    assert not opt._clocks


def test_load_optimizer_rows_refuses_state_that_does_not_fit():
    params = [torch.nn.Parameter(torch.zeros(n, 2)) for n in (2, 3)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError) as err:
        load_optimizer_rows(opt, params, [(0, 2), (2, 5)], {}, {"param_groups": [{"lr": 1.0}, {"lr": 2.0}]})
    assert str(err.value) == "saved optimizer state has 2 param groups, this optimizer 1"
    for bad in (torch.zeros(4, 2), torch.tensor(5.0)):
        with pytest.raises(ValueError) as err:
            load_optimizer_rows(opt, params, [(0, 2), (2, 5)], {"momentum_buffer": bad}, {})
        assert str(err.value) == f"optimizer state 'momentum_buffer' has shape {tuple(bad.shape)}; expected 5 rows"
    assert opt.state == {} and opt.param_groups[0]["lr"] == 0.1  # nothing half loaded


def test_a_row_step_count_becomes_torchs_adamw_scalar_step_only_when_every_row_has_it():
    params = [torch.nn.Parameter(torch.zeros(n, 2)) for n in (2, 1)]
    moments = {"exp_avg": torch.ones(3, 2), "exp_avg_sq": torch.ones(3, 2)}
    extras = {"param_groups": [{"lr": 0.01}]}
    opt = torch.optim.AdamW(params, lr=0.1)
    load_optimizer_rows(opt, params, [(0, 2), (2, 3)], {**moments, "row_step": torch.full((3,), 4.0, dtype=torch.float64)}, extras)
    for p in params:
        assert set(opt.state[p]) == {"exp_avg", "exp_avg_sq", "step"}
        assert opt.state[p]["step"].dtype == torch.float32 and torch.equal(opt.state[p]["step"], torch.tensor(4.0))
    assert opt.param_groups[0]["lr"] == 0.01 and set(extras) == {"param_groups"}  # the caller's dict untouched
    # One row: its count is the step
    one = [torch.nn.Parameter(torch.zeros(1, 2))]
    opt1 = torch.optim.AdamW(one, lr=0.1)
    load_optimizer_rows(opt1, one, [(0, 1)], {"row_step": torch.full((1,), 6.0, dtype=torch.float64)}, {})
    assert torch.equal(opt1.state[one[0]]["step"], torch.tensor(6.0))
    # No rows saved (a head of zero classes here): the count starts at 0
    empty = [torch.nn.Parameter(torch.zeros(0, 2))]
    opt0 = torch.optim.AdamW(empty, lr=0.1)
    load_optimizer_rows(opt0, empty, [(0, 0)], {"row_step": torch.zeros(0, dtype=torch.float64)}, {})
    assert torch.equal(opt0.state[empty[0]]["step"], torch.tensor(0.0))
    # Counts that differ between rows (Partial FC's lazy AdamW): refused with the way out
    with pytest.raises(ValueError) as err:
        load_optimizer_rows(opt, params, [(0, 2), (2, 3)], {**moments, "row_step": torch.tensor([4.0, 4.0, 3.0], dtype=torch.float64)}, {})
    assert str(err.value) == (
        "the saved AdamW state has a step count per row that differs between rows (Partial FC's lazy row-sparse "
        "AdamW, idle_rows='lazy'), but this optimizer is torch's AdamW, which keeps one count; load it into the "
        "row-sparse AdamW (sample_rate < 1, or head_optimizer(..., fused_update=True))")
    with pytest.raises(ValueError, match="differs between rows"):  # the first row is the one that differs
        load_optimizer_rows(opt, params, [(0, 2), (2, 3)], {**moments, "row_step": torch.tensor([3.0, 4.0, 4.0], dtype=torch.float64)}, {})
    # A scalar step already saved wins; other optimizers keep the per-row form as saved
    load_optimizer_rows(opt, params, [(0, 2), (2, 3)], {**moments, "row_step": torch.full((3,), 4.0)}, {"step": torch.tensor(9.0)})
    assert torch.equal(opt.state[params[0]]["step"], torch.tensor(9.0)) and torch.equal(opt.state[params[0]]["row_step"], torch.full((2,), 4.0))
    other = torch.optim.Adagrad(params, lr=0.1)  # neither SGD nor AdamW: no kind to check, taken as saved
    load_optimizer_rows(other, params, [(0, 2), (2, 3)], {"row_step": torch.full((3,), 4.0)}, {})
    assert set(other.state[params[0]]) == {"row_step"}
    sgd = torch.optim.SGD(params, lr=0.1)  # an AdamW's step count into an SGD: refused (the kinds' test below)
    with pytest.raises(ValueError, match="holds 'row_step', AdamW's state; this optimizer is SGD"):
        load_optimizer_rows(sgd, params, [(0, 2), (2, 3)], {"row_step": torch.full((3,), 4.0)}, {})


@pytest.mark.parametrize("make", [RowSparseSGD, RowSparseAdamW], ids=["sgd", "adamw"])
def test_step_runs_a_closure_with_gradients_and_returns_its_loss_as_torchs_optimizers_do(make):
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    ours, theirs = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(3, 2))
    opt = make([ours], lr=0.1)
    ref = (torch.optim.SGD if make is RowSparseSGD else torch.optim.AdamW)([theirs], lr=0.1, foreach=False)

    def closure_of(p, o):
        def closure():
            o.zero_grad()
            loss = (x @ p).square().sum()
            loss.backward()
            return loss
        return closure

    with torch.no_grad():  # even so: torch's optimizers run the closure with gradients on
        for _ in range(2):
            loss = opt.step(closure_of(ours, opt))
            assert torch.equal(loss, ref.step(closure_of(theirs, ref)))
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    assert opt.step() is None


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("make", [RowSparseSGD, RowSparseAdamW], ids=["sgd", "adamw"])
def test_a_catch_up_hands_the_clock_the_kernel_choice_the_optimizers_state_and_its_own_draws(monkeypatch, make, kernel):
    # Which of the two computes a catch-up (the Triton kernel or torch) is the clock's to run; the
    # optimizer's part is to hand it the choice made for the parameter, the state it keeps and a
    # rounder drawing apart from the step's (stochastic rounding: the seed, the step, the parameter
    # and the catch-up's own word).
    from shardfc.head import partial_fc
    from shardfc.head.catch_up import IdleClock
    from shardfc.head.rounding import round_to
    from shardfc.seeding import mix_seed

    x = 1 + torch.rand(6, 4, generator=torch.Generator().manual_seed(0)) / 64
    seen = []
    real = IdleClock.catch_up_

    def spy(clock, p, states, rows, rnd, kernel=False):
        seen.append((kernel, states, rnd(x, torch.bfloat16), opt.param_groups[0]["rounding_step"]))
        real(clock, p, states, rows, rnd, False)  # the torch path: the kernel cannot run here

    monkeypatch.setattr(IdleClock, "catch_up_", spy)
    monkeypatch.setattr(partial_fc, "kernel_serves", lambda choice, p, rounding, what: bool(choice))
    p = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
    opt = make([p], lr=0.1, **({"momentum": 0.9} if make is RowSparseSGD else {}), rounding="stochastic",
               rounding_seed=3, sampled_rows=lambda: {p: torch.tensor([1])})
    opt.catch_up_kernel = kernel
    for _ in range(2):
        p.grad = torch.ones(6, 4, dtype=torch.bfloat16)
        opt.step()
    assert opt.catch_up_(p) is True
    assert len(seen) == 2  # the second step's and the one asked for
    state = opt.state[p]
    want = [state["momentum_buffer"]] if make is RowSparseSGD else [state["exp_avg"], state["exp_avg_sq"], state["row_step"]]
    for k, states, drawn, step in seen:
        assert k is kernel and len(states) == len(want) and all(a is b for a, b in zip(states, want))
        gen = torch.Generator().manual_seed(mix_seed(3, step, 0, partial_fc._CATCH_UP_DRAWS))
        assert torch.equal(drawn, round_to(x, torch.bfloat16, "stochastic", gen))


def test_a_step_catches_up_only_what_the_heads_forward_did_not():
    """A head built with the optimizer (sampled_rows=head.take_sampled_rows) catches its sampled rows
    up in the forward that reads them: the step does not do it again. Built apart, the step does."""
    def catch_ups_in_steps(attached):
        head = shardfc.ShardedMarginHead(D, C, sample_rate=0.2, sample_seed=1)
        source = head.take_sampled_rows if attached else (lambda: head.take_sampled_rows())
        opt = RowSparseSGD(head.parameters(), lr=0.1, momentum=0.9, sampled_rows=source)
        counts = {"forward": 0, "step": 0}
        where = ["forward"]
        rows = opt._catch_up_rows

        def counted(*args):
            counts[where[0]] += 1
            rows(*args)

        opt._catch_up_rows = counted
        for k in range(3):
            x, y = _batch(k)
            where[0] = "forward"
            head(x, y).backward()
            where[0] = "step"
            opt.step()
            opt.zero_grad()
        return counts

    assert catch_ups_in_steps(attached=True) == {"forward": 2, "step": 0}
    assert catch_ups_in_steps(attached=False) == {"forward": 0, "step": 2}


def test_a_step_goes_on_past_a_parameter_without_a_gradient_or_updated_by_the_backward():
    a = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16, device="meta"))  # the kernel's: meta
    b, c = torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(3, 2))
    opt = RowSparseSGD([a, b, c], lr=0.5)
    opt.fused_update = True
    assert opt.backward_update(a) is not None  # a's step is the backward's
    c.grad = torch.ones(3, 2)  # b has none
    opt.step()
    assert torch.equal(b.detach(), torch.zeros(3, 2)) and torch.equal(c.detach(), torch.full((3, 2), -0.5))
    assert opt.param_groups[0]["rounding_step"] == 1


@pytest.mark.parametrize("fused_update", [False, True])
def test_staging_the_device_numbers_makes_the_fused_updates_state_only_where_the_backward_will_update(fused_update):
    # Meta weights are ones the kernel serves; a fused update off leaves them to step(), which makes its own state.
    a = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16, device="meta"))
    stochastic = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16, device="meta"))  # the kernel cannot serve it
    opt = RowSparseSGD([{"params": [a]}, {"params": [stochastic], "rounding": "stochastic"}], lr=0.1, momentum=0.9)
    opt.fused_update = fused_update
    opt.stage_device_scalars()
    assert set(opt.state) == ({a} if fused_update else set())


@pytest.mark.parametrize("world", [2, 3])
def test_rank_r_draws_what_shard_r_of_one_process_draws(world, monkeypatch):
    """Shard ``i`` of the logical head draws from ``(sample_seed, i, step)`` whether it is a rank of a
    process group or a device of one process: the same global batches give the same samples."""
    from thread_world import ThreadWorld

    batches = [_batch(step, B=6) for step in range(2)]

    def samples(head, rank=0, world=1):
        out = []
        for x, y in batches:
            lo, hi = rank * 6 // world, (rank + 1) * 6 // world
            head(x[lo:hi], y[lo:hi]).backward()
            out.append([rows.clone() for rows in head.take_sampled_rows().values()])
        return out

    one = samples(shardfc.ShardedMarginHead(D, C, sample_rate=0.1, sample_seed=7, devices=["cpu"] * world))
    ranks = ThreadWorld(world).results(
        lambda r: samples(shardfc.ShardedMarginHead(D, C, sample_rate=0.1, sample_seed=7), r, world), monkeypatch)
    for step in range(2):
        for r in range(world):
            assert torch.equal(ranks[r][step][0], one[step][r]), (step, r)
    assert not torch.equal(one[0][0], one[0][1][: one[0][0].numel()])  # the shards' streams differ


def test_each_shard_draws_from_its_own_stream():
    """Two shards of equal size and no positive (every label ignored): their negatives come from
    ``(sample_seed, shard, step)``, so they differ, as two ranks' do."""
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.1, sample_seed=7, devices=["cpu", "cpu"])
    x, _ = _batch(0)
    head(x, torch.full((x.shape[0],), -1)).backward()
    first, second = head.sampled_rows
    assert first.numel() == second.numel() == num_sampled(C // 2, 0.1, x.shape[0])
    assert not torch.equal(first, second)


def test_a_captured_steps_draw_counter_is_staged_before_and_followed_after_a_replay():
    """What ``CapturedHeadStep`` asks of the head around a CUDA graph (no graph here): before a
    capture or replay, the step number is written on each device's counter; after a replay of step
    ``t``, the host counts ``t + 1`` and believes the devices do (the graph advanced them)."""
    head = shardfc.ShardedMarginHead(D, C, sample_rate=0.5, devices=["cpu", "meta"])
    head.sample_step = 5
    head.stage_draw_step()
    held = head._draw_steps._held
    assert sorted(held) == ["cpu", "meta"] and [held[d][1] for d in ("cpu", "meta")] == [5, 5]
    assert int(held["cpu"][0]) == 5 and head.draw_tensors() == [held["cpu"][0], held["meta"][0]]
    head.replayed_draw(9)
    assert head.sample_step == 10 and [held[d][1] for d in ("cpu", "meta")] == [10, 10]
    assert int(held["cpu"][0]) == 5  # the host writes nothing: the replayed graph advanced the counter


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])  # torch's SGD / AdamW, the row-sparse ones
@pytest.mark.parametrize("name, kw, text", [
    ("sgd", dict(lr=math.nan), "lr must be finite, got nan"),
    ("sgd", dict(weight_decay=math.nan), "weight_decay must be finite, got nan"),
    ("sgd", dict(momentum=math.inf), "momentum must be finite, got inf"),
    ("sgd", dict(momentum=-0.1), "momentum must be >= 0, got -0.1"),
    ("adamw", dict(lr=math.inf), "lr must be finite, got inf"),
    ("adamw", dict(eps=math.nan), "eps must be finite, got nan"),
    ("adamw", dict(betas=(math.nan, 0.9)), "betas[0] must be a finite number, got nan"),
    ("adamw", dict(weight_decay=-1.0), "weight_decay must be >= 0, got -1.0"),
])
def test_head_optimizer_refuses_a_non_finite_hyper_parameter_under_every_optimizer(sample_rate, name, kw, text):
    # torch.optim.SGD takes a NaN learning rate or weight decay, and the head would train to NaN.
    head = shardfc.ShardedMarginHead(8, 6, sample_rate=sample_rate)
    with pytest.raises(ValueError) as err:
        shardfc.head_optimizer(head, name, **{"lr": 0.1, **kw})
    assert str(err.value) == text


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])  # torch's SGD / AdamW, the row-sparse ones
@pytest.mark.parametrize("name, kw, text", [
    # each was dropped silently: AdamW has no momentum, SGD no betas
    ("adamw", dict(momentum=0.5), "momentum=0.5 is SGD's; optimizer 'adamw' does not read it"),
    ("AdamW", dict(momentum=0.0), "momentum=0.0 is SGD's; optimizer 'AdamW' does not read it"),
    ("adamw", dict(nesterov=False), "nesterov=False is SGD's; optimizer 'adamw' does not read it"),
    ("sgd", dict(betas=(0.8, 0.9)), "betas=(0.8, 0.9) is AdamW's; optimizer 'sgd' does not read it"),
    ("sgd", dict(eps=1e-6), "eps=1e-06 is AdamW's; optimizer 'sgd' does not read it"),
])
def test_head_optimizer_refuses_the_other_optimizers_settings(sample_rate, name, kw, text):
    head = shardfc.ShardedMarginHead(8, 6, sample_rate=sample_rate)
    with pytest.raises(ValueError) as err:
        shardfc.head_optimizer(head, name, lr=0.1, **kw)
    assert str(err.value) == text


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_head_optimizer_defaults_are_each_optimizers_own(sample_rate):
    head = shardfc.ShardedMarginHead(8, 6, sample_rate=sample_rate)
    sgd = shardfc.head_optimizer(head, "sgd", lr=0.1).param_groups[0]
    assert (sgd["momentum"], sgd["nesterov"], sgd["weight_decay"]) == (0.9, False, 5e-4)
    adamw = shardfc.head_optimizer(head, "adamw", lr=0.1).param_groups[0]
    assert (tuple(adamw["betas"]), adamw["eps"], adamw["weight_decay"]) == ((0.9, 0.999), 1e-8, 5e-4)
    given = shardfc.head_optimizer(head, "sgd", lr=0.1, momentum=0.0, nesterov=False).param_groups[0]
    assert (given["momentum"], given["nesterov"]) == (0.0, False)
    given = shardfc.head_optimizer(head, "adamw", lr=0.1, betas=(0.5, 0.6), eps=1e-3).param_groups[0]
    assert (tuple(given["betas"]), given["eps"]) == ((0.5, 0.6), 1e-3)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_partial_fc_over_more_shards_than_classes_trains_as_the_full_head(name):
    """Two classes over three shards: the third holds none. Partial FC's draw looked its labels up in
    an empty table (IndexError), and the row-sparse AdamW made no state for it (no row, no block),
    so its state lacked every key the others had. With a batch larger than a shard, every class is
    sampled: the run equals the full head's under torch's optimizer, and every shard has the state."""
    def run(sample_rate):
        head = shardfc.ShardedMarginHead(D, 2, devices=["cpu"] * 3, sample_rate=sample_rate, dtype=torch.float64)
        opt = head_optimizer(head, name, lr=0.1, weight_decay=5e-4, **SGD_MOMENTUM[name])
        losses = []
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            loss = head(x.double(), y % 2)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        head.catch_up()
        return head, opt, losses

    sparse, sparse_opt, sparse_losses = run(0.5)
    dense, _, dense_losses = run(1.0)
    assert [len(r) for r in sparse.shard_ranges] == [1, 1, 0]
    assert sparse_losses == pytest.approx(dense_losses, rel=1e-12)
    for a, b in zip(sparse.shard_weights, dense.shard_weights):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-14)
    keys = [sorted(sparse_opt.state[w]) for w in sparse.shard_weights]
    assert keys[0] and keys == [keys[0]] * 3


def test_the_kind_refusals_name_every_foreign_state_and_setting():
    """The refusals read whole: every state of the other kind named (the tensors and a scalar such as
    torch AdamW's ``step`` alike), every torch setting the row-sparse optimizer lacks."""
    params = [torch.nn.Parameter(torch.zeros(3, 2))]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    moments = {"exp_avg": torch.zeros(3, 2), "exp_avg_sq": torch.zeros(3, 2)}
    with pytest.raises(ValueError) as err:
        load_optimizer_rows(sgd, params, [(0, 3)], moments, {"step": torch.tensor(4.0)})
    assert str(err.value) == (
        "the saved head optimizer state holds 'exp_avg', 'exp_avg_sq', 'step', AdamW's state; this optimizer is SGD: "
        "load it into an AdamW optimizer, or load the head without its optimizer state (its optimizer then starts "
        "fresh)")
    with pytest.raises(ValueError, match=r"holds 'step', AdamW's state; this optimizer is SGD"):
        load_optimizer_rows(sgd, params, [(0, 3)], {}, {"step": torch.tensor(4.0)})  # a scalar alone tells too
    sparse = RowSparseSGD([torch.nn.Parameter(torch.zeros(3, 2))], lr=0.1, momentum=0.9)
    group = {"lr": 0.1, "momentum": 0.9, "dampening": 0.5, "nesterov": False, "weight_decay": 0.0, "maximize": True}
    with pytest.raises(ValueError) as err:
        load_optimizer_rows(sparse, sparse.param_groups[0]["params"], [(0, 3)], {}, {"param_groups": [group]})
    assert str(err.value) == ("the saved head optimizer state's param group 0 has dampening=0.5, maximize=True, which "
                              "RowSparseSGD does not implement: its steps would not be those the state was saved for")


def _stepped(make, shape=(3, 2)):
    """Optimizer ``make(params)`` after one step on a one-shard head of ``shape``."""
    p = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
    opt = make([p])
    p.grad = torch.ones_like(p)
    opt.step()
    return p, opt


def test_torchs_adam_state_is_refused_by_the_row_sparse_adamw_and_torchs_adamw_is_taken():
    """torch's ``Adam`` keeps what ``AdamW`` keeps (betas, moments, a step) but adds its weight decay to
    the gradient; the row-sparse AdamW only decouples it: such a state trained on under another rule."""
    message = ("param group 0 has decoupled_weight_decay=False, which RowSparseAdamW does not implement: its steps "
               "would not be those the state was saved for")
    p, adam = _stepped(lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1))
    mine = RowSparseAdamW([torch.nn.Parameter(p.detach().clone())], lr=0.1, weight_decay=0.1)
    with pytest.raises(ValueError) as err:
        mine.load_state_dict(adam.state_dict())
    assert str(err.value) == f"RowSparseAdamW.load_state_dict: {message}"
    tensors, extras = optimizer_rows(adam, [p])
    with pytest.raises(ValueError) as err:
        load_optimizer_rows(mine, mine.param_groups[0]["params"], [(0, 3)], tensors, extras)
    assert str(err.value) == f"the saved head optimizer state's {message}"
    assert mine.state == {}
    p, adamw = _stepped(lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1))
    mine.load_state_dict(adamw.state_dict())
    tensors, extras = optimizer_rows(adamw, [p])
    load_optimizer_rows(mine, mine.param_groups[0]["params"], [(0, 3)], tensors, extras)
    assert torch.equal(mine.state[mine.param_groups[0]["params"][0]]["exp_avg"], adamw.state[p]["exp_avg"])


def test_a_state_of_another_optimizer_with_the_same_settings_is_refused_by_what_it_keeps():
    """NAdam (its weight decay decoupled) has every setting of an AdamW and RMSprop a momentum as SGD
    has: what they keep (``mu_product``, ``square_avg``) is no state these optimizers read."""
    p, nadam = _stepped(lambda ps: torch.optim.NAdam(ps, lr=0.1, decoupled_weight_decay=True))
    mine = RowSparseAdamW([torch.nn.Parameter(p.detach().clone())], lr=0.1)
    with pytest.raises(ValueError) as err:
        mine.load_state_dict(nadam.state_dict())
    assert str(err.value) == ("RowSparseAdamW.load_state_dict: the state of parameter 0 holds 'mu_product', state that "
                              "no AdamW keeps; this optimizer is RowSparseAdamW: do not load this state (its optimizer "
                              "then starts fresh)")
    tensors, extras = optimizer_rows(nadam, [p])
    torch_adamw = torch.optim.AdamW([p], lr=0.1)
    with pytest.raises(ValueError) as err:
        load_optimizer_rows(torch_adamw, [p], [(0, 3)], tensors, extras)
    assert str(err.value) == ("the saved head optimizer state holds 'mu_product', state that no AdamW keeps; this "
                              "optimizer is AdamW: load the head without its optimizer state (its optimizer then starts "
                              "fresh)")
    p, rmsprop = _stepped(lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.9))
    tensors, extras = optimizer_rows(rmsprop, [p])
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError) as err:  # its 'step' alone is AdamW's, its 'square_avg' nobody's here
        load_optimizer_rows(sgd, [p], [(0, 3)], tensors, extras)
    assert str(err.value).startswith("the saved head optimizer state holds 'square_avg', 'step', state that no SGD "
                                     "keeps; this optimizer is SGD: load the head without")
    assert sgd.state == {} and torch_adamw.state == {}


def test_a_bf16_heads_gradient_is_divided_by_the_clip_scale_in_fp32():
    """With a ``grad_scale`` (the head's clip), a bf16 row's gradient is divided in fp32, the update's
    own precision, and the result rounded once into the weight (a division in bf16 rounds twice)."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    grad = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    p = torch.nn.Parameter(w0.clone())
    opt = RowSparseSGD([p], lr=0.5, momentum=0.0, weight_decay=0.0)
    p.grad = grad.clone()
    opt.grad_scale = torch.tensor(3.0)
    opt.step()
    expected = (w0.float() - 0.5 * (grad.float() / 3.0)).to(torch.bfloat16)
    assert torch.equal(p.detach(), expected)
