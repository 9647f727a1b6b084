"""Where a training step's time goes: :class:`PhaseClock` splits each step into named phases.

A step of the loop runs, in this order (:data:`PHASES`): the **stop agreement**, then per
micro-batch the **loader wait** (the next batch from the loader: with 0 workers its decoding and
augmentation too) and **h2d** (its copy to the device and what runs there: uint8 normalisation,
random erasing), the backbone's **forward**, the **head** (the loss's forward, and its backward down
to the embeddings), the backbone's **backward**; then the **optimizer** (zero_grad, unscaling,
clipping, both optimizers and their schedules) and **logging/metrics** (the step's counters, the
progress bar, and the report at a log point). Checkpoints and evaluations are outside the step, as
in ``--profile``'s ``step_s``. A pipeline step has one **pipeline schedule** phase for its forwards and
backwards. Loader wait and h2d are the data path; forward, head, backward and optimizer are the
bare step (what ``shardfc bench --trainer``'s ceiling runs); the rest is what a step spends
outside both, which should be close to nothing.

:meth:`PhaseClock.lap` ends a phase: the time since the previous lap is that phase's. While the
clock does not record (no ``--profile``; the bench's untimed steps) a lap returns at once: no clock
read, no synchronise. While it records on CUDA every lap first synchronises the device, so that a
phase is charged its kernels' time rather than their launch's; a profiled GPU step is therefore
slower than an unprofiled one, and nothing but ``--profile`` and the bench's breakdown records.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

__all__ = ["BARE_STEP_PHASES", "DATA_PHASES", "OFF", "PHASES", "PhaseClock", "format_phases", "summarize_phases"]

PHASES = ("stop agreement", "loader wait", "h2d", "forward", "head", "backward", "optimizer", "logging/metrics")
#: The data path's phases.
DATA_PHASES = ("loader wait", "h2d")
#: The bare step's phases (``pipeline schedule``: a pipeline step's forwards and backwards).
BARE_STEP_PHASES = ("forward", "head", "backward", "pipeline schedule", "optimizer")


class PhaseClock:
    """Per-step phase times of one process; records only while :attr:`enabled`.

    Args:
        device: the training device (a CUDA one is synchronised at each lap while recording).
        enabled: record the steps from the next :meth:`begin_step` on.
    """

    def __init__(self, device: "torch.device | str", enabled: bool = False) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self.steps: List[Dict[str, float]] = []
        """Seconds per phase of each recorded step, in step order."""
        self._open: Optional[Dict[str, float]] = None
        self._last = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin_step(self) -> None:
        """A step starts now (recorded when :attr:`enabled`)."""
        if not self.enabled:
            self._open = None
            return
        self._sync()
        self._open = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap (or the step's start) to ``phase``."""
        spent = self._open
        if spent is None:
            return
        self._sync()
        now = time.perf_counter()
        spent[phase] = spent.get(phase, 0.0) + now - self._last
        self._last = now

    def lap_on_backward(self, tensor: torch.Tensor, phase: str) -> None:
        """Lap ``phase`` when the backward pass reaches ``tensor``'s gradient (while recording only:
        the hook is not even registered otherwise)."""
        if self._open is not None and tensor.requires_grad:
            tensor.register_hook(lambda grad: self.lap(phase))

    def end_step(self, phase: Optional[str] = None) -> None:
        """Lap ``phase`` (if given) and close the step's record."""
        if self._open is None:
            return
        if phase is not None:
            self.lap(phase)
        self.steps.append(self._open)
        self._open = None

    def drop_step(self) -> None:
        """Forget the open step (one that trained nothing: the run stops before it)."""
        self._open = None


#: The clock of a run that does not profile: never enabled, so every lap is a no-op.
OFF = PhaseClock("cpu")


def summarize_phases(steps: List[Dict[str, float]]) -> Dict[str, object]:
    """Mean milliseconds per step of each phase over ``steps`` (:attr:`PhaseClock.steps`), their
    total, and the share of the step spent outside the data path and the bare step."""
    n = len(steps)
    names = [p for p in PHASES if any(p in s for s in steps)]
    names += sorted({p for s in steps for p in s} - set(names))
    ms = {p: 1e3 * sum(s.get(p, 0.0) for s in steps) / max(n, 1) for p in names}
    total = sum(ms.values())
    outside = sum(v for p, v in ms.items() if p not in DATA_PHASES + BARE_STEP_PHASES)
    return {"steps": n, "ms_per_step": ms, "total_ms": total, "outside_ms": outside,
            "outside_share": outside / total if total > 0 else 0.0}


def format_phases(summary: Dict[str, object], beside: Optional[Dict[str, object]] = None,
                  beside_name: str = "") -> str:
    """A Markdown table of :func:`summarize_phases`'s result: ms per step and % of the step by phase.

    Args:
        summary: the step's phases.
        beside: another step's phases (the bench's ceiling) in a last column, or None.
        beside_name: that column's title.
    """
    total = summary["total_ms"]
    other = beside["ms_per_step"] if beside is not None else None
    head = f"| phase (mean of {summary['steps']} steps) | ms / step | % of the step |"
    rule = "|---|---:|---:|"
    if other is not None:
        head, rule = head + f" {beside_name} ms / step |", rule + "---:|"
    lines = [head, rule]
    names = list(summary["ms_per_step"]) + [p for p in (other or {}) if p not in summary["ms_per_step"]]
    for phase in names:
        ms = summary["ms_per_step"].get(phase, 0.0)
        row = f"| {phase} | {ms:.3f} | {100 * ms / total if total else 0:.1f}% |"
        lines.append(row + (f" {other.get(phase, 0.0):.3f} |" if other is not None else ""))
    lines.append(f"| step | {total:.3f} | 100% |" + (f" {beside['total_ms']:.3f} |" if other is not None else ""))
    outside = f"| outside the data path and the bare step | {summary['outside_ms']:.3f} | " \
              f"{100 * summary['outside_share']:.1f}% |"
    lines.append(outside + (f" {beside['outside_ms']:.3f} |" if other is not None else ""))
    return "\n".join(lines)
