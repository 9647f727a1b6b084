"""``bench --peers`` output: a Markdown table, one JSON object, a two-panel PNG (step ms, extra memory)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional

from shardfc.head.margins import build_margin
from shardfc.outputs import write_atomically
from shardfc.tools.bench.peers import ROW_FIELDS
from shardfc.tools.bench.recipes_report import pyplot, save_png
from shardfc.tools.bench.report import MEASURES

#: bar colour per row group
COLOURS = {"floor": "tab:gray", "margin": "tab:blue", "softmax": "tab:orange"}


def human_bytes(n: Optional[float]) -> str:
    """``n`` bytes as GiB (from 1 GiB), MiB (from 1 MiB) or KiB; ``—`` for None."""
    if n is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n / 2**10:,.1f} KiB"


def header(result: Dict[str, Any]) -> List[str]:
    """The lines above the table: what ran where, the workload, the measures."""
    env, wl = result["environment"], result["workload"]
    compute = "fp32 (no autocast)" if wl["dtype"] == "float32" else f"{wl['dtype']} autocast"
    interpret = ", TRITON_INTERPRET=1" if env.get("triton_interpret") else ""
    return [
        f"device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}{interpret}",
        f"workload (one rank's): B={wl['batch']} D={wl['dim']} C={wl['classes']:,}, {build_margin(wl['margin'])}, "
        f"{compute} compute, fp32 centres, SGD momentum 0.9 wd 5e-4; Partial FC r={wl['sample_rate']}, "
        f"chunk_size={wl['chunk_size']}",
        f"step ms: median of {wl['steps']} steps after a check step and {wl['warmup']} warm-up, synchronised; "
        f"extra memory: {MEASURES.get(result['memory_measure'], result['memory_measure'])}",
        f"loss: the first step's, against shardfc.reference_loss on the same inputs and centres "
        f"(relative error; agrees within {result['loss_rtol']:g})",
    ]


def _loss_cell(r: Dict[str, Any]) -> str:
    if r["loss"] is None:
        return "—"
    if r["reference_loss"] is None:
        return f"{r['loss']:.5g}"
    mark = "" if r["loss_agrees"] else " **disagrees**"
    return f"{r['loss']:.5g} ({r['loss_rel_err']:.1e}){mark}"


def markdown_table(result: Dict[str, Any]) -> str:
    """The rows as a Markdown table; a row that did not run keeps its place with its reason."""
    lines = header(result) + [""]
    lines.append("| system | step ms | × floor | extra memory | loss (rel. err.) | note |")
    lines.append("|---|---:|---:|---:|---:|---|")
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | — | — | — | — | {r['status']}: {r['reason']} |")
            continue
        ratio = "—" if r["ratio_to_floor"] is None else f"{r['ratio_to_floor']:.2f}"
        lines.append(f"| {r['label']} | {r['step_time_ms']:.3f} | {ratio} | {human_bytes(r['extra_memory_bytes'])} | "
                     f"{_loss_cell(r)} | {r['note']} |")
    return "\n".join(lines)


def write_json(result: Dict[str, Any], path: str) -> None:
    """One object: ``workload``, ``environment``, ``memory_measure``, ``loss_rtol``, ``references``
    and ``rows`` (each with exactly :data:`~shardfc.tools.bench.peers.ROW_FIELDS`)."""
    doc = {k: result[k] for k in ("workload", "environment", "memory_measure", "loss_rtol", "references")}
    doc["rows"] = [{k: r[k] for k in ROW_FIELDS} for r in result["rows"]]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(Path(path), lambda scratch: scratch.write_text(json.dumps(doc, indent=2) + "\n"))


def plot(result: Dict[str, Any], path: str) -> None:
    """Two panels, one bar per row: step ms (with the ratio to the floor) and extra memory.
    A row that did not run keeps its place, marked 'n/a'."""
    plt = pyplot()
    rows = result["rows"]
    labels = ["\n".join(textwrap.wrap(r["label"], 14)) for r in rows]
    xs = list(range(len(rows)))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.15 * len(rows)), 8.5), sharex=True)
    panels = (
        ("step (ms)", lambda r: r["step_time_ms"]),
        ("extra memory (MiB)", lambda r: None if r["extra_memory_bytes"] is None else r["extra_memory_bytes"] / 2**20),
    )
    for ax, (title, value) in zip(axes, panels):
        for x, r in zip(xs, rows):
            v = value(r) if r["status"] == "ok" else None
            if v is None:
                ax.annotate("n/a", (x, 0.01), xycoords=("data", "axes fraction"), ha="center", va="bottom",
                            fontsize="small", color="gray")
                continue
            ax.bar(x, v, color=COLOURS.get(r["group"], "tab:green"))
            if ax is axes[0] and r["ratio_to_floor"] is not None:
                ax.annotate(f"{v:.3g}\n{r['ratio_to_floor']:.2f}×", (x, v), ha="center", va="bottom",
                            fontsize="x-small", xytext=(0, 2), textcoords="offset points")
        ax.set_ylabel(title, fontsize="small")
        ax.margins(y=0.2)
        shown = [v for r in rows if r["status"] == "ok" and (v := value(r))]
        if shown and max(shown) > 30 * min(shown):  # one slow row would flatten the others (Liger at 1M)
            ax.set_yscale("log")
            ax.set_ylabel(title + ", log scale", fontsize="small")
    axes[1].set_xticks(xs, labels, fontsize="x-small")
    from matplotlib.patches import Patch

    axes[0].legend(handles=[Patch(color=c, label=g) for g, c in COLOURS.items()], fontsize="small")
    fig.suptitle("\n".join(textwrap.fill(h, 140) for h in header(result)[:2]), fontsize="x-small")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


__all__ = ["header", "human_bytes", "markdown_table", "plot", "write_json"]
