"""``shardfc eval``: evaluate a checkpoint's backbone on verification pairs, IJB-B/C or a re-ID split.

With no target flag, the targets of the run that saved the checkpoint are used (its val_bins,
reid_root, and held-out synthetic pairs for a synthetic run). On a terminal, each target shows a
progress bar over its batches.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from shardfc import checkpoint as ckpt
from shardfc.evaluation.far import why_undefined
from shardfc.evaluation.folds import NFOLDS
from shardfc.outputs import check_folder
from shardfc.train.checkpointing.artifacts import add_checkpoint_args, load_backbone, pick_device
from shardfc.train.config import ConfigError
from shardfc.train.observe.evaluate import IJBOptions, build_targets, run_targets
from shardfc.train.observe.runlog import NOT_AVAILABLE, format_metrics

__all__ = ["main", "json_report"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardfc eval", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_checkpoint_args(p)
    p.add_argument("--bin", nargs="+", default=None, metavar="FILE", help="insightface verification .bin files")
    p.add_argument("--reid-root", default=None, metavar="DIR", help="re-ID dataset root with query/gallery splits")
    p.add_argument("--ijb", default=None, metavar="ROOT",
                   help="IJB-B/IJB-C release folder (meta/ and loose_crop/): 1:1 template verification, TAR at FAR 1e-6..1e-1")
    p.add_argument("--ijb-target", choices=("IJBC", "IJBB"), default=None, help="which IJB protocol (default: IJBC)")
    p.add_argument("--ijb-out", default=None, metavar="DIR", help="write the IJB pair scores, ROC CSV and ROC plot here")
    p.add_argument("--ijb-norm-score", action=argparse.BooleanOptionalAction, default=None,
                   help="keep each face feature's norm as its weight in the template (insightface's default; "
                        "--no-ijb-norm-score normalises faces first)")
    p.add_argument("--ijb-detector-score", action=argparse.BooleanOptionalAction, default=None,
                   help="weight each face feature by its detector score (insightface's default)")
    p.add_argument("--workers", type=int, default=None, help="DataLoader processes decoding and aligning IJB faces (default: 0)")
    p.add_argument("--synthetic-pairs", type=int, default=None, metavar="N",
                   help="held-out synthetic pairs of unseen identities (for a synthetic run; 0: none)")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default: 256)")
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=True,
                   help="add the mirrored image's embedding (default: on)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none", help="autocast dtype (default: none)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    return p


#: The options only ``--ijb`` reads: ``(flag, attribute)``.
IJB_ONLY = (("--ijb-target", "ijb_target"), ("--ijb-out", "ijb_out"), ("--ijb-norm-score/--no-ijb-norm-score", "ijb_norm_score"),
            ("--ijb-detector-score/--no-ijb-detector-score", "ijb_detector_score"), ("--workers", "workers"))


def json_report(checkpoint: str, metrics: Dict[str, Dict[str, float]]) -> str:
    """Strict JSON of the metrics: an undefined value (NaN, infinity) is ``null``, and
    ``undefined[target][metric]`` says why (JSON has no NaN; most parsers reject it)."""
    clean: Dict[str, Dict[str, Any]] = {}
    undefined: Dict[str, Dict[str, str]] = {}
    for target, values in metrics.items():
        clean[target] = {}
        for name, value in values.items():
            if isinstance(value, float) and not math.isfinite(value):
                clean[target][name] = None
                undefined.setdefault(target, {})[name] = why_undefined(name, values)
            else:
                clean[target][name] = value
    return json.dumps({"checkpoint": checkpoint, "metrics": clean, "undefined": undefined}, indent=2, allow_nan=False)


def _ijb_table(values) -> str:
    """``TAR@FAR 1e-6 n/a | 1e-5 ... | 1e-1 99.01%`` (insightface's nearest-ROC-point figures; ``n/a``
    where there are fewer than ``1/FAR`` impostor pairs)."""
    cells = [
        f"{k.split('=')[1]} {100 * v:.2f}%" if math.isfinite(v) else f"{k.split('=')[1]} {NOT_AVAILABLE}"
        for k, v in values.items() if k.startswith("tar@far=")
    ]
    table = "TAR@FAR " + " | ".join(cells) + f", AUC {100 * values['auc']:.2f}%"
    if any(not math.isfinite(v) for k, v in values.items() if k.startswith("tar@far=")):
        table += f" (n/a: fewer impostor pairs than 1/FAR; {int(values.get('num_negative_pairs', 0))} here)"
    return table


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)  # None: sys.argv[1:], as argparse reads it
    try:
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.synthetic_pairs is not None and (args.synthetic_pairs < 0 or 0 < args.synthetic_pairs < NFOLDS):
            raise ConfigError(f"--synthetic-pairs must be 0 (none) or at least {NFOLDS} (the verification protocol's "
                              f"folds), got {args.synthetic_pairs}")
        if args.ijb is None:  # each would be dropped silently
            given = [flag for flag, value in IJB_ONLY if getattr(args, value) is not None]
            if given:
                raise ConfigError(f"{given[0]} applies to --ijb ROOT, which was not given")
        if args.workers is not None and args.workers < 0:
            raise ConfigError(f"--workers must be >= 0, got {args.workers}")
        if args.ijb_out is not None:  # before the IJB run (minutes to hours), not when its report is written
            check_folder("--ijb-out", Path(args.ijb_out))
        device = pick_device(args.device)
        trained = load_backbone(args.checkpoint, device, trust_pickle=args.trust_checkpoint)
        cfg = dataclasses.replace(trained.config, eval_batch_size=args.batch_size, eval_flip=args.flip)
        explicit = (
            args.bin is not None or args.reid_root is not None or args.synthetic_pairs is not None or args.ijb is not None
        )
        ijb = None
        if args.ijb is not None:
            ijb = IJBOptions(
                args.ijb, args.ijb_target or "IJBC", args.ijb_out, args.ijb_norm_score is not False,
                args.ijb_detector_score is not False, args.workers or 0,
            )
        dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
        autocast = contextlib.nullcontext if dtype is None else (lambda: torch.autocast(device.type, dtype=dtype))
        targets = build_targets(
            cfg, trained.image_size, device, autocast,
            bins=args.bin or ([] if explicit else None),
            reid_root=args.reid_root or ("" if explicit else None),
            synthetic_pairs=args.synthetic_pairs if args.synthetic_pairs is not None else (0 if explicit else None),
            ijb=ijb,
        )
        if not targets:
            raise ConfigError("nothing to evaluate: pass --bin FILE..., --ijb ROOT, --reid-root DIR or --synthetic-pairs N")
        metrics = run_targets(targets, trained.model, bars=True)  # on a terminal: a bar per target
    except (ConfigError, ckpt.CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"shardfc eval: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json_report(str(trained.path), metrics))
        return 0
    print(f"checkpoint {trained.path} ({trained.config.backbone}, {trained.config.embedding_dim}-d)")
    for t in targets:
        if ijb is not None and t.name == ijb.target.lower():
            print(f"  {t.name}: {_ijb_table(metrics[t.name])}  [{t.description}]")
        else:
            print(f"  {t.name}: {format_metrics(metrics[t.name])}  [{t.description}]")
    return 0
