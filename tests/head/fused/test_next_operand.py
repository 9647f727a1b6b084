"""The next step's operand written by the fused update (issue 31 item 1, ``chunks.NextOperand``):
with a persistent operand (every row scored, within ``chunks.OPERAND_BYTES``) the update kernel
writes each updated row's ``1/‖w‖`` and its normalised compute-dtype row over this step's, and
the next forward uses them instead of the pass over ``W``. Held here: the kept operand equals a
fresh one; steps with it equal steps without it; overwriting in place is safe (nothing of the step
reads a chunk's operand rows or norms after its update); anything that changes the weight makes
the next forward compute a fresh one."""

from __future__ import annotations

import copy

import pytest
import torch
from fused_pairs import DEVICE, MARGINS, C, D
from test_fused_update import OPT_KW, _inputs, _rel

import shardfc
from shardfc.head import partial_fc
from shardfc.head.fused import chunks


def _head(optimizer="sgd", margin="arcface", impl="triton", **head_kw):
    torch.manual_seed(0)
    head = shardfc.ShardedMarginHead(D, C, margin=copy.deepcopy(MARGINS[margin]), impl=impl, device=DEVICE, **head_kw)
    return head, partial_fc.head_optimizer(head, optimizer, fused_update=True, **OPT_KW[optimizer])


def _step(head, opt, step, autocast=None):
    opt.zero_grad()
    x, y = _inputs(step)
    xr = x.to(DEVICE).requires_grad_()
    with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
        loss = head(xr, y.to(DEVICE))
    loss.backward()
    opt.step()
    return float(loss.detach()), xr.grad.double().cpu()


@pytest.fixture
def passes(monkeypatch):
    """Counts the forwards' passes over ``W`` (:func:`chunks.scored_rows`)."""
    count = [0]
    real = chunks.scored_rows

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(chunks, "scored_rows", counted)
    return count


def _kept(head):
    kept = head._next_operands[0]
    assert kept.operand is not None
    return kept.operand, kept.inv


#: Both update kernels at every operand layout, SGD's also with sub-centres and bf16 centres
#: (the same second pass: only the update before it differs).
KEPT_CASES = [(o, c) for o in ("sgd", "adamw") for c in ("fp32", "bf16_autocast", "raw_centres")]
KEPT_CASES += [("sgd", "subcenters"), ("adamw", "bf16_centres")]


@pytest.mark.parametrize("optimizer,case", KEPT_CASES)
def test_the_kept_operand_is_the_one_the_pass_would_make(case, optimizer, passes):
    kw = {"bf16_autocast": {}, "subcenters": dict(subcenters=2), "raw_centres": dict(margin="softmax"),
          "bf16_centres": dict(dtype=torch.bfloat16)}.get(case, {})
    autocast = torch.bfloat16 if case in ("bf16_autocast", "bf16_centres") else None
    head, opt = _head(optimizer, **kw)
    for step in range(2):
        _step(head, opt, step, autocast)
    assert passes[0] == 1  # the second forward used what the first step's update wrote
    op, inv = _kept(head)
    normalize = head.margin.normalize_weights
    fresh_op, fresh_inv = chunks.scored_rows(head.weight.detach(), None, head.weight.shape[0], op.dtype, normalize,
                                             normalize)
    assert op.dtype == (torch.bfloat16 if autocast else torch.float32)
    if normalize:
        assert _rel(inv, fresh_inv) < 4e-7  # the norm's fp32 rounding (its sum in another order)
    else:
        assert inv is None and fresh_inv is None
    if op.dtype == torch.bfloat16:  # within one ulp of bf16
        ulp = torch.finfo(torch.bfloat16).eps * fresh_op.float().abs()
        assert bool(((op.float() - fresh_op.float()).abs() <= ulp).all())
        # ... and rounded to nearest: within half a bf16 unit of the fresh fp32 rows (which differ
        # from the update's by the norm's fp32 rounding), not truncated
        exact, _ = chunks.scored_rows(head.weight.detach(), None, head.weight.shape[0], torch.float32, normalize, normalize)
        half_unit = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 9)
        assert bool(((op.float() - exact).abs() <= half_unit + 4e-7 * exact.abs()).all())
    else:
        assert _rel(op, fresh_op) < 4e-7


@pytest.mark.parametrize("optimizer,impl,autocast", [("sgd", "triton", None), ("adamw", "gemm", None),
                                                     ("adamw", "triton", torch.bfloat16)])
def test_steps_with_the_kept_operand_equal_steps_without(optimizer, impl, autocast, monkeypatch, passes):
    """Three steps reusing the kept operand against three making it afresh each forward (the
    pass over W): the same losses, ``dJ/dx`` and weights, to the norm's fp32 rounding."""
    head, opt = _head(optimizer, impl=impl)
    with_kept = [_step(head, opt, s, autocast) for s in range(3)]
    w_kept = head.weight.detach().double().cpu()
    assert passes[0] == 1
    monkeypatch.setattr(chunks.NextOperand, "take", lambda self, *a: None)
    head, opt = _head(optimizer, impl=impl)
    fresh = [_step(head, opt, s, autocast) for s in range(3)]
    assert passes[0] == 1 + 3
    for (loss, gx), (loss_ref, gx_ref) in zip(with_kept, fresh):
        assert loss == pytest.approx(loss_ref, rel=1e-6)
        assert _rel(gx, gx_ref) < 1e-5
    assert _rel(w_kept, head.weight.detach().double().cpu()) < 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_chunks_operand_is_not_read_after_its_update(optimizer, monkeypatch):
    """Overwriting in place is safe: after each chunk's update its operand rows and norms are
    poisoned (NaN), and the step's ``dJ/dx``, loss and new weights are still exactly those of the
    same step writing no next operand — nothing of the step reads them again (the target rows'
    terms are formed before the chunk loop, each chunk's GEMMs and kernels read its own rows)."""
    real = chunks._update_launch

    def poisoning(update, h, w_read, rows, inv, hscale, slot, t_sum, n_rows, r0, *rest):
        real(update, h, w_read, rows, inv, hscale, slot, t_sum, n_rows, r0, *rest)
        next_op = rest[-2]  # (..., next_op, hyper)
        if next_op is not None:  # the next operand was written: poison this chunk's rows and norms
            next_op[r0:r0 + n_rows] = float("nan")
            inv[r0:r0 + n_rows] = float("nan")
            poisoned[0] += 1

    head, opt = _head(optimizer)
    ref = _step(head, opt, 0)
    w_ref = head.weight.detach().clone()
    poisoned = [0]
    monkeypatch.setattr(chunks, "_update_launch", poisoning)
    head, opt = _head(optimizer)
    got = _step(head, opt, 0)
    assert poisoned[0] >= 3  # several chunks under the interpreter
    assert got[0] == ref[0] and torch.equal(got[1], ref[1])
    assert torch.equal(head.weight.detach(), w_ref)
    assert bool(_kept(head)[0].isnan().all())  # the poison is all that is left: every row was overwritten


def _fresh_after(change, passes, optimizer="sgd"):
    """Two steps, ``change(head, opt)`` between them: the second forward's passes over W."""
    head, opt = _head(optimizer)
    _step(head, opt, 0)
    before = passes[0]
    change(head, opt)
    _step(head, opt, 1)
    return head, passes[0] - before


def test_load_state_dict_between_steps_gives_a_fresh_operand(passes):
    other, _ = _head()
    state = copy.deepcopy(other.state_dict())
    head, fresh = _fresh_after(lambda head, opt: head.load_state_dict(state), passes)
    assert fresh == 1
    # and the step after it trains from the loaded weights: as a head that started from them
    ref, ref_opt = _head()
    ref.load_state_dict(state)
    ref_opt.state.clear()
    head2, opt2 = _head()
    _step(head2, opt2, 0)
    head2.load_state_dict(state)
    opt2.state.clear()  # the same optimizer state as ref's (none)
    assert _step(head2, opt2, 1)[0] == pytest.approx(_step(ref, ref_opt, 1)[0], rel=1e-6)


@pytest.mark.parametrize("change", ["torch_in_place", "row_sparse_sgd_kernel", "release", "unfused_step"])
def test_whatever_else_changes_the_weight_gives_a_fresh_operand(change, passes):
    def modify(head, opt):
        if change == "torch_in_place":
            with torch.no_grad():
                head.weight.mul_(0.5)
        elif change == "row_sparse_sgd_kernel":  # a Triton kernel: it bumps the version itself
            from shardfc.head.fused.optimizer import row_sgd_

            with torch.no_grad():  # as RowSparseSGD's step calls it
                row_sgd_(head.weight, None, torch.ones_like(head.weight), None, False, 0.1, 0.0, 0.0, False)
        elif change == "release":  # after a write through .data, which the version does not see
            head.weight.data.mul_(0.5)
            head.release_next_operands()
        else:  # a step whose update the optimizer applies (impl torch): the operand is dropped
            head.impl = "torch"
            _step(head, opt, 5)
            assert head.last_update.startswith("optimizer")
            head.impl = "triton"

    head, fresh = _fresh_after(modify, passes)
    assert fresh == 1


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_sampled_step_between_dense_ones_forgets_the_kept_operand(optimizer, monkeypatch, passes):
    """A dense step keeps an operand; a step at another sample rate updates the weight in place with
    no operand to write (and without bumping the weight's version), so it must forget the kept one:
    the dense step after it scores the weight as that step left it, as a head keeping none does."""
    def three_steps():
        head, opt = _head(optimizer)
        out = [_step(head, opt, 0)]
        head.sample_rate = 0.5
        out.append(_step(head, opt, 1))
        assert head.last_update.startswith("fused")  # the sampled step's update is the fused one too
        head.sample_rate = 1.0
        out.append(_step(head, opt, 2))
        return out, head.weight.detach().double().cpu()

    got, w = three_steps()
    assert passes[0] == 3  # the dense step after the sampled one made its operand afresh
    monkeypatch.setattr(chunks.NextOperand, "take", lambda self, *a: None)
    ref, w_ref = three_steps()
    for (loss, gx), (loss_ref, gx_ref) in zip(got, ref):
        assert loss == pytest.approx(loss_ref, rel=1e-6)
        assert _rel(gx, gx_ref) < 1e-5
    assert _rel(w, w_ref) < 1e-5


def test_partial_fc_keeps_no_operand(passes):
    """Partial FC scores a different sample each step: its operand is made per step, none kept."""
    head, opt = _head(sample_rate=0.5)
    for step in range(2):
        _step(head, opt, step)
    assert passes[0] == 2
    assert all(k.operand is None for k in head._next_operands)


def test_a_copy_of_the_head_keeps_no_operand():
    head, opt = _head()
    _step(head, opt, 0)
    assert _kept(head)[0] is not None
    copied = copy.deepcopy(head)
    assert copied._next_operands[0].operand is None


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_fused_step_bumps_the_weights_version_and_its_kept_operand_still_serves(optimizer, passes):
    """Issue 44 item 3: the update fused into the backward changes the weight in place, and says so
    as torch's optimizers do — ``weight._version`` moves — while the operand it wrote for the next
    step, keyed after the bump, still serves that step (no pass over W)."""
    head, opt = _head(optimizer)
    _step(head, opt, 0)
    before = head.weight._version
    made = passes[0]
    _step(head, opt, 1)
    assert head.weight._version > before  # the second step's update is visible to version-keyed caches
    assert passes[0] == made  # and its forward read the operand the first step's update wrote

