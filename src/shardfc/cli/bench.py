"""``shardfc bench``: compare the head variants on W spawned processes.

Example (CPU, 2 ranks)::

    shardfc bench --world-size 2 --batch 256 --dim 64 --classes 40000 \\
        --variants naive,replicated,sharded,chunked,partial --steps 3 --json out.json --plot out.png

``shardfc bench --recipes`` / ``--split-sweep`` compare whole training recipes instead (DDP, DataParallel,
Horovod, pipeline; see :mod:`shardfc.cli.bench_recipes`); ``shardfc bench --trainer`` measures
``shardfc train``'s step against its ceiling (:mod:`shardfc.tools.bench.trainer`). ``shardfc bench --peers`` puts
the head beside the matmul floor, plain torch, Cut Cross-Entropy and Liger in one process
(:mod:`shardfc.cli.bench_peers`).

Prints a Markdown table on stdout and progress on stderr. ``--json`` writes a list with one object
per variant holding exactly ``variant, step_time_s, peak_bytes_per_rank, balance,
comm_bytes_per_rank, floor_ratio`` (definitions: :mod:`shardfc.tools.bench.runner`). Every variant keeps
its gradients between steps (``zero_grad(set_to_none=False)``): ``peak_bytes_per_rank`` is the
step's peak above the resting state = weights + gradients + optimizer state, measured after warm-up.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from shardfc.checks import chunk_size_arg
from shardfc.outputs import check_outputs
from shardfc.parallel.launch import WorkerError
from shardfc.tools.bench import report
from shardfc.tools.bench.runner import DEFAULT_CHUNK_SIZE, DEFAULT_SAMPLE_RATE, VARIANTS, run_bench


def build_parser() -> argparse.ArgumentParser:
    from shardfc.head.margins import MARGINS

    p = argparse.ArgumentParser(
        prog="shardfc bench",
        description="Measure step time, per-rank peak memory, traffic and matmul-floor ratio of the head variants "
        "(shardfc bench --recipes --help: compare whole training recipes; shardfc bench --peers --help: the head "
        "beside plain torch, Cut Cross-Entropy and Liger on one GPU). "
        "Gradients stay allocated between steps (zero_grad(set_to_none=False)); peak memory is the step's peak "
        "above the resting state = weights + gradients + optimizer state, measured after warm-up.",
    )
    p.add_argument("--world-size", type=int, required=True, help="processes to spawn (ranks)")
    p.add_argument("--batch", type=int, required=True, help="GLOBAL batch, split over the ranks")
    p.add_argument("--dim", type=int, required=True, help="embedding width D")
    p.add_argument("--classes", type=int, required=True, help="number of classes C")
    p.add_argument(
        "--variants",
        default="sharded,chunked",
        help=f"comma-separated, from {','.join(VARIANTS)} (default: sharded,chunked)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--sample-rate", type=float, default=None,
                   help=f"Partial FC rate r of the partial variants (default {DEFAULT_SAMPLE_RATE})")
    p.add_argument(
        "--chunk-size",
        type=chunk_size_arg,
        default=None,
        help=f"classes per chunk of the chunked variant, or 'auto' (the head's own choice) (default {DEFAULT_CHUNK_SIZE})",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weights (and their optimizer state) and embeddings dtype")
    p.add_argument("--sparse-grad", action="store_true",
                   help="partial variant: row-sparse weight gradient (the sampled rows only, no [n_local, D] .grad)")
    p.add_argument("--margin", choices=sorted(MARGINS), default="arcface", help="margin (default arcface, s=64 m=0.5)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: memory per rank and step time per variant")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--peers" in argv:  # the head beside its peers in one process: options of its own
        from shardfc.cli import bench_peers as peers_cli

        return peers_cli.main(argv)
    if "--trainer" in argv:  # the trainer against its ceiling; the other arguments are `shardfc train` flags
        from shardfc.tools.bench import trainer

        return trainer.main(argv)
    if "--recipes" in argv or "--split-sweep" in argv:  # the training-recipe comparison has its own options
        from shardfc.cli import bench_recipes as recipes_cli

        return recipes_cli.main(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return int(e.code or 0)
    details: dict = {}
    try:
        check_outputs(json=args.json, plot=args.plot)  # before the run, not after it
        results = run_bench(
            world_size=args.world_size,
            batch=args.batch,
            dim=args.dim,
            classes=args.classes,
            variants=args.variants,
            steps=args.steps,
            warmup=args.warmup,
            sample_rate=args.sample_rate,
            chunk_size=args.chunk_size,
            dtype=args.dtype,
            margin=args.margin,
            backend=args.backend,
            progress=not args.quiet,
            details=details,
            sparse_grad=args.sparse_grad,
        )
    except WorkerError:
        raise  # a rank's crash: its traceback matters more than one line
    except (ValueError, RuntimeError) as e:
        print(f"shardfc bench: error: {e}", file=sys.stderr)
        return 2
    print(report.markdown_table(results, details))
    if args.json:
        report.write_json(results, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        report.plot(results, args.plot, details)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
