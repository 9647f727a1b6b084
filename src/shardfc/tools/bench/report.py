"""Bench output: a Markdown table, the JSON list of results, a two-panel PNG."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from shardfc.outputs import write_atomically
from shardfc.tools.bench.runner import FIELDS

#: what ``peak_bytes_per_rank`` counts, by measure (see :mod:`shardfc.tools.bench.memory`)
MEASURES = {
    "cpu_live_tensors": "peak bytes of the tensors the step's operators create and still hold, "
    "counted by a dispatch mode (operators' internal scratch not included)",
    "cuda_max_allocated": "CUDA max_memory_allocated − memory_allocated before the step",
}


#: what the measured peaks are above (the bench keeps gradients between steps)
RESTING = "resting state = weights + gradients + optimizer state, measured after warm-up"


def _mib(n: Optional[float]) -> str:
    return "—" if n is None else f"{n / 2**20:,.1f}"


def _num(x: Optional[float], fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def markdown_table(results: Sequence[Dict[str, Any]], details: Optional[Dict[str, Any]] = None) -> str:
    """The results as a Markdown table (peak memory in MiB, per rank), with a line on the measure."""
    lines = []
    if details:
        measure = details.get("memory_measure")
        cfg = details.get("config", {})
        if cfg:
            lines.append(
                f"W={cfg['world_size']} B={cfg['batch']} (local {details.get('sizes')}) D={cfg['dim']} "
                f"C={cfg['classes']:,} dtype={cfg['dtype']} margin={cfg['margin']} "
                f"chunk_size={cfg['chunk_size']} sample_rate={cfg['sample_rate']}"
                f"{' (sparse gradient)' if cfg.get('sparse_grad') else ''} "
                f"steps={cfg['steps']} (+{cfg['warmup']} warm-up), backend={details.get('backend')}"
            )
        if measure:
            lines.append(f"memory measure: {measure} — {MEASURES.get(measure, measure)}")
            lines.append(f"peak = the step's peak above the {RESTING}")
        lines.append("")
    lines.append("| variant | step time (s) | peak MiB per rank | balance | comm bytes per rank | floor ratio |")
    lines.append("|---|---:|---:|---:|---:|---:|")
    for r in results:
        peaks = " / ".join(_mib(p) for p in r["peak_bytes_per_rank"])
        lines.append(
            f"| {r['variant']} | {r['step_time_s']:.4f} | {peaks} | {_num(r['balance'], '.3f')} | "
            f"{r['comm_bytes_per_rank']:,} | {_num(r['floor_ratio'], '.2f')} |"
        )
    return "\n".join(lines)


def write_json(results: Sequence[Dict[str, Any]], path: str) -> None:
    """``results`` as a JSON list of objects with exactly the fields of :data:`FIELDS`.

    ``peak_bytes_per_rank`` is each rank's step peak above the resting state = weights + gradients
    + optimizer state, measured after warm-up (gradients are kept between steps), counted as
    :data:`MEASURES` says for the run's measure."""
    clean = [{k: r[k] for k in FIELDS} for r in results]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(Path(path), lambda scratch: scratch.write_text(json.dumps(clean, indent=2) + "\n"))


def plot(results: Sequence[Dict[str, Any]], path: str, details: Optional[Dict[str, Any]] = None) -> None:
    """PNG with two panels: peak memory per rank per variant, and step time per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in results]
    world = max(len(r["peak_bytes_per_rank"]) for r in results)
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / world
    peaks_all: List[float] = []
    for rank in range(world):
        xs, ys = [], []
        for i, r in enumerate(results):
            if rank < len(r["peak_bytes_per_rank"]):
                xs.append(i - 0.4 + width * (rank + 0.5))
                ys.append(r["peak_bytes_per_rank"][rank] / 2**20)
        peaks_all += ys
        ax_mem.bar(xs, ys, width=width, label=f"rank {rank}")
    positive = [p for p in peaks_all if p > 0]
    if positive and max(positive) / min(positive) > 50:
        ax_mem.set_yscale("log")
    ax_mem.set_xticks(range(len(names)), names)
    ax_mem.set_ylabel("step peak per rank (MiB)")
    measure = (details or {}).get("memory_measure")
    ax_mem.set_title(
        "step peak above weights + grads + optimizer state" + (f"\n[{measure}]" if measure else ""), fontsize="medium"
    )
    if world <= 8:
        ax_mem.legend(fontsize="small")

    times = [r["step_time_s"] for r in results]
    bars = ax_time.bar(range(len(names)), times, color="tab:gray")
    for bar, r in zip(bars, results):
        if r.get("floor_ratio") is not None:
            ax_time.annotate(
                f"{r['step_time_s']:.3g} s\n{r['floor_ratio']:.2f}× floor",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize="small",
            )
    ax_time.set_xticks(range(len(names)), names)
    ax_time.set_ylabel("step time (s, median of slowest rank)")
    ax_time.set_title("step time per variant")
    ax_time.margins(y=0.2)
    cfg = (details or {}).get("config")
    if cfg:
        fig.suptitle(
            f"W={cfg['world_size']} B={cfg['batch']} D={cfg['dim']} C={cfg['classes']:,} {cfg['dtype']} "
            f"(chunk {cfg['chunk_size']}, sample rate {cfg['sample_rate']}, backend {details.get('backend')})"
        )
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    write_atomically(Path(path), lambda scratch: fig.savefig(scratch, format="png", dpi=110))
    plt.close(fig)


__all__ = ["MEASURES", "RESTING", "markdown_table", "plot", "write_json"]
