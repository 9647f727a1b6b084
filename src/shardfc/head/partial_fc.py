"""Partial FC's optimizers: they update only the rows the head sampled (the sampling itself:
:mod:`shardfc.head.sampling`).

Partial FC (An et al., "Partial FC: Training 10 Million Identities on a Single Machine",
ICCVW 2021) scores each step against the positive classes of the global batch plus a uniform
sample of negatives, a fixed ``max(⌈r · n_local⌉, B)`` classes per shard (``B`` the global batch:
every positive fits, and nothing is read back to the host; :mod:`shardfc.head.sampling`). Its point is that the step touches only those rows — so the optimizer must not
read or write the others either: a dense optimizer would pass over every row's weight, gradient
and state every step. :class:`RowSparseSGD` and :class:`RowSparseAdamW` update exactly the rows the
head sampled since the last step, and leave every other row and its state as they are — until
something reads them: with ``idle_rows="exact"`` (the default) a row is then brought to where the
dense optimizer (momentum, weight decay, AdamW's moments) would have it after the steps it sat out
(:mod:`shardfc.head.catch_up`), so the run equals the dense optimizer's; with ``"lazy"`` it stays
as it was (MXNet's ``lazy_update``), which costs accuracy at small rates.

Build the optimizers like this (the head is never wrapped in DDP)::

    head = ShardedMarginHead(512, num_classes, sample_rate=0.1)
    opt_backbone = torch.optim.SGD(ddp_backbone.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    opt_head = shardfc.head.partial_fc.head_optimizer(head, "sgd", lr=0.1, momentum=0.9, weight_decay=5e-4)

``head_optimizer`` returns torch's own dense optimizer when ``sample_rate == 1``.

How the sampled rows reach the optimizer: the head records, per shard, the rows each forward with
autograd enabled used (:attr:`ShardedMarginHead.sampled_rows`, the union over the micro-batches of
a step); ``head_optimizer`` builds the row-sparse optimizer with ``sampled_rows=head.take_sampled_rows``,
which ``step()`` calls once to get ``{shard weight: rows}`` and which forgets the rows. A shard whose
forward used every row (evaluation mode, or a forward without sampling) has no entry and is updated
densely, like torch's optimizer would: its gradient is dense. So is every parameter when no forward
was recorded since the last step (e.g. a gradient set by hand). ``zero_grad()`` also forgets the
recorded rows, since the gradient they belong to is gone (e.g. a step skipped by the fp16 scaler).

With the head's ``sparse_grad=True`` the weight has no ``.grad`` at all: ``take_sampled_rows`` maps
each sampled shard to a :class:`RowGrad` (its rows and their compact gradient, summed over the
micro-batches), which the optimizers consume directly. Every update is computed in fp32 (fp64 for
fp64 weights), ``UPDATE_BLOCK`` rows at a time, and rounded once into the weight's and the state's
dtype (:mod:`shardfc.head.rounding`): bf16/fp16 class centres keep bf16/fp16 state without losing
updates below their last bit to a low-precision subtraction.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from shardfc.checks import check_probability, check_real, check_seed
from shardfc.head import capture
from shardfc.head.catch_up import (
    FULL_CATCH_UP_EVERY,
    AdamWClock,
    IdleClock,
    SGDClock,
    check_idle_rows,
    sgd_idle_matrix,
)
from shardfc.head.rounding import check_rounding, round_to, update_dtype

# Which rows a step samples and touches lives in shardfc.head.sampling; its names stay importable
# from here, where they were before that split.
from shardfc.head.sampling import (  # noqa: F401
    RowGrad,
    merge_row_grads,
    num_sampled,
    positive_mask,
    positives_per_range,
    sample_present,
    sample_rows,
    sampling_generator,
    union_rows,
)
from shardfc.seeding import mix_seed

#: What a row-sparse optimizer asks once per step: ``{parameter: rows to update, or a RowGrad}``
#: (and forget them).
SampledRows = Callable[[], Mapping[Tensor, Any]]


#: Rows updated at a time: bounds the optimizer's fp32 transients to a few UPDATE_BLOCK × D.
UPDATE_BLOCK = 65536

# Mixed into a stochastic rounding seed for a catch-up's writes, apart from the step's own draws.
_CATCH_UP_DRAWS = 0x1D1E


def kernel_serves(choice: Optional[bool], p: Tensor, rounding: str, what: str) -> bool:
    """Whether a Triton kernel updates ``p``: ``choice`` None (automatic) on CUDA when Triton is
    installed and ``p`` qualifies (the interpreter is for tests); True always, or a ValueError
    starting with ``what`` and saying why not; False never."""
    if choice is False:
        return False
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        reason = "Triton is not installed (pip install 'shardfc[gpu]')"
    else:
        from shardfc.head.fused.optimizer import fusable

        reason = fusable(p, rounding)
    if reason is not None:
        if choice:
            raise ValueError(f"{what} cannot serve this parameter: {reason}")
        return False
    return bool(choice) or p.is_cuda


#: Settings of torch's SGD / AdamW that the row-sparse ones do not have, at the value that means "off"
#: (``decoupled_weight_decay=False`` is torch's ``Adam``: weight decay as an L2 term in the gradient,
#: which the row-sparse AdamW, decoupled only, would not apply).
_TORCH_ONLY = {"dampening": 0, "amsgrad": False, "maximize": False, "decoupled_weight_decay": True}


def _torch_only_settings(group: Mapping[str, Any]) -> List[str]:
    """``"name=value"`` of each :data:`_TORCH_ONLY` setting saved param group ``group`` sets otherwise
    than the row-sparse optimizers' plain step."""
    return [f"{k}={group[k]!r}" for k, plain in _TORCH_ONLY.items() if k in group and group[k] != plain]


class _RowSparseOptimizer(torch.optim.Optimizer):
    """An optimizer that asks ``sampled_rows()`` once per step which rows of each parameter to update.

    A parameter missing from the answer (or every parameter, without ``sampled_rows``) is updated
    densely, exactly as torch's optimizer would. Each update is computed in fp32 (fp64 for fp64
    parameters), a block of rows at a time, and rounded once into the parameter's and the state's
    dtype: to nearest, or with ``rounding="stochastic"`` unbiased at random (bf16/fp16 only), from
    a generator seeded by ``(rounding_seed, step, parameter)``.

    Like torch's fused optimizers, a ``grad_scale`` attribute (a one-element tensor) set before
    :meth:`step` divides every gradient it reads by it, inside the update (``shardfc train`` clips
    the head that way: no pass of its own over the gradient); the caller removes it afterwards.
    """

    #: :meth:`step` honours a ``grad_scale`` attribute (see the class).
    accepts_grad_scale = True
    #: The record of the steps a parameter's idle rows missed (subclasses).
    CLOCK: type = IdleClock
    #: The settings a saved state of this kind of optimizer holds in every param group (subclasses).
    HYPER_PARAMETERS: Tuple[str, ...] = ()
    #: Which of :data:`_KIND_STATE`'s kinds of state this optimizer keeps.
    KIND = ""

    def __init__(self, params: Iterable, defaults: dict, sampled_rows: Optional[SampledRows],
                 rounding: str, rounding_seed: int, idle_rows: str = "exact"):
        check_rounding(rounding)
        #: "exact": the rows a step did not sample are caught up to the dense optimizer's state when
        #: next read (:mod:`shardfc.head.catch_up`); "lazy": they stay as they are until sampled.
        self.idle_rows = check_idle_rows(idle_rows)
        self._clocks: Dict[Tensor, IdleClock] = {}  # per parameter with rows behind: what they missed
        #: Catch idle rows up with one Triton kernel a parameter (:mod:`shardfc.head.fused.idle_rows`):
        #: None (default) on CUDA when Triton is installed and the parameter qualifies; True always,
        #: or a ValueError saying why not; False never.
        self.catch_up_kernel: Optional[bool] = None
        seed = check_seed("rounding_seed", rounding_seed)
        super().__init__(params, dict(defaults, rounding=rounding, rounding_seed=seed, rounding_step=0))
        self.sampled_rows = sampled_rows
        # The head whose take_sampled_rows answers sampled_rows brings the rows it reads up to date
        # through this optimizer (its forward, predict, state_dict, checkpoints, grow).
        owner = getattr(sampled_rows, "__self__", None)
        attach = getattr(owner, "keep_rows_current_by", None)
        self._head = None  # a weak reference to that head
        if attach is not None:
            attach(self)
            self._head = weakref.ref(owner)
        #: Let a head's backward apply this optimizer's step to its weights (see
        #: :func:`head_optimizer`'s ``fused_update``); set by ``head_optimizer``.
        self.fused_update = False
        self._updated_in_backward: set = set()  # ids of the parameters a backward updated since the last step

    def _take_rows(self) -> Mapping[Tensor, Union[Tensor, RowGrad]]:
        return self.sampled_rows() if self.sampled_rows is not None else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._take_rows()  # the gradient the recorded rows belong to is discarded: forget them too
        self._updated_in_backward.clear()  # a new step begins
        super().zero_grad(set_to_none)

    def fused_update_unavailable(self, p: Tensor) -> Optional[str]:
        """Why a backward cannot apply this optimizer's step to ``p`` (None when it can)."""
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed (pip install 'shardfc[gpu]')"
        from shardfc.head.fused.optimizer import fusable

        group = next((g for g in self.param_groups if any(q is p for q in g["params"])), self.defaults)
        return fusable(p, group["rounding"])

    def backward_update(self, p: Tensor):
        """The step a head's backward applies to ``p`` while it forms ``p``'s gradient (a
        :class:`shardfc.head.fused.chunks.RowUpdate`: this step's learning rate, the optimizer's
        state of ``p`` and its hyper-parameters), or None when ``fused_update`` is off or ``p`` does not qualify (the
        gradient is then stored and :meth:`step` updates ``p`` as usual). :meth:`step` skips a
        parameter updated this way. A second backward into the same parameter before ``step()``
        (gradient accumulation) is an error: its first update is already applied."""
        if not self.fused_update or self.fused_update_unavailable(p) is not None:
            return None
        if id(p) in self._updated_in_backward:
            raise RuntimeError(
                "the head's optimizer step already ran in an earlier backward of this step "
                "(head_optimizer(..., fused_update=True) updates the weights in the backward): "
                "accumulating gradients over several backward passes needs fused_update=False "
                "(shardfc train chooses it by itself when grad_accum > 1)"
            )
        group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
        if group is None:
            raise ValueError("backward_update: the tensor is not a parameter of this optimizer")
        update = self._row_update(p, group)
        self._updated_in_backward.add(id(p))
        return update

    def _row_update(self, p: Tensor, group: dict):
        raise NotImplementedError

    def _make_state(self, p: Tensor, group: dict) -> None:
        """Make ``p``'s state if it has none yet (at its first step, as torch's optimizers do)."""
        raise NotImplementedError

    @staticmethod
    def _blocks(p: Tensor, entry) -> Iterator[Tuple[Union[Tensor, slice], Tensor, Union[Tensor, slice]]]:
        """``(rows, gradient source, its index)`` per block of the rows ``entry`` says to update:
        the block's gradient is ``source[index]``, gathered by the update itself so that no
        reference outlives it."""
        if isinstance(entry, RowGrad):
            for b0 in range(0, entry.rows.numel(), UPDATE_BLOCK):
                yield entry.rows[b0 : b0 + UPDATE_BLOCK], entry.values, slice(b0, b0 + UPDATE_BLOCK)
        elif p.grad is None:
            return
        elif entry is not None:
            for b0 in range(0, entry.numel(), UPDATE_BLOCK):
                idx = entry[b0 : b0 + UPDATE_BLOCK]
                yield idx, p.grad, idx
        else:
            for b0 in range(0, p.shape[0], UPDATE_BLOCK):
                idx = slice(b0, b0 + UPDATE_BLOCK)
                yield idx, p.grad, idx

    def _fused_update(self, p: Tensor, entry, group: dict) -> bool:
        """Update ``p`` with a fused kernel and return True, or return False (the blocks do it)."""
        return False

    def _device_scalars(self, group: dict, device: torch.device, values) -> Tensor:
        """``group``'s per-step numbers for a kernel, as the fp32 tensor on ``device`` that this
        optimizer keeps for the group at one address (:class:`~shardfc.head.fused.device_scalars.DeviceScalars`):
        refreshed when the numbers change (a learning-rate schedule), so the kernel reads them
        instead of taking them as launch arguments and a captured CUDA graph replays with the
        values set before the replay."""
        return self._scalar_holder().get(self._group_index(group), values, device)

    def _group_index(self, group: dict) -> int:
        """``group``'s place in ``param_groups``: the key of its device numbers."""
        return next(i for i, g in enumerate(self.param_groups) if g is group)

    def _scalar_holder(self):
        """This optimizer's :class:`~shardfc.head.fused.device_scalars.DeviceScalars`, made at first use
        (also after a copy or a pickle, which drop its tensors)."""
        held = self.__dict__.get("_scalars")
        if held is None:
            from shardfc.head.fused.device_scalars import DeviceScalars

            held = self.__dict__["_scalars"] = DeviceScalars()
        return held

    def stage_device_scalars(self) -> None:
        """Put this step's numbers (learning rate, momentum, ...) into the device tensors the fused
        update's kernels and the idle rows' step record read, for every parameter they serve: before
        a captured step is captured or replayed (:class:`shardfc.head.capture.CapturedHeadStep`),
        where they cannot change."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.fused_update and self.fused_update_unavailable(p) is None:
                    self._row_update(p, group)
                clock = self._clocks.get(p)
                if clock is not None:
                    self._step_record_scalars(clock, group)

    def _step_record_scalars(self, clock: IdleClock, group: dict) -> Optional[Tensor]:
        """The numbers :meth:`_record_step` hands ``clock`` on the device (None: it takes host numbers)."""
        return None

    # ------------------------------------------------------------------ a captured step's host side
    def host_marks(self, params: Sequence[Tensor]) -> dict:
        """What a step of ``params`` advances on the host (each group's rounding step, each of their
        idle clocks' length), as it is before the step: :meth:`replayed` takes it after a replay."""
        return {"rounding_step": [g["rounding_step"] for g in self.param_groups],
                "lengths": {id(p): self._clocks[p].length for p in params if p in self._clocks}}

    def replayed(self, params: Sequence[Tensor], marks: dict) -> None:
        """A CUDA graph of one step of ``params`` was replayed: it advanced the device's side (the
        rows, their state, each idle clock's table and ``now``) and no Python ran, so the host's
        counts move on here as the eager step's code would have moved them; then the idle rows are
        caught up where the table is full (outside the graph, as the eager step does at its end)."""
        for group, step in zip(self.param_groups, marks["rounding_step"]):
            group["rounding_step"] = step + 1
        for p in params:
            length = marks["lengths"].get(id(p))
            if length is not None:
                self._clocks[p].replayed(length)
        self.catch_up_due_()

    def catch_up_due_(self) -> None:
        """Every row of each parameter whose step table is full brought up to date (the table restarts)."""
        for p, clock in list(self._clocks.items()):
            if clock.length > FULL_CATCH_UP_EVERY:
                self.catch_up_(p, None)

    def capture_unavailable(self) -> Optional[str]:
        """Why a CUDA graph cannot record this optimizer's step (None when it can): AdamW's exact
        catch-up iterates each row's missed steps a number of times the host counts."""
        if self.idle_rows == "exact" and self.sampled_rows is not None and self.CLOCK is not SGDClock:
            return (f"{type(self).__name__} with idle_rows='exact' catches idle rows up by iterating their missed "
                    "steps a number of times the host counts; capture SGD, or AdamW with idle_rows='lazy'")
        return None

    def ready_to_capture(self, params: Sequence[Tensor]) -> bool:
        """Every idle clock a step of ``params`` records into exists (the first sampled step makes
        it; a capture must not: its tensors would be made by the capture and zeroed by each replay)."""
        if self.idle_rows != "exact" or self.sampled_rows is None:
            return True
        return all(p in self._clocks for p in params)

    def graph_tensors(self, params: Sequence[Tensor]) -> list:
        """The state a step of ``params`` reads and writes in place (optimizer state, idle clocks):
        a captured graph holds their addresses, so a new tensor there (a loaded state, a restarted
        clock) means a new capture."""
        out = [t for p in params for t in self.state.get(p, {}).values() if isinstance(t, Tensor)]
        for p in params:
            clock = self._clocks.get(p)
            if clock is not None:
                out += [clock.stamps, clock.now, clock.table]  # every clock makes its table when made
        return out

    def _grad_scale_on(self, device: torch.device) -> Optional[Tensor]:
        """The ``grad_scale`` set for this step (see the class), as fp32 on ``device``; None without one."""
        scale = getattr(self, "grad_scale", None)
        return None if scale is None else scale.to(device, torch.float32).reshape(1)

    def _rounder(self, group: dict, index: int, device: torch.device, catch_up: bool = False):
        """``round(x, dtype)`` for this step and parameter (``catch_up``: for a catch-up's writes,
        from draws of their own)."""
        mode = group["rounding"]
        gen = None
        if mode == "stochastic":
            gen = torch.Generator(device=device).manual_seed(
                mix_seed(group["rounding_seed"], group["rounding_step"], index, *((_CATCH_UP_DRAWS,) if catch_up else ())))
        return lambda x, dtype: round_to(x, dtype, mode, gen)

    # ------------------------------------------------------------------ idle rows (catch_up)
    def _group_of(self, p: Tensor) -> Tuple[int, dict]:
        for group in self.param_groups:
            for index, q in enumerate(group["params"]):
                if q is p:
                    return index, group
        raise ValueError("the tensor is not a parameter of this optimizer")

    def catch_up_(self, p: Tensor, rows: Optional[Tensor] = None) -> bool:
        """Bring ``rows`` of parameter ``p`` (None: every row) and their optimizer state to where the
        dense optimizer would have them after the steps they sat out (``idle_rows="exact"``; with
        ``"lazy"`` nothing happens). Returns whether anything was behind (host-known, no device
        read). A head attached by :meth:`keep_rows_current_by` calls it before it reads rows."""
        clock = self._clocks.get(p)
        # Inside a capture even rows with nothing behind are caught up: a replay's may be behind.
        if self.idle_rows != "exact" or clock is None or (clock.all_current and not capture.capturing()):
            return False
        index, group = self._group_of(p)
        rnd = self._rounder(group, index, p.device, catch_up=True)
        # A block, not the @torch.no_grad() decorator: mutmut 3 does not mutate decorated functions.
        with torch.no_grad():
            self._catch_up_rows(p, clock, rows, rnd, self._catch_up_by_kernel(p, group))
        return True

    def _catch_up_by_kernel(self, p: Tensor, group: dict) -> bool:
        """Whether ``p``'s idle rows are caught up by the Triton kernel (see ``catch_up_kernel``)."""
        return kernel_serves(self.catch_up_kernel, p, group["rounding"], "catch_up_kernel=True")

    def catch_up_all_(self) -> None:
        """Every row of every parameter up to date (what a reader of all rows needs: saving a state)."""
        for p in list(self._clocks):
            self.catch_up_(p, None)

    def rows_are_current(self) -> None:
        """Every row's state was just replaced (a state loaded): nothing is behind any more."""
        self._clocks.clear()

    @property
    def idle_state_bound(self) -> int:
        """The most bytes this optimizer keeps for its idle rows (``idle_rows="exact"``, Partial FC):
        a 4-byte stamp per row and each parameter's step table at its longest
        (:data:`~shardfc.head.catch_up.FULL_CATCH_UP_EVERY` entries); 0 when it keeps none."""
        if self.idle_rows != "exact" or self.sampled_rows is None:
            return 0
        return sum(self.CLOCK.bound_nbytes(p) for g in self.param_groups for p in g["params"])

    def _catch_up_rows(self, p: Tensor, clock: IdleClock, rows: Optional[Tensor], rnd, kernel: bool) -> None:
        raise NotImplementedError

    def _new_clock(self, p: Tensor) -> IdleClock:
        return self.CLOCK(p)

    def _record_step(self, clock: IdleClock, group: dict) -> None:
        raise NotImplementedError

    def _advance(self, p: Tensor, group: dict, rows: Optional[Tensor]) -> None:
        """``p`` took this step on ``rows`` (None: every row): the other rows sat it out."""
        if self.idle_rows != "exact":
            return
        if rows is None:  # a dense step: every row is current
            self._clocks.pop(p, None)
            return
        clock = self._clocks.get(p)
        if clock is None:
            if capture.capturing():  # its tensors would be made by the capture and zeroed by every replay
                raise RuntimeError("a CUDA graph capture reached a parameter's first sampled step: run one step "
                                   "eagerly first (CapturedHeadStep does)")
            clock = self._clocks[p] = self._new_clock(p)  # every row is current before its first sparse step
        self._record_step(clock, group)
        clock.mark_current(rows)
        # Bounds the table: one pass over the rows now and then (after a replay, by `replayed`).
        if clock.length > FULL_CATCH_UP_EVERY and not capture.capturing():
            self.catch_up_(p, None)

    @staticmethod
    def _rows_in(entry) -> Optional[Tensor]:
        return entry.rows if isinstance(entry, RowGrad) else entry

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():  # as torch's optimizers run it: the closure may call backward
                loss = closure()
        # A block, not the @torch.no_grad() decorator: mutmut 3 does not mutate decorated functions.
        with torch.no_grad():
            self._step_params()
        return loss

    def _step_params(self) -> None:
        """One step of every parameter (:meth:`step`'s body, under ``no_grad``)."""
        rows_of = self._take_rows()
        updated, self._updated_in_backward = self._updated_in_backward, set()
        # The head whose rows these are caught them up in the forwards that sampled them, through
        # this optimizer (its catch_up is attached here): not again. Otherwise the step does.
        head = self._head() if self._head is not None else None
        forward_caught_up = head is not None and head.rows_kept_current_by(self)
        for group in self.param_groups:
            for index, p in enumerate(group["params"]):
                entry = rows_of.get(p)
                rows = self._rows_in(entry)
                if id(p) in updated:  # the head's backward applied this step already
                    self._advance(p, group, rows)
                    continue
                if not isinstance(entry, RowGrad) and p.grad is None:
                    continue  # no gradient: no step at all, as torch's optimizers do
                # Its state made now, not by the first block that updates a row: a shard of no classes
                # (fewer classes than shards) has no block, and its state would lack the keys every
                # other shard's has (which sharded_state, grow and checkpoints gather by key).
                self._make_state(p, group)
                if not forward_caught_up:
                    self.catch_up_(p, rows)
                if not self._fused_update(p, entry, group):
                    rnd = self._rounder(group, index, p.device)
                    scale = self._grad_scale_on(p.device)
                    for idx, source, at in self._blocks(p, entry):
                        # No name holds the block's gathered gradient: it is freed before the next block's.
                        self._update(p, idx, source[at] if scale is None else
                                     source[at].to(update_dtype(p.dtype)) / scale, group, rnd)
                self._advance(p, group, rows)
            group["rounding_step"] += 1

    def state_dict(self) -> Dict[str, Any]:
        """torch's ``state_dict``, of every row caught up first (a saved state is the dense one)."""
        self.catch_up_all_()
        return super().state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """torch's ``load_state_dict``, after checking that the state is one of this kind of optimizer
        for these parameters: torch's takes an SGD state into an AdamW (its first step a KeyError on
        ``betas``) and a momentum of 20 rows into a head of 30 (an IndexError, or, while the sampled
        rows stay below 20, steps that read another head's rows)."""
        self._check_loadable(state_dict)
        super().load_state_dict(state_dict)
        # torch's replaces each group by the saved one: a state of torch's own SGD / AdamW has none
        # of this optimizer's rounding settings, which stay as this optimizer was made.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.rows_are_current()

    def _check_loadable(self, state_dict: Mapping[str, Any]) -> None:
        name = type(self).__name__
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
            raise ValueError(f"{name}.load_state_dict: expected an optimizer's state_dict "
                             f"(keys 'state' and 'param_groups'), got {type(state_dict).__name__}")
        groups = state_dict["param_groups"]
        for i, group in enumerate(groups):
            unlike = _torch_only_settings(group)
            if unlike:
                raise ValueError(f"{name}.load_state_dict: param group {i} has {', '.join(unlike)}, which {name} does "
                                 "not implement: its steps would not be those the state was saved for")
            missing = [k for k in self.HYPER_PARAMETERS if k not in group]
            if missing:
                settings = ", ".join(sorted(k for k in group if k != "params"))
                raise ValueError(
                    f"{name}.load_state_dict: param group {i} has no {', '.join(map(repr, missing))}: a state "
                    f"saved by another kind of optimizer (its settings: {settings})"
                )
        # Saved states are keyed by the index of their parameter in the saved groups' order (torch's).
        saved_ids = [i for group in groups for i in group.get("params", ())]
        own = [p for group in self.param_groups for p in group["params"]]
        params = dict(zip(saved_ids, own))
        for index, state in state_dict["state"].items():
            p = params.get(index)
            if p is None or not isinstance(state, Mapping):
                continue  # torch's own checks name a state without its parameter
            _check_state_keys(state.keys(), self.KIND, f"{name}.load_state_dict: the state of parameter {index}", name,
                              "do not load this state")
            for key, t in state.items():
                if isinstance(t, Tensor) and t.dim() >= 1 and (t.shape[0] != p.shape[0] or
                                                                (t.dim() > 1 and t.shape != p.shape)):
                    raise ValueError(
                        f"{name}.load_state_dict: the state {key!r} of parameter {index} has shape {tuple(t.shape)}, "
                        f"the parameter {tuple(p.shape)}: a state saved for another head (other classes, "
                        "another shard, or another embedding width)"
                    )


class RowSparseSGD(_RowSparseOptimizer):
    """``torch.optim.SGD`` (momentum, nesterov, weight decay; no dampening) on the sampled rows only.

    ``sampled_rows``: called once per :meth:`step`, returns ``{parameter: row ids or RowGrad}``
    (normally a head's :meth:`~shardfc.head.module.ShardedMarginHead.take_sampled_rows`). A parameter
    without rows is updated densely, exactly as ``torch.optim.SGD`` would. ``rounding``,
    ``rounding_seed``: see :class:`_RowSparseOptimizer` (they matter for bf16/fp16 parameters only).
    ``fused``: update each parameter with one Triton kernel (:mod:`shardfc.head.fused.optimizer`:
    rows gathered, fp32 update, one rounding to nearest) instead of a dozen torch kernels per block
    of rows. None (default): on CUDA when Triton is installed and the parameter qualifies; True:
    always, or a ValueError saying why not; False: never.
    """

    CLOCK = SGDClock
    #: The settings a saved state of this kind of optimizer holds in every param group.
    HYPER_PARAMETERS = ("momentum", "nesterov", "weight_decay")
    KIND = "SGD"

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        sampled_rows: Optional[SampledRows] = None,
        rounding: str = "nearest",
        rounding_seed: int = 0,
        fused: Optional[bool] = None,
        idle_rows: str = "exact",
    ):
        if fused not in (None, True, False):
            raise TypeError(f"fused must be None (automatic), True or False, got {fused!r}")
        self.fused = fused
        lr, momentum, weight_decay = check_sgd_hyper_parameters(lr, momentum, weight_decay)
        if nesterov and momentum <= 0:
            raise ValueError("nesterov needs momentum > 0")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, sampled_rows, rounding, rounding_seed, idle_rows)

    def _record_step(self, clock: IdleClock, group: dict) -> None:
        clock.record(group["lr"], group["momentum"], group["weight_decay"], group["nesterov"],
                     matrix=self._step_record_scalars(clock, group), always=capture.capturing())

    def _step_record_scalars(self, clock: IdleClock, group: dict) -> Tensor:
        # The idle step's matrix, formed in fp64 on the host as the eager step always formed it, on
        # the device at one address per group (copied when the numbers change): the record reads it.
        matrix = sgd_idle_matrix(group["lr"], group["momentum"], group["weight_decay"], group["nesterov"])
        return self._scalar_holder().get(("idle_step", self._group_index(group)), [v for row in matrix for v in row],
                                         clock.table.device, torch.float64)

    def _catch_up_rows(self, p: Tensor, clock: IdleClock, rows: Optional[Tensor], rnd, kernel: bool) -> None:
        group = self._group_of(p)[1]
        clock.catch_up_(p, (self._momentum_buffer(p, group),), rows, rnd, kernel)

    def _fused_update(self, p: Tensor, entry, group: dict) -> bool:
        if not kernel_serves(self.fused, p, group["rounding"], "RowSparseSGD(fused=True)"):
            return False
        from shardfc.head.fused.optimizer import row_sgd_

        if isinstance(entry, RowGrad):
            idx, grad, at_idx = entry.rows, entry.values, False
        elif p.grad is None:
            return True
        else:
            idx, grad, at_idx = entry, p.grad, True  # rows of the dense .grad (None: every row)
        buf = self._momentum_buffer(p, group)
        hyper = self._device_scalars(group, p.device, (group["lr"], group["momentum"], group["weight_decay"]))
        row_sgd_(p, buf, grad.contiguous(), None if idx is None else idx.contiguous(), at_idx,
                 group["lr"], group["momentum"], group["weight_decay"], group["nesterov"],
                 grad_scale=self._grad_scale_on(p.device), hyper=hyper)
        return True

    def _momentum_buffer(self, p: Tensor, group: dict) -> Optional[Tensor]:
        """``p``'s momentum buffer (made, zero, at the first step; None without momentum)."""
        if not group["momentum"]:
            return None
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        return state["momentum_buffer"]

    def _make_state(self, p: Tensor, group: dict) -> None:
        self._momentum_buffer(p, group)

    def _row_update(self, p: Tensor, group: dict):
        from shardfc.head.fused.chunks import RowUpdate

        buf = self._momentum_buffer(p, group)
        update = RowUpdate(p, buf, group["lr"], group["momentum"], group["weight_decay"], group["nesterov"])
        update.hyper = self._device_scalars(group, p.device, update.hyper_values())
        return update

    def _update(self, p: Tensor, idx, g: Tensor, group: dict, rnd) -> None:
        lr, mom, wd, nesterov = group["lr"], group["momentum"], group["weight_decay"], group["nesterov"]
        cd = update_dtype(p.dtype)
        g = g.to(cd)
        w = p[idx].to(cd)
        # torch.optim.SGD's own operations (``add(x, alpha=a)``: fused multiply-adds where the CPU's
        # vector kernels use them), so that a row's update rounds as the dense optimizer's does
        if wd:
            g = g.add(w, alpha=wd)
        if mom:
            buf = self._momentum_buffer(p, group)
            b = buf[idx].to(cd).mul(mom).add(g)
            buf[idx] = rnd(b, buf.dtype)
            g = g.add(b, alpha=mom) if nesterov else b
        p[idx] = rnd(w.add(g, alpha=-lr), p.dtype)


class RowSparseAdamW(_RowSparseOptimizer):
    """``torch.optim.AdamW`` on the sampled rows only, with a per-row step count for bias correction.

    ``sampled_rows``, ``rounding``, ``rounding_seed`` as for :class:`RowSparseSGD`. The moments
    are kept in the parameter's dtype, but for fp16 parameters the second moment is fp32: in fp16,
    ``(1 − β2)·g²`` underflows for gradients below ~8e-3 (fp16's subnormals end at 6e-8), and a row
    whose ``v`` rounds to 0 while ``m`` does not moves by ``lr·m/ε`` — the fp16 head then diverged
    within 8 steps in half the seeds tried (``tests/head/test_low_precision.py``). bf16 has fp32's
    range and keeps both moments in bf16.
    """

    CLOCK = AdamWClock
    #: The settings a saved state of this kind of optimizer holds in every param group.
    HYPER_PARAMETERS = ("betas", "eps", "weight_decay")
    KIND = "AdamW"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        sampled_rows: Optional[SampledRows] = None,
        rounding: str = "nearest",
        rounding_seed: int = 0,
        idle_rows: str = "exact",
    ):
        lr, betas, eps, weight_decay = check_adamw_hyper_parameters(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, sampled_rows, rounding, rounding_seed, idle_rows)

    def _record_step(self, clock: IdleClock, group: dict) -> None:
        clock.record(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _catch_up_rows(self, p: Tensor, clock: IdleClock, rows: Optional[Tensor], rnd, kernel: bool) -> None:
        state = self._adam_state(p)
        clock.catch_up_(p, (state["exp_avg"], state["exp_avg_sq"], state["row_step"]), rows, rnd, kernel)

    @staticmethod
    def state_dtype(p: Tensor, key: str) -> Optional[torch.dtype]:
        """The dtype of ``p``'s state ``key`` where it is not ``p``'s own (None): fp16's second
        moment in fp32, the per-row step count in fp64 (see :meth:`_adam_state`)."""
        if key == "exp_avg_sq" and p.dtype == torch.float16:
            return torch.float32
        return torch.float64 if key == "row_step" else None

    def _adam_state(self, p: Tensor) -> dict:
        """``p``'s state: the moments (zero, in ``p``'s dtype; fp16's second moment in fp32, see the
        class) and the per-row step count (fp64
        zeros) made at its first step. A state loaded from ``torch.optim.AdamW`` (a scalar ``step``,
        the same for every row, as a dense head trained without Partial FC keeps it) gets its
        per-row count from it."""
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32 if p.dtype == torch.float16 else None)
        if "row_step" not in state:
            step = state.pop("step", 0.0)
            state["row_step"] = torch.zeros(p.shape[0], dtype=torch.float64, device=p.device).add_(step)
        return state

    def _make_state(self, p: Tensor, group: dict) -> None:
        self._adam_state(p)

    def _row_update(self, p: Tensor, group: dict):
        from shardfc.head.fused.chunks import RowUpdate

        state = self._adam_state(p)
        update = RowUpdate.adamw(p, state["exp_avg"], state["exp_avg_sq"], state["row_step"], group["lr"],
                                 group["betas"], group["eps"], group["weight_decay"])
        update.hyper = self._device_scalars(group, p.device, update.hyper_values())
        return update

    def _update(self, p: Tensor, idx, g: Tensor, group: dict, rnd) -> None:
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state = self._adam_state(p)
        cd = update_dtype(p.dtype)
        g = g.to(cd)
        w = p[idx].to(cd) * (1 - lr * wd)
        m = state["exp_avg"][idx].to(cd).lerp(g, 1 - b1)
        v = state["exp_avg_sq"][idx].to(cd).mul(b2).addcmul(g, g, value=1 - b2)
        t = state["row_step"][idx] + 1
        bias1 = (1 - b1**t).to(cd).unsqueeze(1)
        bias2_sqrt = (1 - b2**t).sqrt().to(cd).unsqueeze(1)
        w = w - (lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps)
        state["exp_avg"][idx] = rnd(m, state["exp_avg"].dtype)
        state["exp_avg_sq"][idx] = rnd(v, state["exp_avg_sq"].dtype)
        state["row_step"][idx] = t
        p[idx] = rnd(w, p.dtype)


def check_sgd_hyper_parameters(lr, momentum, weight_decay) -> Tuple[float, float, float]:
    """SGD's ``(lr, momentum, weight_decay)`` as finite floats ``>= 0``, else an error naming the
    argument and its value (a NaN learning rate would train every row to NaN, silently)."""
    return (check_real("lr", lr, nonnegative=True), check_real("momentum", momentum, nonnegative=True),
            check_real("weight_decay", weight_decay, nonnegative=True))


def check_adamw_hyper_parameters(lr, betas, eps, weight_decay) -> Tuple[float, Tuple[float, float], float, float]:
    """AdamW's ``(lr, betas, eps, weight_decay)``: finite, ``>= 0``, each beta in [0, 1); else an
    error naming the argument and its value."""
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    pair = tuple(check_probability(f"betas[{i}]", b, low_open=False, high_open=True) for i, b in enumerate(betas))
    return (check_real("lr", lr, nonnegative=True), pair, check_real("eps", eps, nonnegative=True),
            check_real("weight_decay", weight_decay, nonnegative=True))


def head_optimizer(
    head: nn.Module,
    name: str,
    lr: float,
    momentum: Optional[float] = None,
    weight_decay: float = 5e-4,
    nesterov: Optional[bool] = None,
    betas: Optional[Tuple[float, float]] = None,
    eps: Optional[float] = None,
    rounding: str = "nearest",
    rounding_seed: int = 0,
    fused_update: bool = False,
    idle_rows: str = "exact",
) -> torch.optim.Optimizer:
    """The optimizer for a head's shards: row-sparse under Partial FC, torch's own otherwise.

    Under Partial FC the step updates the sampled rows only, and with ``idle_rows="exact"`` (the
    default) every other row is brought to where the dense optimizer would have it — momentum,
    weight decay, AdamW's moments and bias corrections, every step's learning rate — the next time
    anything reads it (:mod:`shardfc.head.catch_up`): the run equals the same run with
    ``torch.optim.SGD`` / ``AdamW`` over the whole weight, to fp32 rounding (AdamW: and a stated
    bound, ``ADAMW_DROPPED_BOUND``), at the row-sparse cost plus 4 bytes a row.
    ``idle_rows="lazy"`` leaves an unsampled row and its state untouched until it is sampled again
    (MXNet's ``lazy_update``): no momentum or decay while idle, which cost 3.6 / 6.1 points of
    hard-pair accuracy at r = 0.1 / 0.05 on the glyph identities (docs/accuracy.md).

    The row-sparse optimizers take the rows to update from ``head.take_sampled_rows`` at each step.
    They also serve a head whose weights are bf16/fp16 (with every row updated when there is no
    sampling): its state stays in that dtype and each update is computed in fp32 and rounded back
    once, to ``rounding`` (``"nearest"`` or ``"stochastic"``, seeded by ``rounding_seed``).

    ``fused_update=True`` (SGD and AdamW): the head's backward applies this optimizer's step to each
    weight row as it forms the row's gradient (the GPU implementations, ``impl="triton"`` /
    ``"gemm"``), so the ``[n, D]`` gradient is never written, cleared or read again and ``step()``
    has nothing left to do for the head. Then the head's weights get no ``.grad``: nothing can
    clip, inspect or accumulate it — call ``backward`` once per ``step()`` (a second backward
    before it is an error), and keep ``fused_update=False`` for gradient accumulation, clipping
    the head, fp16 loss scaling or gradient hooks. Where the backward cannot apply it (the torch
    implementation, fp16 compute, stochastic rounding), the step runs as usual in ``step()``;
    ``head.last_update`` says which ran. The update is the optimizer's own (the same rows, the
    same fp32 arithmetic, one rounding), equal to the unfused path to fp32 rounding. The optimizer
    is then the row-sparse one (:class:`RowSparseSGD`, :class:`RowSparseAdamW`: for AdamW a step
    count per row, equal for every row without Partial FC) even for an fp32 head without sampling,
    where ``fused_update=False`` returns torch's: the same update.

    ``momentum`` (default 0.9) and ``nesterov`` (default False) are SGD's, ``betas`` (default
    ``(0.9, 0.999)``) and ``eps`` (default 1e-8) AdamW's: one given to the other optimizer is a
    ValueError naming it (it would be dropped silently). A learning rate, momentum,
    weight decay or eps that is negative or not finite, or a beta outside [0, 1), is a ValueError
    naming it, whichever optimizer serves the head (torch's own take a NaN learning rate).
    """
    key = str(name).lower()
    if key not in ("sgd", "adamw"):
        raise ValueError(f"optimizer name must be 'sgd' or 'adamw', got {name!r}")
    others = dict(momentum=momentum, nesterov=nesterov) if key == "adamw" else dict(betas=betas, eps=eps)
    dropped = next((k for k, v in others.items() if v is not None), None)
    if dropped is not None:
        owner = "SGD" if key == "adamw" else "AdamW"
        raise ValueError(f"{dropped}={others[dropped]!r} is {owner}'s; optimizer {name!r} does not read it")
    momentum = 0.9 if momentum is None else momentum
    nesterov = False if nesterov is None else nesterov
    betas = (0.9, 0.999) if betas is None else betas
    eps = 1e-8 if eps is None else eps
    # Checked here for torch's optimizers too: torch.optim.SGD takes a NaN lr or weight decay.
    if key == "sgd":
        lr, momentum, weight_decay = check_sgd_hyper_parameters(lr, momentum, weight_decay)
    else:
        lr, betas, eps, weight_decay = check_adamw_hyper_parameters(lr, betas, eps, weight_decay)
    check_rounding(rounding)
    check_seed("rounding_seed", rounding_seed)  # read by the row-sparse optimizers only, checked for every one
    if not isinstance(fused_update, bool):
        raise TypeError(f"fused_update must be True or False, got {fused_update!r}")
    sparse = getattr(head, "sample_rate", 1.0) < 1.0
    params = list(head.parameters())
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    check_idle_rows(idle_rows)
    own = dict(sampled_rows=head.take_sampled_rows if sparse else None, rounding=rounding, rounding_seed=rounding_seed,
               idle_rows=idle_rows)
    # On CUDA torch's fused kernels update all of a shard in one pass (the unfused SGD over
    # 1M x 512 fp32 rows took 8.4 ms of a 57 ms step on an H100); the state they keep is the same.
    fused = fused_optimizer_ok(params)
    attach = getattr(head, "fuse_optimizer_update", None)
    if fused_update and attach is None:
        raise TypeError(f"fused_update=True needs a ShardedMarginHead, got {type(head).__name__}")
    if key == "sgd":
        if not (sparse or low or fused_update):
            return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                                   fused=fused)
        opt = RowSparseSGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, **own)
    else:
        if not (sparse or low or fused_update):
            return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
        opt = RowSparseAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **own)
    if fused_update:
        opt.fused_update = True
        attach(opt)
    return opt


def fused_optimizer_ok(params: Sequence[Tensor]) -> Optional[bool]:
    """True when every parameter is a CUDA fp32 tensor (torch's fused SGD/AdamW apply), else None
    (torch's default choice)."""
    ok = bool(params) and all(p.is_cuda and p.dtype == torch.float32 for p in params)
    return True if ok else None


# --------------------------------------------------------------------------- optimizer state of a sharded head


def _is_row_tensor(value, param: Tensor) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == param.shape[0]


def _same(a, b) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def optimizer_rows(
    optimizer: torch.optim.Optimizer, params: Sequence[Tensor]
) -> Tuple[Dict[str, Tensor], Dict[str, Any]]:
    """The state ``optimizer`` keeps for ``params`` (a head's shard weights, in class order), as if
    they were one shard: ``(row tensors, the rest)``.

    A state tensor whose first dim is its parameter's row count (momentum, Adam's moments, the
    row-sparse AdamW's per-row step) is per row: the shards' tensors are concatenated, on the CPU
    (a single CPU shard's is returned as is, sharing memory). Any other state value (AdamW's scalar
    step) must be equal for every shard and is returned once, as is ``"param_groups"``: the
    optimizer's hyper-parameters, without the parameters.
    """
    states = [optimizer.state.get(p, {}) for p in params]
    keys = set(states[0]) if states else set()
    for p, st in zip(params, states):
        if set(st) != keys:
            raise ValueError(f"the optimizer holds state {sorted(st)} for one shard but {sorted(keys)} for another")
    tensors: Dict[str, Tensor] = {}
    extras: Dict[str, Any] = {}
    for key in sorted(keys):
        values = [st[key] for st in states]
        rows = [_is_row_tensor(v, p) for v, p in zip(values, params)]
        if all(rows):
            parts = [v.detach().cpu() for v in values]
            tensors[key] = parts[0] if len(parts) == 1 else torch.cat(parts)
        elif not any(rows):
            if not all(_same(values[0], v) for v in values[1:]):
                raise ValueError(f"optimizer state {key!r} differs between shards: {values!r}")
            v = values[0]
            extras[key] = v.detach().cpu().clone() if isinstance(v, Tensor) else copy.deepcopy(v)
        else:
            raise ValueError(f"optimizer state {key!r} is a per-row tensor for some shards only")
    extras["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return tensors, extras


def _adamw_step_form(optimizer: torch.optim.Optimizer, tensors: Mapping[str, Tensor],
                      extras: Mapping[str, Any]) -> Tuple[Mapping[str, Tensor], Mapping[str, Any]]:
    """``(tensors, extras)`` with a row-sparse AdamW's per-row step count made torch AdamW's scalar
    ``step`` when ``optimizer`` is torch's (see :func:`load_optimizer_rows`)."""
    if not isinstance(optimizer, torch.optim.AdamW) or "row_step" not in tensors or "step" in extras:
        return tensors, extras
    counts = tensors["row_step"].cpu()  # the saved rows: host tensors, no device to wait for
    if counts.numel() and not bool((counts == counts[0]).all()):
        raise ValueError(
            "the saved AdamW state has a step count per row that differs between rows (Partial FC's lazy row-sparse "
            "AdamW, idle_rows='lazy'), but this optimizer is torch's AdamW, which keeps one count; load it into the row-sparse "
            "AdamW (sample_rate < 1, or head_optimizer(..., fused_update=True))")
    step = torch.tensor(float(counts[0]) if counts.numel() else 0.0)
    return {k: v for k, v in tensors.items() if k != "row_step"}, dict(extras, step=step)


def _state_dtype(optimizer: torch.optim.Optimizer, p: Tensor, key: str, saved: Tensor) -> torch.dtype:
    """The dtype ``optimizer`` would make ``p``'s state ``key`` in: the row-sparse AdamW's own answer
    where it has one, else ``p``'s for floating-point state, as torch's optimizers and the row-sparse
    SGD keep it; a saved bf16 momentum put under an fp32 head as is would update in bf16 (and torch's
    fused CUDA step refuses the mix)."""
    own = getattr(optimizer, "state_dtype", None)
    dtype = own(p, key) if own is not None else None
    if dtype is None:
        dtype = p.dtype if saved.is_floating_point() else saved.dtype
    return dtype


#: The setting that tells the two kinds of head optimizer apart in a param group (torch's and the
#: row-sparse ones alike), and the state each kind keeps.
_KIND_SETTING = {"SGD": "momentum", "AdamW": "betas"}
_KIND_STATE = {"SGD": {"momentum_buffer"}, "AdamW": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "row_step", "step"}}


def _kind(group: Mapping[str, Any]) -> Optional[str]:
    """``"SGD"`` or ``"AdamW"`` by the settings of param group ``group``; None for another optimizer."""
    kinds = [kind for kind, key in _KIND_SETTING.items() if key in group]
    return kinds[0] if len(kinds) == 1 else None


def _check_state_keys(keys: Any, kind: str, what: str, name: str,
                      instead: str = "load the head without its optimizer state") -> None:
    """Refuse state ``keys`` that an optimizer of ``kind`` does not keep: another kind's (an AdamW
    state into an SGD), or another optimizer's (RMSprop's ``square_avg``, NAdam's ``mu_product``),
    whose moments this optimizer would misread or ignore."""
    foreign = sorted(set(keys) - _KIND_STATE[kind])
    if not foreign:
        return
    other = [k for k, own in _KIND_STATE.items() if k != kind and set(foreign) <= own]
    whose = f"{other[0]}'s state" if other else f"state that no {kind} keeps"
    into = f"load it into an {other[0]} optimizer, or " if other else ""
    raise ValueError(f"{what} holds {', '.join(map(repr, foreign))}, {whose}; this optimizer is {name}: {into}"
                     f"{instead} (its optimizer then starts fresh)")


def loadable_optimizer_rows(
    optimizer: torch.optim.Optimizer,
    row_slices: Sequence[Tuple[int, int]],
    tensors: Mapping[str, Tensor],
    extras: Mapping[str, Any],
) -> Tuple[Mapping[str, Tensor], Mapping[str, Any]]:
    """:func:`load_optimizer_rows`' ``(tensors, extras)`` in ``optimizer``'s form (AdamW's step count),
    after checking that they are a state ``optimizer`` can continue; nothing is written, so a caller
    can check before it writes anything else (the head's rows).

    Raises:
        ValueError: the state was saved by the other kind of optimizer (an SGD state into an AdamW
            failed at its first step on a missing ``exp_avg``; an AdamW state into an SGD trained on
            with AdamW's learning rate and decoupled weight decay as SGD's, its moments ignored), with
            settings the row-sparse optimizers do not implement, another number of param groups, or
            tensors of another number of rows.
    """
    tensors, extras = _adamw_step_form(optimizer, tensors, extras)
    name = type(optimizer).__name__
    groups = extras.get("param_groups")
    mine = _kind(optimizer.param_groups[0])
    if groups is not None:
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(
                f"saved optimizer state has {len(groups)} param groups, this optimizer {len(optimizer.param_groups)}"
            )
        for i, group in enumerate(groups):
            theirs = _kind(group)
            if mine is not None and theirs is not None and theirs != mine:
                raise ValueError(
                    f"the saved head optimizer state is {theirs}'s (its param group {i} has {_KIND_SETTING[theirs]!r}), "
                    f"this optimizer is {name}: load it into an {theirs} optimizer, or load the head without its "
                    "optimizer state (its optimizer then starts fresh)")
            if isinstance(optimizer, _RowSparseOptimizer):
                unlike = _torch_only_settings(group)
                if unlike:
                    raise ValueError(f"the saved head optimizer state's param group {i} has {', '.join(unlike)}, which "
                                     f"{name} does not implement: its steps would not be those the state was saved for")
    if mine is not None:
        _check_state_keys(set(tensors) | {k for k in extras if k != "param_groups"}, mine,
                          "the saved head optimizer state", name)
    total = sum(hi - lo for lo, hi in row_slices)
    for key, t in tensors.items():
        if t.dim() < 1 or t.shape[0] != total:
            raise ValueError(f"optimizer state {key!r} has shape {tuple(t.shape)}; expected {total} rows")
    return tensors, extras


def load_optimizer_rows(
    optimizer: torch.optim.Optimizer,
    params: Sequence[Tensor],
    row_slices: Sequence[Tuple[int, int]],
    tensors: Mapping[str, Tensor],
    extras: Mapping[str, Any],
) -> None:
    """Put state in :func:`optimizer_rows`' form back into ``optimizer``: rows ``row_slices[i]`` of
    each row tensor become ``params[i]``'s, and every shard gets its own copy of the other values.

    Row tensors take the dtype ``optimizer`` gives that state when it makes it (:func:`_state_dtype`:
    a bf16 head's momentum in bf16, an fp32 head's in fp32, whatever head saved it, as torch's
    ``load_state_dict`` casts) and move to their parameter's device; a non-row tensor (AdamW's step)
    stays on the CPU as torch keeps it.
    The param groups' hyper-parameters are restored when ``extras`` holds them. Without any state
    (saved before the first step), the parameters' state is cleared.

    AdamW's step count crosses between its two forms: the row-sparse AdamW's per-row ``row_step``
    (what a head with ``fused_update=True`` keeps even without Partial FC) becomes ``torch.optim.AdamW``'s
    scalar ``step`` when every row has the same count, and is refused with the reason otherwise; the
    other way, :class:`RowSparseAdamW` takes a scalar ``step`` as every row's count at its next step.
    """
    tensors, extras = loadable_optimizer_rows(optimizer, row_slices, tensors, extras)
    rows_are_current = getattr(optimizer, "rows_are_current", None)
    if rows_are_current is not None:
        rows_are_current()  # the loaded state is a caught-up one (what sharded_state saves)
    groups = extras.get("param_groups")
    if groups is not None:
        for group, saved in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
    for p, (lo, hi) in zip(params, row_slices):
        state: Dict[str, Any] = {}
        for key, t in tensors.items():
            rows = t[lo:hi].to(p.device, _state_dtype(optimizer, p, key, t))
            if rows.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                rows = rows.clone()  # the optimizer's own storage: stepping must not write into the caller's
            state[key] = rows
        for key, v in extras.items():
            if key != "param_groups":
                state[key] = v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)
        if state:
            optimizer.state[p] = state
        else:
            optimizer.state.pop(p, None)
