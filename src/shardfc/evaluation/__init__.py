"""Evaluation: face verification (insightface ``.bin`` pair sets, IJB-B/C templates) and person re-ID (CMC / mAP)."""

from shardfc.evaluation.ijb import evaluate_ijb, read_ijb_meta
from shardfc.evaluation.reid import (
    JUNK_PID,
    ReIDFolder,
    evaluate_reid,
    load_reid_split,
    parse_market1501_name,
    reid_metrics,
)
from shardfc.evaluation.verification import (
    embed_batches,
    embed_images,
    evaluate_verification,
    kfold_indices,
    load_bin,
    verification_metrics,
)

__all__ = [
    "JUNK_PID",
    "ReIDFolder",
    "embed_batches",
    "embed_images",
    "evaluate_ijb",
    "evaluate_reid",
    "evaluate_verification",
    "kfold_indices",
    "load_bin",
    "load_reid_split",
    "parse_market1501_name",
    "read_ijb_meta",
    "reid_metrics",
    "verification_metrics",
]
