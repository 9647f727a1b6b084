"""The steps a row sat out, applied when it is next read: Partial FC that trains exactly as the
dense optimizer does, at the row-sparse cost.

A dense ``torch.optim.SGD`` moves every row every step, sampled or not: an idle row's gradient
is zero, but weight decay shrinks it and momentum carries it on. Updating only the sampled rows
(MXNet's ``lazy_update``) freezes the others, and at small sample rates that costs accuracy
(docs/accuracy.md). Here an idle row is *left* idle — no pass over it — and brought to where the
dense optimizer would have it the next time anything reads it: the forward that samples it
(before its logits are scored, since the dense run's forward sees the drift), the step that
updates it, or a reader of every row (evaluation, ``predict``, ``state_dict``, a checkpoint,
``grow``, export).

**SGD** (momentum ``μ``, weight decay ``λ``, learning rate ``η_t`` of step ``t``; torch's
update, no dampening). With a zero gradient a step is linear in ``(w, buf)``::

    buf' = λ·w + μ·buf                     w' = w − η_t·buf'               (plain momentum)
    buf' = λ·w + μ·buf                     w' = w − η_t·(λ·w + μ·buf')     (Nesterov)

a 2×2 matrix ``M_t``, the same for every row. Each parameter keeps, for every step ``s`` since a
base step, the product ``Q[s] = M_k ⋯ M_{s+1}`` of the steps after ``s`` (``k``: the steps
taken), made by *left*-multiplying every entry by the new step's matrix as the step is taken, in
fp64: forward products only, never a product divided by another (whose determinants, ``μ^s``,
vanish over long gaps). Each row keeps the step its state is current at (an int32, 4 bytes a row,
not saved: a saved state is always caught up). Catching a row up is one gather of its ``Q`` and
``(w, buf) ← Q·(w, buf)`` — O(1) per row, no pass over any other. When every row is current (a
dense step, a full read) the table restarts; after :data:`FULL_CATCH_UP_EVERY` steps without that,
the optimizer catches every row up once, which bounds the table (``32 × FULL_CATCH_UP_EVERY``
bytes) at an amortised cost of ``1 / FULL_CATCH_UP_EVERY`` of a dense step.

**AdamW**: an idle step decays both moments and the weight, then moves the weight by
``η·m̂/(√v̂ + ε)`` — not linear (``ε``). The missed steps are iterated, row by row, with the
per-row step count the bias corrections need, for at most :func:`adamw_exact_steps` of them;
after those, the moments' term is provably below :data:`ADAMW_DROPPED_BOUND` summed over all the
remaining steps (their moments have decayed by ``(β1/√β2)^j``), so the rest is the closed form
of decay alone: the weight times ``∏(1 − η_t·λ)``, the moments times ``β1^j``, ``β2^j``.

Every catch-up is computed in fp32 (fp64 for fp64 weights) and rounded once into the weight's and
the state's dtype, like the optimizers' own updates. Writes go through ``.data``: the rows a
forward already scored are current, so rewriting them changes no value, and autograd must not see
a version change on a weight a pending backward saved.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from shardfc.head.rounding import update_dtype

#: Steps after which the optimizer brings every idle row up to date in one pass (then the step
#: tables restart): bounds each parameter's table to this many entries.
FULL_CATCH_UP_EVERY = 2048

#: AdamW: the most the moments' terms dropped after :func:`adamw_exact_steps` iterated steps can
#: move any weight element, summed over every later idle step (far below fp32 rounding of a
#: centre's entries, ~1e-2 for unit rows of D = 512).
ADAMW_DROPPED_BOUND = 2.0**-30

#: The ways an optimizer can treat the rows a step did not sample.
IDLE_ROWS = ("exact", "lazy")

Rounder = Callable[[Tensor, torch.dtype], Tensor]


def check_idle_rows(idle_rows: str) -> str:
    """``idle_rows`` if it is one of :data:`IDLE_ROWS`, else a ValueError naming it."""
    if idle_rows not in IDLE_ROWS:
        raise ValueError(f"idle_rows must be one of {', '.join(map(repr, IDLE_ROWS))}, got {idle_rows!r}")
    return idle_rows


def sgd_idle_matrix(lr: float, momentum: float, weight_decay: float, nesterov: bool) -> Tuple[Tuple[float, float], ...]:
    """``M`` with ``(w', buf') = M·(w, buf)`` for one SGD step with a zero gradient (see the module)."""
    lam, mu = float(weight_decay), float(momentum)
    if nesterov:  # d = λw + μ·buf' = λ(1 + μ)·w + μ²·buf
        return ((1.0 - lr * lam * (1.0 + mu), -lr * mu * mu), (lam, mu))
    return ((1.0 - lr * lam, -lr * mu), (lam, mu))


def adamw_exact_steps(lr: float, betas: Tuple[float, float], bound: Optional[float] = None) -> Optional[int]:
    """The idle AdamW steps to iterate so that every later idle step's moment term, summed, moves a
    weight element by at most ``bound`` (None: no such count, iterate them all).

    Moments built by Adam from zero satisfy ``|m| ≤ K·√v`` with ``K = (1 − β1)/√((1 − β2)(1 −
    β1²/β2))`` (Cauchy–Schwarz over the gradients), an idle step ``j`` scales ``|m|/√v`` by
    ``ρ^j``, ``ρ = β1/√β2``, and the bias corrections' ratio ``√(1 − β2^t)/(1 − β1^t)`` is at most
    ``1/(1 − β1)``; ``ε`` only shrinks the term. So the terms after ``J`` steps sum to at most
    ``lr·K/(1 − β1)·ρ^(J+1)/(1 − ρ)``. ``bound``: :data:`ADAMW_DROPPED_BOUND` by default.
    """
    bound = ADAMW_DROPPED_BOUND if bound is None else float(bound)
    b1, b2 = float(betas[0]), float(betas[1])
    if b1 == 0.0:
        return 0  # an idle step's m is β1·m = 0: no moment term after the first
    if b1 * b1 >= b2:
        return None  # ρ ≥ 1 (or no v to divide by): the terms need not shrink
    rho = b1 / math.sqrt(b2)
    k = (1.0 - b1) / math.sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2))
    scale = lr * k / (1.0 - b1) / (1.0 - rho)
    if scale == 0.0:
        return 0  # no learning rate: no term at all
    return max(0, math.ceil(math.log(bound / scale) / math.log(rho)))


_EVERY_STEP = 1 << 62  # adamw_exact_steps' None: no bound, every missed step iterated


def _take(t: Tensor, idx) -> Tensor:
    """Rows ``idx`` (a slice or an index tensor) of ``t``: a view, or ``index_select`` (on the CPU
    several times faster than advanced indexing)."""
    return t[idx] if isinstance(idx, slice) else t.index_select(0, idx)


def _put(t: Tensor, idx, rows: Tensor) -> None:
    """``t[idx] = rows`` (``index_copy_`` for an index tensor)."""
    if isinstance(idx, slice):
        t[idx] = rows
    else:
        t.index_copy_(0, idx, rows)


def _identity(entry: Tensor) -> None:
    entry.zero_()
    entry.diagonal().fill_(1.0)


class IdleClock:
    """One parameter's record of the steps its idle rows have not seen (see the module).

    ``stamps[r]``: the table index row ``r`` is current at; index ``length - 1`` is now. The table
    grows by one entry a step and restarts when every row is current. ``now`` holds ``length - 1``
    on the device (int32, one element), advanced there by each step recorded: the rows a step
    updates are stamped from it, so the stamping takes no number from the host (a captured CUDA
    graph of the step, :mod:`shardfc.head.capture`, stamps each replay's rows with that replay's
    step); ``length`` is the host's count of the same, which the host always knows.
    """

    def __init__(self, p: Tensor):
        self.stamps = torch.zeros(p.shape[0], dtype=torch.int32, device=p.device)
        self.now = torch.zeros(1, dtype=torch.int32, device=p.device)
        self.table: Optional[Tensor] = None  # [capacity, ...] fp64: what each entry needs (subclasses)
        self.length = 1

    @property
    def all_current(self) -> bool:
        """Every row is current (host-known: no device read)."""
        return self.length == 1

    #: fp64 numbers in one table entry (subclasses)
    ENTRY = 0
    #: A catch-up walks the rows ``kernels.SAMPLED_BLOCK // BLOCK_SHARE`` at a time (subclasses: by
    #: how many ``[block, D]`` fp32 transients a block needs).
    BLOCK_SHARE = 4

    @classmethod
    def bound_nbytes(cls, p: Tensor) -> int:
        """The most a clock of ``p`` holds: 4 bytes a row, and a table of FULL_CATCH_UP_EVERY + 2 entries."""
        return p.shape[0] * 4 + (FULL_CATCH_UP_EVERY + 2) * cls.ENTRY * 8

    def reset(self) -> None:
        """Every row is current now (a dense step, or after a full catch-up)."""
        self.stamps.zero_()
        self.now.zero_()
        self.length = 1

    def replayed(self, length: int) -> None:
        """A replayed CUDA graph of a step recorded one step on the device (its table entry, ``now``):
        the host's count says so. ``length``: the count before the replay."""
        self.length = length + 1

    def _grow_table(self, entry_shape: Tuple[int, ...]) -> Tensor:
        if self.table is None or self.table.shape[0] <= self.length:
            capacity = max(self.length + 1, min(max(16, 2 * self.length), FULL_CATCH_UP_EVERY + 2))
            table = torch.zeros((capacity,) + entry_shape, dtype=torch.float64, device=self.stamps.device)
            if self.table is not None:
                table[: self.table.shape[0]] = self.table
            self.table = table
        return self.table

    def catch_up_(self, p: Tensor, states: Tuple[Optional[Tensor], ...], rows: Optional[Tensor], rnd: Rounder,
                  kernel: bool = False) -> None:
        """Bring ``rows`` (None: every row) of ``p`` and its per-row optimizer ``states`` to now: with
        ``kernel``, in one Triton launch (:mod:`shardfc.head.fused.idle_rows`; rounding to nearest);
        else in torch, a block of rows at a time (as many as the forward gathers at once: no higher
        peak than its)."""
        if self.all_current:
            return
        if kernel:  # the kernel stamps the rows it catches up itself
            self._catch_up_kernel(p, states, rows)
            if rows is None:
                self.reset()
            return
        from shardfc.head import kernels  # read at each call: the block the forward uses now

        # A block's transients (a few [block, D] fp32 copies) stay below the forward's own block.
        block = max(1, kernels.SAMPLED_BLOCK // self.BLOCK_SHARE)
        total = p.shape[0] if rows is None else rows.numel()
        for b0 in range(0, total, block):
            idx = slice(b0, b0 + block) if rows is None else rows[b0 : b0 + block]
            self._catch_up_block(p, states, idx, rnd)
        self.mark_current(rows)

    def _catch_up_block(self, p: Tensor, states: Tuple[Optional[Tensor], ...], idx, rnd: Rounder) -> None:
        raise NotImplementedError

    def _catch_up_kernel(self, p: Tensor, states: Tuple[Optional[Tensor], ...], rows: Optional[Tensor]) -> None:
        raise NotImplementedError

    def mark_current(self, rows: Optional[Tensor]) -> None:
        """``rows`` (None: all) are current now: updated by the step just recorded, or caught up."""
        if rows is None:
            self.reset()
        else:
            self.stamps.index_put_((rows,), self.now)  # now, read on the device


class SGDClock(IdleClock):
    """An SGD parameter's idle steps: ``table[s]`` is ``Q[s]`` (the module), ``[2, 2]`` fp64.

    The table is made at its longest (``FULL_CATCH_UP_EVERY + 2`` entries, 32 bytes each) and a
    step rewrites all of it, the entries past ``length`` too (never read: a row's stamp is at most
    now, and an entry is set to the identity when it opens): the step's work is the same whatever
    ``length`` is, at one address, so a captured graph of it replays right at any later length."""

    ENTRY = 4

    def __init__(self, p: Tensor):
        super().__init__(p)
        self.table = torch.zeros((FULL_CATCH_UP_EVERY + 2, 2, 2), dtype=torch.float64, device=p.device)
        _identity(self.table[0])
        self._eye = torch.eye(2, dtype=torch.float64, device=p.device).unsqueeze(0)

    def record(self, lr: float, momentum: float, weight_decay: float, nesterov: bool,
               matrix: Optional[Tensor] = None, always: bool = False) -> None:
        """A step was taken: every earlier entry is left-multiplied by its matrix, and a new (identity)
        one opens. ``matrix``: ``sgd_idle_matrix``'s four numbers as fp64 on the table's device (the
        optimizer's, staged once per change of the numbers: no host number in the step's kernels);
        None makes them here. ``always``: record even a step that moves nothing (a captured step
        records what every replay does, whatever its numbers)."""
        if not always and momentum == 0 and lr * weight_decay == 0:
            return  # an idle step moves nothing (no buffer, no decay): every entry stays as it is
        if matrix is None:
            matrix = torch.tensor(sgd_idle_matrix(lr, momentum, weight_decay, nesterov), dtype=torch.float64,
                                  device=self.table.device).reshape(4)
        a, b, c, d = matrix.unbind()
        q = self.table
        top = q[:, 0, :].clone()
        q[:, 0, :].mul_(a).add_(q[:, 1, :] * b)
        q[:, 1, :].mul_(d).add_(top * c)
        self.now.add_(1)
        self.table.index_copy_(0, self.now.long(), self._eye)  # entry `now` opens as the identity
        self.length += 1

    def reset(self) -> None:
        super().reset()
        _identity(self.table[0])

    def _catch_up_kernel(self, p: Tensor, states: Tuple[Optional[Tensor], ...], rows: Optional[Tensor]) -> None:
        from shardfc.head.fused.idle_rows import catch_up_sgd_

        catch_up_sgd_(p.data, states[0], rows, self.stamps, self.table, self.now)

    def _catch_up_block(self, p: Tensor, states: Tuple[Optional[Tensor], ...], idx, rnd: Rounder) -> None:
        (buf,) = states  # the momentum buffer, or None without momentum
        cd = update_dtype(p.dtype)
        q = self.table.index_select(0, _take(self.stamps, idx).long()).to(cd)  # [R, 2, 2]
        w = _take(p.data, idx).to(cd)
        new_w = q[:, 0, 0:1] * w
        if buf is not None:
            b = _take(buf, idx).to(cd)
            new_w.addcmul_(q[:, 0, 1:2], b)
            _put(buf, idx, rnd(b.mul_(q[:, 1, 1:2]).addcmul_(q[:, 1, 0:1], w), buf.dtype))
            del b
        del w
        _put(p.data, idx, rnd(new_w, p.dtype))


class AdamWClock(IdleClock):
    """An AdamW parameter's idle steps: per step since the base, ``(lr, weight_decay, β1, β2, ε)``
    and the prefix sums of ``log(1 − lr·wd)``, ``log β1``, ``log β2`` (for the closed-form tail)."""

    COLUMNS = ENTRY = 8  # lr, wd, b1, b2, eps, Σ log(1 − lr·wd), Σ log β1, Σ log β2
    BLOCK_SHARE = 16  # the loop's state (w, m, v) and its step's temporaries

    def __init__(self, p: Tensor):
        super().__init__(p)
        self._grow_table((self.COLUMNS,))
        self.exact_steps = 0  # the most missed steps any entry needs iterated (adamw_exact_steps)

    def record(self, lr: float, betas: Tuple[float, float], eps: float, weight_decay: float) -> None:
        table = self._grow_table((self.COLUMNS,))
        b1, b2 = float(betas[0]), float(betas[1])
        row, prev = table[self.length], table[self.length - 1]
        for col, value in enumerate((lr, weight_decay, b1, b2, eps)):
            row[col].fill_(value)  # a kernel argument: no host-to-device copy in a step
        row[5:].copy_(prev[5:])
        for col, x in zip((5, 6, 7), (1.0 - lr * weight_decay, b1, b2)):
            # log 0 as a huge negative: a zero factor inside a tail makes its product 0, outside it cancels
            row[col].add_(math.log(x) if x > 0 else -1e300)
        self.length += 1
        self.now.add_(1)
        j = adamw_exact_steps(lr, betas)
        self.exact_steps = max(self.exact_steps, _EVERY_STEP if j is None else j)

    def reset(self) -> None:
        super().reset()
        self.exact_steps = 0

    def _catch_up_kernel(self, p: Tensor, states: Tuple[Optional[Tensor], ...], rows: Optional[Tensor]) -> None:
        from shardfc.head.fused.idle_rows import catch_up_adamw_

        exp_avg, exp_avg_sq, row_step = states
        catch_up_adamw_(p.data, exp_avg, exp_avg_sq, row_step, rows, self.stamps, self.table, self.length - 1,
                        self.exact_steps)

    def _catch_up_block(self, p: Tensor, states: Tuple[Optional[Tensor], ...], idx, rnd: Rounder) -> None:
        exp_avg, exp_avg_sq, row_step = states
        cd = update_dtype(p.dtype)
        table, last = self.table, self.length - 1
        start = _take(self.stamps, idx).long()  # the entry each row is current at; its missed steps: start+1 .. last
        t0 = _take(row_step, idx)
        w = _take(p.data, idx).to(cd)
        m = _take(exp_avg, idx).to(cd)
        v = _take(exp_avg_sq, idx).to(cd)
        iterate = min(self.exact_steps, last)
        for i in range(1, iterate + 1):  # the missed steps one by one, rows whose gap is shorter masked
            at = start + i
            live = (at <= last).unsqueeze(1)
            c = table[at.clamp(max=last)]  # [R, COLUMNS] fp64: scalars formed in fp64, as torch's Python floats
            t = (t0 + i).unsqueeze(1)
            decay = (1 - c[:, 0:1] * c[:, 1:2]).to(cd)
            step_size = (c[:, 0:1] / (1 - c[:, 2:3] ** t)).to(cd)
            bias2_sqrt = (1 - c[:, 3:4] ** t).sqrt().to(cd)
            m_new = m.lerp(torch.zeros_like(m), (1 - c[:, 2:3]).to(cd))  # torch's op toward a zero gradient
            v_new = v * c[:, 3:4].to(cd)
            w_new = w * decay - step_size * (m_new / (v_new.sqrt() / bias2_sqrt + c[:, 4:5].to(cd)))
            m, v, w = torch.where(live, m_new, m), torch.where(live, v_new, v), torch.where(live, w_new, w)
        # The steps after the iterated ones: decay alone (their moment terms are below the bound).
        tail = (start + iterate).clamp(max=last)
        logs = (table[last, 5:] - table[tail, 5:]).exp()  # [R, 3]: ∏(1 − lr·wd), β1^j, β2^j over the tail
        _put(p.data, idx, rnd(w * logs[:, 0:1].to(cd), p.dtype))
        _put(exp_avg, idx, rnd(m * logs[:, 1:2].to(cd), exp_avg.dtype))
        _put(exp_avg_sq, idx, rnd(v * logs[:, 2:3].to(cd), exp_avg_sq.dtype))
        _put(row_step, idx, t0 + (last - start).to(row_step.dtype))


__all__ = ["FULL_CATCH_UP_EVERY", "ADAMW_DROPPED_BOUND", "IDLE_ROWS", "check_idle_rows", "sgd_idle_matrix",
           "adamw_exact_steps", "IdleClock", "SGDClock", "AdamWClock"]
