"""The evaluation targets a run plans, by name and size, checked before anything is loaded or trained.

Each target reports under one name (``val/<name>/...`` in ``metrics.csv``): a ``.bin`` its file's stem,
then ``synthetic``, ``reid``, ``ijbc``/``ijbb``. :meth:`TrainConfig.validate
<shardfc.train.config.TrainConfig.validate>` (every rank, before training) and
:func:`~shardfc.train.observe.evaluate.build_targets` (``shardfc eval``'s flags) both ask
:func:`plan_targets`, so that two targets of one name, which would overwrite each other's metrics, or
a synthetic set smaller than the protocol's folds, which could only fail at the first evaluation, or
one too large to render in memory (:data:`MAX_SYNTHETIC_PAIR_BYTES`: rendered at the first evaluation,
after the training, it would end the run out of memory there) are refused at once. It raises
ValueError; its callers name it a ConfigError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

from shardfc.evaluation.folds import NFOLDS

__all__ = ["MAX_SYNTHETIC_PAIR_BYTES", "asked_targets", "plan_targets"]

#: Most bytes the held-out synthetic pairs may take (both images of each pair, float32, rendered
#: and kept in memory): 8 GiB is 28,532 pairs at 112x112, enough for TAR at FAR 1e-4 (10,000
#: negative pairs); the verification .bin sets hold 6,000 to 12,000.
MAX_SYNTHETIC_PAIR_BYTES = 8 << 30


def asked_targets(cfg, bins: Optional[List[str]], reid_root: Optional[str],
                  synthetic_pairs: Optional[int]) -> Tuple[List[str], str, int]:
    """The targets asked for: each override given, else ``cfg``'s (synthetic pairs for a synthetic run only)."""
    if synthetic_pairs is None:
        synthetic_pairs = cfg.synthetic_val_pairs if cfg.dataset == "synthetic" else 0
    bins = list(cfg.val_bins) if bins is None else bins
    return bins, (cfg.reid_root if reid_root is None else reid_root), synthetic_pairs


def plan_targets(
    cfg,
    *,
    bins: Optional[List[str]] = None,
    reid_root: Optional[str] = None,
    synthetic_pairs: Optional[int] = None,
    ijb_target: Optional[str] = None,
) -> List[Tuple[str, str]]:
    """``(name, what)`` of each target :func:`~shardfc.train.observe.evaluate.build_targets` makes, in its
    order, reading no file (``bins``/``reid_root``/``synthetic_pairs`` override ``cfg``'s, as
    ``shardfc eval``'s flags do; ``ijb_target``: an IJB release's protocol).

    Raises ValueError for two targets under one name, for fewer synthetic pairs than
    :data:`~shardfc.evaluation.folds.NFOLDS` (0 means none), or for more than fit in
    :data:`MAX_SYNTHETIC_PAIR_BYTES` at the run's image size.
    """
    # the count as the user gave it: shardfc eval's flag overrides the run's field
    given = "synthetic_val_pairs={}" if synthetic_pairs is None else "--synthetic-pairs {}"
    bins, reid_root, synthetic_pairs = asked_targets(cfg, bins, reid_root, synthetic_pairs)
    if synthetic_pairs < 0 or 0 < synthetic_pairs < NFOLDS:
        raise ValueError(f"synthetic_val_pairs must be 0 (none) or at least {NFOLDS} (the verification protocol's "
                         f"folds), got {synthetic_pairs}")
    if synthetic_pairs:
        from shardfc.models import input_size

        h, w = cfg.image_size if cfg.image_size else input_size(cfg.backbone)
        pair_bytes = 2 * 3 * int(h) * int(w) * 4
        if synthetic_pairs * pair_bytes > MAX_SYNTHETIC_PAIR_BYTES:
            raise ValueError(
                f"{given.format(synthetic_pairs)} would render {synthetic_pairs * pair_bytes / 2**30:,.1f} GiB of "
                f"images in memory ({h}x{w}, two float32 images a pair); at most "
                f"{MAX_SYNTHETIC_PAIR_BYTES // pair_bytes:,} pairs at this size ({MAX_SYNTHETIC_PAIR_BYTES >> 30} GiB)"
            )
    plan = [("synthetic", "the held-out synthetic pairs")] if synthetic_pairs else []
    plan += [(Path(path).stem, f"the .bin file {path!r}") for path in bins]
    if reid_root:
        plan.append(("reid", f"the re-ID split {reid_root!r}"))
    if ijb_target is not None:
        plan.append((ijb_target.lower(), f"the {ijb_target} release"))
    seen: Dict[str, str] = {}
    for name, what in plan:
        if name in seen:
            raise ValueError(
                f"{seen[name]} and {what} would both report as {name!r}, one's metrics overwriting the other's "
                "(a .bin is named by its file's stem): give one file another name, or a link to it"
            )
        seen[name] = what
    return plan
