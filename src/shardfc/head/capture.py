"""The head's training step as one CUDA graph: forward, backward and the fused update, replayed.

At a million classes the GPU step is hundreds of kernel launches (:mod:`shardfc.head.fused.chunks`:
a handful per class chunk), each costing the host a few microseconds to issue, so the host can
take as long to issue a step as the GPU takes to run it. A CUDA graph issues the whole step in one
call. :class:`CapturedHeadStep` records one step of a head whose optimizer applies its update in
the backward (``head_optimizer(..., fused_update=True)``) — the head's forward, its backward into
the embeddings and the weights' update — and replays it for every later batch of the same shapes::

    head = ShardedMarginHead(512, 1_000_000, device="cuda", impl="gemm")
    opt = head_optimizer(head, "sgd", lr=0.1, momentum=0.9, fused_update=True)
    step = CapturedHeadStep(head, opt)
    for images, labels in loader:
        embeddings = backbone(images)
        loss = step.loss(embeddings, labels)   # the head's step replayed; its update applied
        loss.backward()                        # the backbone's gradient, from the replayed one
        backbone_opt.step(); backbone_opt.zero_grad()

Why a replay computes what the eager step computes, and what it cannot do:

* **No number of the step is frozen into the graph.** The kernels read the learning rate,
  momentum, weight decay (and AdamW's β, ε) from a device tensor the optimizer keeps at one
  address (:class:`~shardfc.head.fused.device_scalars.DeviceScalars`), which :meth:`CapturedHeadStep.loss`
  refreshes before each replay, outside the graph: a learning-rate schedule takes effect.
* **Nothing inside the step reads the host.** The input value checks (finite embeddings, labels
  in range) run before the replay, outside the graph, and are read at the next call, as
  ``validate="deferred"`` does (:class:`~shardfc.head.validation.PendingCheck`): a bad batch is still
  named, one call later. Types and shapes are checked at every call.
* **Settled before capture.** The first :data:`EAGER_STEPS` calls, and the first after anything
  changes, run the step eagerly: ``impl="auto"`` times its candidates, Triton tunes, the optimizer
  makes its state and the update writes the next step's operand, so the captured forward reads
  that operand instead of making one. A call with other shapes or dtypes, or after the weights were
  changed outside the graph (``load_state_dict``, ``grow``: anything that bumps their version),
  runs eagerly again and captures anew.
* **Partial FC** is captured too. Its draw is counter-based (:func:`~shardfc.head.sampling.draw_keys`)
  and reads the step number from a device counter the step advances, so each replay draws the
  sample the eager step of that number draws. The idle rows' record (:class:`~shardfc.head.catch_up.SGDClock`)
  lives on the device: its table (made at its longest), the step matrix (staged with the learning
  rate) and ``now``, from which the catch-up kernel and the stamping read the step. Inside the
  capture nothing is skipped on a host condition (rows with nothing behind are caught up, as a
  replay's may be behind). After each replay the host's counts move on as the eager step's code
  would have moved them (``sample_step``, each clock's length, the rounding step), and the idle
  rows are caught up in full when a table is full, outside the graph, as the eager step does.
* **Refused** (:func:`capture_unavailable` says why, and the constructor raises it): a head not on
  one CUDA device in one process (a process-group head exchanges batch sizes through the host), an
  optimizer without the fused update (its step would be outside the graph), a head clipped by its
  gradient norm (read between backward and step), Partial FC with ``sparse_grad`` (each backward's
  compact gradient goes to host-side lists) and AdamW's exact catch-up of idle rows (it iterates a
  number of missed steps the host counts; AdamW with ``idle_rows="lazy"`` is captured).

The replayed loss must be backpropagated with a gradient of 1 (``loss.backward()``, as the trainer
does): the update inside the graph was applied with it, so a scaled loss would scale the embedding
gradient and not the update. Nothing checks this (it would take a host read of the gradient): keep
the loss unscaled (the trainer refuses fp16 loss scaling and gradient accumulation with it).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from shardfc.head.validation import PendingCheck, check_batch_deferred

__all__ = ["CapturedHeadStep", "EAGER_STEPS", "capture_unavailable", "capturing"]

#: Eager steps before the first capture, and after anything that makes a captured graph stale: the
#: first settles ``impl="auto"``, Triton's tuning and the optimizer's state, the second has the
#: update's next operand in place for the captured forward to read.
EAGER_STEPS = 2


def capturing() -> bool:
    """A CUDA graph capture is under way on the current stream: what runs now is recorded once and
    replayed, so it must take no number from the host that a later step changes, and must not skip
    work on a condition the host knows now (the code that asks records what every replay needs).
    Read through this module's attribute (``capture.capturing()``), so a CPU rehearsal can say yes."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture_unavailable(head, optimizer, cuda_available: Optional[bool] = None) -> Optional[str]:
    """Why ``head``'s step with ``optimizer`` cannot be captured as one CUDA graph (None when it can).
    ``cuda_available``: what ``torch.cuda.is_available()`` says (given by tests)."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if head.impl == "torch":
        return "impl='torch' has no fused update; use impl 'auto', 'triton' or 'gemm'"
    if head.sample_rate < 1.0 and head.sparse_grad:
        return ("Partial FC with sparse_grad=True hands each backward's compact gradient to host-side lists; "
                "the fused update needs no gradient at all: build the head with sparse_grad=False")
    if getattr(head, "_grad_sq_on", False):
        return "the head's gradient is clipped by its norm (measure_weight_grad_norm), read between backward and step"
    if optimizer is None or not getattr(optimizer, "fused_update", False):
        return ("the optimizer does not apply its step in the backward: use "
                "head_optimizer(head, ..., fused_update=True), so the update is inside the captured step")
    why = optimizer.capture_unavailable()
    if why is not None:
        return why
    if head.distributed:
        return ("the head is sharded over a process group: its forward exchanges the batch sizes through "
                "the host, which a graph cannot do; capture single-process heads")
    if not cuda:
        return "CUDA is not available here (a CUDA graph is a GPU feature; run the step eagerly)"
    if len(head.devices) != 1 or head.devices[0].type != "cuda":
        return f"the head's shards are on {[str(d) for d in head.devices]}, not on one CUDA device"
    return None


class CapturedHeadStep:
    """One training step of ``head`` with ``optimizer`` (forward, backward, fused update) as a
    CUDA graph, captured after :data:`EAGER_STEPS` eager steps and replayed (see the module).

    Args:
        head: a :class:`~shardfc.ShardedMarginHead` on one CUDA device, in one process.
        optimizer: its :func:`~shardfc.head.partial_fc.head_optimizer` with ``fused_update=True``.
        eager_steps: eager steps before a capture (default :data:`EAGER_STEPS`, at least 1).

    Raises RuntimeError naming the reason (:func:`capture_unavailable`) where it cannot run.
    ``calls`` counts the steps (a value-check error names its call), ``captures`` the captures and
    ``replays`` the replayed steps; ``last_call`` is
    ``"eager"``, ``"captured"`` or ``"replayed"``.
    """

    def __init__(self, head, optimizer, eager_steps: int = EAGER_STEPS):
        why = capture_unavailable(head, optimizer)
        if why is not None:
            raise RuntimeError(f"cannot capture the head's step as a CUDA graph: {why}")
        if isinstance(eager_steps, bool) or not isinstance(eager_steps, int) or eager_steps < 1:
            raise ValueError(f"eager_steps must be an integer >= 1, got {eager_steps!r}")
        self.head, self.optimizer, self.eager_steps = head, optimizer, eager_steps
        self.calls = self.captures = self.replays = 0
        self.last_call: Optional[str] = None
        self._graph = None
        self._key: Optional[tuple] = None
        self._versions: Optional[tuple] = None
        self._eager_left = eager_steps
        self._pending: Optional[PendingCheck] = None
        self._static: Optional[Tuple[Tensor, Tensor]] = None
        self._held: list = []  # the state tensors the graph writes: kept alive, so no other takes their address

    # ------------------------------------------------------------------ the step
    def step(self, embeddings: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor]:
        """``(loss, dJ/d embeddings)`` of one head step on this batch, its update applied to the
        weights. The two tensors are the graph's own outputs after a replay: read (or clone) them
        before the next call."""
        self._check(embeddings, labels)
        key = self._key_of(embeddings, labels)
        if self._graph is not None and (key != self._key or self._weights_moved()):
            self._drop()  # stale: other shapes, or weights changed outside the graph
        weights = self.head.shard_weights
        if self._graph is None and (self._eager_left > 0 or not self.optimizer.ready_to_capture(weights)):
            self._eager_left = max(0, self._eager_left - 1)
            self.last_call = "eager"
            return self._eager(embeddings, labels)
        self._stage()
        captured = self._graph is None
        if captured:
            # The capture's own Python (which ran its host-side counts on) stands for this call's:
            # the counts a replay moves are taken after it (the replay that follows is the step).
            self._capture(embeddings, labels, key)
        else:
            marks = self._host_marks()
        x, y = self._static
        with torch.no_grad():  # the graph's inputs: x is a leaf that requires grad
            x.copy_(embeddings)
            y.copy_(labels)
        self._graph.replay()
        if not captured:
            self._host_follows(marks)
        # The replay updated the weights in place, as the eager step's fused update does, which
        # bumps their version; no Python ran to say so: say it here, so what is keyed on the
        # version (a kept operand outside the graph, the head's step bookkeeping) sees the update.
        for w in weights:
            torch.autograd.graph.increment_version(w)
        self._versions = tuple(w._version for w in weights)
        self.replays += 1
        self.last_call = "captured" if captured else "replayed"
        return self._graph.outputs

    def loss(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        """:meth:`step` as a loss connected to ``embeddings``: its backward hands the step's
        embedding gradient to whatever produced them (the backbone). Backpropagate it with
        gradient 1 (``loss.backward()``): the update inside the step was applied so."""
        loss, grad = self.step(embeddings, labels)
        return _StepLoss.apply(embeddings, loss.detach().clone(), grad.detach().clone())

    def check_pending(self) -> None:
        """Raise the value-check error of the last call's batch, if it failed (every call does
        first; call it after the last step, before saving)."""
        pending, self._pending = self._pending, None
        error = pending.error() if pending is not None else None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ parts
    def _check(self, embeddings: Tensor, labels: Tensor) -> None:
        """The previous call's value checks read, this call's types and shapes checked at once and
        its values started on the device (read at the next call): no host read in a step."""
        self.check_pending()
        head = self.head
        _, pending = check_batch_deferred(
            embeddings, labels, embedding_dim=head.embedding_dim, num_classes=head.num_classes,
            ignore_index=head.ignore_index, ctx=head.ctx, call=self.calls + 1)
        if embeddings.device != head.devices[0] or labels.device != head.devices[0]:
            raise ValueError(f"a captured step takes embeddings and labels on {head.devices[0]}, got them on "
                             f"{embeddings.device} and {labels.device}")
        self._pending = pending
        self.calls += 1

    def _key_of(self, embeddings: Tensor, labels: Tensor) -> tuple:
        """What a captured graph holds fixed: the inputs' shapes and dtypes, the autocast and training
        modes, and the address, shape and dtype of every tensor it reads and writes in place (the
        weights, the optimizer's state and idle clocks, the draw's counters)."""
        autocast = torch.is_autocast_enabled("cuda")
        return (tuple(embeddings.shape), embeddings.dtype, tuple(labels.shape), labels.dtype, autocast,
                torch.get_autocast_dtype("cuda") if autocast else None, self.head.training,
                tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in self._state_tensors()))

    def _state_tensors(self) -> list:
        weights = self.head.shard_weights
        return list(weights) + self.optimizer.graph_tensors(weights) + self.head.draw_tensors()

    def _sampling(self) -> bool:
        return self.head.training and self.head.sample_rate < 1.0

    def _host_marks(self) -> tuple:
        """The host-side counts a step moves, as they are before a replay (see :meth:`_host_follows`)."""
        return self.head.sample_step, self.optimizer.host_marks(self.head.shard_weights)

    def _host_follows(self, marks: tuple) -> None:
        """After a replay: the host's counts where the eager step would have left them (Partial FC's
        step, the idle clocks' lengths, the rounding step), then a full catch-up where one is due."""
        step, opt_marks = marks
        if self._sampling():
            self.head.replayed_draw(step)
        self.optimizer.replayed(self.head.shard_weights, opt_marks)

    def _weights_moved(self) -> bool:
        return tuple(w._version for w in self.head.shard_weights) != self._versions

    def _drop(self) -> None:
        self._graph, self._static, self._key, self._held = None, None, None, []
        self._eager_left = self.eager_steps

    def _run(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        """The step as it runs eagerly and as it is captured: the optimizer's bookkeeping around a
        forward and a backward whose update the optimizer's kernels apply. The values of the inputs
        were checked outside (:meth:`_check`); inside, only what never reads the host."""
        self.optimizer.zero_grad(set_to_none=False)
        x.grad = None  # the step's embedding gradient is made, not added (a replay writes it in place)
        with self.head.value_checks_outside():
            loss = self.head(x, y)
        loss.backward()
        self.optimizer.step()
        return loss, x.grad

    def _eager(self, embeddings: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor]:
        return self._run(embeddings.detach().requires_grad_(True), labels)

    def _stage(self) -> None:
        """This step's numbers (learning rate, ..., Partial FC's step) into the device tensors the
        step reads."""
        self.optimizer.stage_device_scalars()
        if self._sampling():
            self.head.stage_draw_step()

    def _capture(self, embeddings: Tensor, labels: Tensor, key: tuple) -> None:
        x = embeddings.detach().clone().requires_grad_(True)
        y = labels.clone()
        head = self.head
        head.check_pending()  # an earlier forward's own deferred check: read now, not inside the capture
        graph = _Graph(lambda: self._run(x, y))
        self._graph, self._static, self._key = graph, (x, y), key  # the replay that follows notes the versions
        self._held = self._state_tensors()
        self.captures += 1


class _Graph:
    """``body()`` captured as one CUDA graph; ``outputs`` are what it returned, which every
    :meth:`replay` rewrites in place."""

    def __init__(self, body) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = body()

    def replay(self) -> None:
        self.graph.replay()


class _StepLoss(torch.autograd.Function):
    """The replayed step's loss, connected to the embeddings: backward hands them the step's
    gradient (times the incoming one, which must be 1 for the update inside the step to match)."""

    @staticmethod
    def forward(ctx, embeddings: Tensor, loss: Tensor, grad: Tensor) -> Tensor:
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * g, None, None  # g is 0-d (a loss): the product keeps grad's dtype
