"""``bench --recipes`` / ``--split-sweep`` output: Markdown tables, one JSON object, two PNGs."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from shardfc.outputs import write_atomically
from shardfc.parallel.split_bench import FIELDS as SPLIT_FIELDS
from shardfc.tools.bench.recipes import ROW_FIELDS

#: What ``comm_bytes_per_step`` leaves out, by strategy, when ``comm_counted`` is False.
UNCOUNTED = {
    "dp": "DataParallel copies not counted",
}


def _mib(n: Optional[float]) -> str:
    return "—" if n is None else f"{n / 2**20:,.0f}"


def _header(meta: Dict[str, Any]) -> List[str]:
    lines = []
    w = meta.get("workload")
    if w:
        lines.append(
            f"workload: {w['backbone']} at {w['image_size'][0]}x{w['image_size'][1]}, {w['batch_size']} images per "
            f"process per step, {w['classes']:,} classes, D={w['embedding_dim']}, {w['steps']} timed steps "
            f"(+{w['warmup']} warm-up), seed {w['seed']}, synthetic data, {w['threads']} thread(s) per process"
        )
    if meta.get("devices_note"):
        lines.append(meta["devices_note"])
    load = meta.get("load_average")
    if load:
        lines.append(f"load average (1, 5, 15 min) before: {load['before']}, after: {load['after']}")
    return lines


def recipes_table(rows: Sequence[Dict[str, Any]], meta: Optional[Dict[str, Any]] = None) -> str:
    """The recipe rows as a Markdown table (memory in MiB per process); unavailable rows keep their reason."""
    lines = _header(meta or {})
    if lines:
        lines.append("")
    lines.append("| recipe | launcher | precision | processes | time per step (s) | samples/s | "
                 "peak RSS MiB per process | comm bytes per step per process | note |")
    lines.append("|---|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if r["status"] != "ok":
            procs = "—" if r["processes"] is None else r["processes"]
            lines.append(f"| {r['recipe']} | {r['launcher']} | {r['precision']} | {procs} | — | — | — | — | "
                         f"{r['status']}: {r['reason']} |")
            continue
        rss = " / ".join(_mib(b) for b in r["peak_rss_bytes_per_process"])
        if r["cuda_peak_bytes_per_process"]:
            rss += " (CUDA " + " / ".join(_mib(b) for b in r["cuda_peak_bytes_per_process"]) + ")"
        comm = " / ".join(f"{b:,}" for b in r["comm_bytes_per_step_per_process"])
        comm += "" if r["comm_counted"] else f" ({UNCOUNTED.get(r['strategy'], 'partly counted')})"
        if r["stage_bytes_per_step_per_process"] is not None:
            comm += " (stage to stage: " + " / ".join(f"{b:,}" for b in r["stage_bytes_per_step_per_process"]) + ")"
        lines.append(
            f"| {r['recipe']} | {r['launcher']} | {r['precision']} | {r['processes']} | "
            f"{r['step_time_s']:.3f} ± {r['step_time_std_s']:.3f} | {r['samples_per_s']:.1f} | {rss} | {comm} | |"
        )
    return "\n".join(lines)


def split_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The split-size sweep as a Markdown table: mean ± std of the step time per configuration."""
    import statistics

    lines = ["| configuration | split_size | mean step (s) | std (s) | median (s) | samples/s |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        std = statistics.pstdev(r["times_s"])
        size = "—" if r["split_size"] is None else r["split_size"]
        lines.append(f"| {r['config']} | {size} | {r['mean_s']:.4f} | {std:.4f} | {r['median_s']:.4f} | {r['samples_per_s']:.1f} |")
    return "\n".join(lines)


def write_json(path: str, meta: Dict[str, Any], rows: Optional[Sequence[Dict[str, Any]]], split: Optional[Sequence[Dict[str, Any]]]) -> None:
    """One object: ``workload``, ``devices_note``, ``load_average``, ``recipes`` (rows with exactly
    :data:`ROW_FIELDS`, or null) and ``split_sweep`` (rows with the split bench's FIELDS, or null)."""
    doc = {
        "workload": meta.get("workload"),
        "devices_note": meta.get("devices_note"),
        "load_average": meta.get("load_average"),
        "recipes": None if rows is None else [{k: r[k] for k in ROW_FIELDS} for r in rows],
        "split_sweep": None if split is None else [{k: r[k] for k in SPLIT_FIELDS} for r in split],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(Path(path), lambda scratch: scratch.write_text(json.dumps(doc, indent=2) + "\n"))


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(Path(path), lambda scratch: fig.savefig(scratch, format="png", dpi=110))


def plot_recipes(rows: Sequence[Dict[str, Any]], path: str, meta: Optional[Dict[str, Any]] = None) -> None:
    """Three panels, one above the other, one bar per row: time per step (± std), peak RSS per process, comm bytes per step.
    A row that did not run keeps its place, marked 'n/a'."""
    plt = pyplot()
    labels = [f"{r['recipe']}\n{r['precision']}" for r in rows]
    xs = range(len(rows))
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 0.9 * len(rows)), 11), sharex=True)
    panels = (
        ("time per step (s)", lambda r: r["step_time_s"], lambda r: r["step_time_std_s"]),
        ("peak RSS per process, largest (MiB)", lambda r: max(r["peak_rss_bytes_per_process"]) / 2**20, None),
        ("bytes communicated per step (MiB)", lambda r: r["comm_bytes_per_step"] / 2**20, None),
    )
    for ax, (title, value, err) in zip(axes, panels):
        for x, r in zip(xs, rows):
            color = "tab:blue" if r["precision"] == "fp32" else "tab:orange"
            if r["status"] == "ok":
                ax.bar(x, value(r), yerr=err(r) if err else None, color=color, capsize=3)
                if err:
                    ax.annotate(f"{r['samples_per_s']:.1f} samples/s", (x, value(r) + err(r)), ha="center",
                                va="bottom", fontsize="x-small", xytext=(0, 3), textcoords="offset points")
            else:
                ax.annotate("n/a", (x, 0), ha="center", va="bottom", fontsize="small", color="gray")
        ax.set_xticks(list(xs), labels, fontsize="x-small")
        ax.set_ylabel(title, fontsize="small")
        ax.margins(y=0.15)
    from matplotlib.patches import Patch

    axes[0].legend(handles=[Patch(color="tab:blue", label="fp32"), Patch(color="tab:orange", label="mixed precision")],
                   fontsize="small")
    head = _header(meta or {})
    if head:
        fig.suptitle("\n".join(textwrap.fill(h, 150) for h in head), fontsize="x-small")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def plot_split_sweep(rows: Sequence[Dict[str, Any]], path: str, note: str = "") -> None:
    """Mean step time with std error bars against split_size (pipelined), with the unsplit and
    split-without-pipelining times as horizontal bands, as in PyTorch's model-parallel tutorial."""
    import statistics

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    piped = [r for r in rows if r["config"] == "pipelined"]
    if piped:
        sizes = [r["split_size"] for r in piped]
        ax.errorbar(sizes, [r["mean_s"] for r in piped], yerr=[statistics.pstdev(r["times_s"]) for r in piped],
                    marker="o", capsize=4, label="pipelined (split + micro-batches)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
    for r, color in zip([r for r in rows if r["config"] != "pipelined"], ("tab:green", "tab:red")):
        mean, std = r["mean_s"], statistics.pstdev(r["times_s"])
        ax.axhline(mean, color=color, label=f"{r['config']} ({mean:.3f} s)")
        ax.axhspan(mean - std, mean + std, color=color, alpha=0.15)
    ax.set_xlabel("split_size (rows per micro-batch)")
    ax.set_ylabel("forward + backward, mean over steps (s)")
    first = rows[0]
    ax.set_title(f"{first['model']} {first['image_size'][0]}x{first['image_size'][1]}, batch {first['batch']}, "
                 f"{first['steps']} steps" + (f"\n{note}" if note else ""), fontsize="small")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


__all__ = ["plot_recipes", "plot_split_sweep", "recipes_table", "split_table", "write_json"]
