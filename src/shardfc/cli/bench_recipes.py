"""``shardfc bench --recipes`` and ``shardfc bench --split-sweep``.

``--recipes``: the same training workload under each multi-device recipe of
:data:`~shardfc.tools.bench.recipes.RECIPES` (DDP by torchrun, DDP by spawn, DataParallel,
Horovod, the pipeline), each in fp32 and mixed precision, as real ``shardfc train`` runs
(:mod:`~shardfc.tools.bench.recipes`)::

    shardfc bench --recipes --nproc 2 --backbone resnet50 --image-size 32 32 --batch-size 16 \\
        --steps 8 --json recipes.json --plot recipes.png

``--split-sweep``: the model-parallel tutorial's experiment on the same backbone: one device vs
split over two vs pipelined, for each ``--split-sizes`` (:func:`shardfc.parallel.split_bench.time_split_sweep`),
in this process; ``--split-plot`` draws mean step time with std error bars against split_size.

Both print Markdown tables on stdout, progress on stderr; ``--json`` writes one object
(:func:`~shardfc.tools.bench.recipes_report.write_json`). On a machine without CUDA the
"devices" are processes sharing the CPU (recipes) or the CPU device twice in one process (split
sweep); the output says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import List, Optional

from shardfc.outputs import check_outputs
from shardfc.tools.bench import recipes_report as report
from shardfc.tools.bench.recipes import RECIPES, Workload, check_workload, parse_precisions, parse_recipes, run_recipes


def build_parser() -> argparse.ArgumentParser:
    d = Workload()
    p = argparse.ArgumentParser(
        prog="shardfc bench --recipes",
        description="Compare multi-device recipes (DDP by torchrun / by spawn, DataParallel, Horovod, pipeline; "
        "fp32 and mixed precision) on one training workload, and/or sweep the pipeline's split_size.",
    )
    p.add_argument("--recipes", action="store_true", help="run the recipe comparison")
    p.add_argument("--split-sweep", action="store_true", help="run the single / split / pipelined sweep over --split-sizes")
    p.add_argument("--only", metavar="NAMES", help=f"comma-separated recipes, from {','.join(RECIPES)} (default: all)")
    p.add_argument("--precisions", default=None, help="fp32, amp or both (default fp32,amp); amp is fp16 on CUDA, bf16 on the CPU")
    p.add_argument("--nproc", type=int, default=d.nproc, help=f"processes (ranks) per recipe (default {d.nproc})")
    p.add_argument("--backbone", default=d.backbone, help=f"backbone of the workload (default {d.backbone})")
    p.add_argument("--image-size", type=int, nargs=2, default=list(d.image_size), metavar=("H", "W"),
                   help=f"input size (default {d.image_size[0]} {d.image_size[1]})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"images per process per step (default {d.batch_size})")
    p.add_argument("--classes", type=int, default=d.classes, help=f"synthetic identities (default {d.classes})")
    p.add_argument("--embedding-dim", type=int, default=d.embedding_dim, help=f"embedding width (default {d.embedding_dim})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"timed steps (default {d.steps})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"untimed steps first (default {d.warmup})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the model, data and order (default 0)")
    p.add_argument("--threads", type=int, default=None, help="OMP threads per process (default: CPU cores // nproc, at least 1)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device of the runs (default auto)")
    p.add_argument("--work-dir", default="shardfc_runs/bench-recipes", help="run folders and logs (default shardfc_runs/bench-recipes)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a recipe's run is killed (default 600)")
    p.add_argument("--split-sizes", default=None, help="split sizes of the sweep (default 2,4,8,16)")
    p.add_argument("--split-batch", type=int, default=None, help="rows per step of the sweep (default: batch-size x nproc)")
    p.add_argument("--json", metavar="PATH", help="write everything as one JSON object")
    p.add_argument("--plot", metavar="PATH", help="PNG of the recipes: time per step, peak memory, traffic")
    p.add_argument("--split-plot", metavar="PATH", help="PNG of the sweep: mean step time ± std vs split_size")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def devices_note(device: str, nproc: int) -> str:
    import torch

    cuda = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    if cuda:
        return f"devices: {cuda} CUDA device(s) ({torch.cuda.get_device_name(0)}); one per process for DDP/Horovod"
    return (f"devices: none but the CPU ({os.cpu_count()} core(s)): each recipe's 'devices' are {nproc} processes sharing "
            "it (gloo), DataParallel needs >= 2 CUDA devices, and the split sweep's two stages are the CPU device "
            "twice in one process, so nothing overlaps")


def _sweep(args, threads: int) -> list:
    import torch

    from shardfc.parallel.split_bench import time_split_sweep

    cuda = torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 0
    devices = ["cuda:0", "cuda:1"] if cuda >= 2 else (["cuda:0", "cuda:0"] if cuda else ["cpu", "cpu"])
    try:
        sizes = [int(s) for s in (args.split_sizes or "2,4,8,16").split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--split-sizes must be comma-separated integers, got {args.split_sizes!r}") from None
    batch = args.split_batch if args.split_batch is not None else args.batch_size * args.nproc
    # One process's share of the CPU, as each recipe's process gets: on a loaded machine more OpenMP
    # threads than free cores wait on each other at every barrier and time nothing useful.
    torch.set_num_threads(threads)
    if not args.quiet:
        print(f"[bench --split-sweep] {args.backbone} batch {batch} on {devices}, split sizes {sizes} ...", file=sys.stderr, flush=True)
    return time_split_sweep(args.backbone, batch, tuple(args.image_size), devices, sizes, args.steps,
                            warmup=args.warmup, embedding_dim=args.embedding_dim, seed=args.seed)


#: The options only one of the two comparisons reads: given without it, each would be dropped silently.
_RECIPES_ONLY = ("only", "precisions", "plot")
_SWEEP_ONLY = ("split_sizes", "split_batch", "split_plot")


def _unread_options(args) -> Optional[str]:
    """Why an option given is read by neither comparison asked for (None: every one is read)."""
    for names, needed, flag in ((_RECIPES_ONLY, args.recipes, "--recipes"), (_SWEEP_ONLY, args.split_sweep, "--split-sweep")):
        for name in names:
            if getattr(args, name) is not None and not needed:
                return f"--{name.replace('_', '-')} applies to {flag}, which was not asked for"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if not (args.recipes or args.split_sweep):
        print("shardfc bench: error: give --recipes and/or --split-sweep", file=sys.stderr)
        return 2
    unread = _unread_options(args)
    if unread:
        print(f"shardfc bench: error: {unread}", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"shardfc bench: error: threads must be a positive integer, got {args.threads}", file=sys.stderr)
        return 2
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 1) // max(args.nproc, 1))
    work = Workload(args.nproc, args.backbone, tuple(args.image_size), args.batch_size, args.classes,
                    args.embedding_dim, args.steps, args.warmup, args.seed, threads, args.device)
    meta = {"workload": dataclasses.asdict(work), "devices_note": devices_note(args.device, args.nproc)}
    before = [round(x, 2) for x in os.getloadavg()]
    rows = split = None
    try:
        check_outputs(json=args.json, plot=args.plot, split_plot=args.split_plot)  # before the runs, not after them
        if not 0 < args.timeout < float("inf"):  # NaN too: it would wait forever
            raise ValueError(f"timeout must be a finite number > 0 of seconds, got {args.timeout!r}")
        if args.split_batch is not None and args.split_batch < 1:
            raise ValueError(f"--split-batch must be a positive integer, got {args.split_batch}")
        if args.split_sweep:  # the sweep trains the workload too: refused before either comparison runs
            check_workload(work, Path(args.work_dir))  # (run_recipes checks it itself)
        if args.recipes:
            names = parse_recipes(args.only)
            rows = run_recipes(names, parse_precisions(args.precisions or "fp32,amp"), work, Path(args.work_dir), args.timeout,
                               not args.quiet)
        if args.split_sweep:
            split = _sweep(args, threads)
    except ValueError as e:
        print(f"shardfc bench: error: {e}", file=sys.stderr)
        return 2
    meta["load_average"] = {"before": before, "after": [round(x, 2) for x in os.getloadavg()]}
    if rows is not None:
        print(report.recipes_table(rows, meta))
    if split is not None:
        if rows is None:
            print(meta["devices_note"])
        print("\nsplit sweep: one device vs split over two vs pipelined (forward + backward per step)\n")
        print(report.split_table(split))
    if args.json:
        report.write_json(args.json, meta, rows, split)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and rows is not None:
        report.plot_recipes(rows, args.plot, meta)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.split_plot and split is not None:
        report.plot_split_sweep(split, args.split_plot, "CPU: both stages on one device, nothing overlaps" if split[0]["devices"][0] == "cpu" else "")
        print(f"wrote {args.split_plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
