"""Evaluation targets of a run: synthetic held-out pairs, insightface ``.bin`` files, a re-ID split,
an IJB-B/IJB-C release (``shardfc eval --ijb``).

Targets are loaded once (before training starts, so a missing file fails fast) and evaluated on
one process with the plain backbone module: verification needs no collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from shardfc import progress
from shardfc.checks import MAX_SEED
from shardfc.evaluation import evaluate_reid, evaluate_verification, load_bin, load_reid_split
from shardfc.evaluation.finite import NonFiniteEmbeddings
from shardfc.evaluation.folds import NFOLDS
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.config import targets as target_plan

__all__ = ["EvalTarget", "IJBOptions", "LazyPairs", "build_targets", "plan_targets", "run_targets", "synthetic_dataset"]

logger = logging.getLogger("shardfc.train")


@dataclass
class EvalTarget:
    """One named evaluation: a callable from a backbone to a metrics dict."""

    name: str
    """Short name, used as the metric prefix (``val/<name>/accuracy``)."""
    description: str
    """What is evaluated, for a person (``1000 held-out synthetic pairs of unseen identities``)."""
    evaluate: Callable[[nn.Module], Dict[str, float]]
    """Runs the evaluation with a backbone (any mode; restored afterwards)."""


def synthetic_dataset(cfg: TrainConfig, image_size: Tuple[int, int]):
    """The synthetic identity set a config trains on."""
    from shardfc.data import SyntheticIdentities

    return SyntheticIdentities(
        cfg.synthetic_identities, cfg.synthetic_images_per_identity, tuple(image_size), seed=cfg.seed,
        flip_prob=cfg.flip_prob,
    )


def plan_targets(cfg: TrainConfig, **overrides) -> List[Tuple[str, str]]:
    """:func:`shardfc.train.config.targets.plan_targets`, its refusal a :class:`ConfigError`."""
    try:
        return target_plan.plan_targets(cfg, **overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_targets(
    cfg: TrainConfig,
    image_size: Tuple[int, int],
    device: torch.device,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    *,
    bins: List[str] | None = None,
    reid_root: str | None = None,
    synthetic_pairs: int | None = None,
    ijb: "IJBOptions | None" = None,
) -> List[EvalTarget]:
    """The targets ``cfg`` asks for (``bins``/``reid_root``/``synthetic_pairs`` override it), plus
    an IJB release when ``ijb`` is given; :func:`plan_targets`' checks first."""
    plan_targets(cfg, bins=bins, reid_root=reid_root, synthetic_pairs=synthetic_pairs,
                 ijb_target=ijb.target if ijb is not None else None)
    # each named as the user gave it: the run's field, or shardfc eval's flag
    bins_flag = "val_bins:" if bins is None else "--bin"
    reid_flag = f"reid_root={cfg.reid_root!r}" if reid_root is None else f"--reid-root {reid_root!r}"
    bins, reid_root, synthetic_pairs = target_plan.asked_targets(cfg, bins, reid_root, synthetic_pairs)
    kw = dict(batch_size=cfg.eval_batch_size, flip=cfg.eval_flip, device=device, nfolds=NFOLDS)
    targets: List[EvalTarget] = []

    if synthetic_pairs:
        # Unseen identities make this open-set, like LFW: the backbone must generalise, not memorise.
        # Rendered at the first evaluation, then kept: start-up does not wait for them.
        pairs = LazyPairs(cfg, image_size, synthetic_pairs)

        def synthetic(model: nn.Module, pairs=pairs) -> Dict[str, float]:
            images_a, images_b, issame = pairs.get()
            with autocast():
                return evaluate_verification(model, (images_a, images_b), issame, **kw)

        targets.append(
            EvalTarget("synthetic", f"{synthetic_pairs} held-out synthetic pairs of unseen identities", synthetic)
        )

    for path in bins:
        # insightface releases ship lfw.bin etc. beside train.rec: a relative name not found here is
        # looked up in data_root, so '--data-root /data/ms1m-retinaface-t1' finds its .bin files.
        if cfg.data_root and not os.path.isabs(path) and not os.path.exists(path):
            beside = os.path.join(cfg.data_root, path)
            path = beside if os.path.exists(beside) else path
        try:
            images, issame = load_bin(path, image_size)
        except FileNotFoundError:
            raise
        except Exception as e:  # a broken pickle surfaces as almost any error type; name the file
            raise ConfigError(f"{bins_flag} cannot load {path!r}: {type(e).__name__}: {e}") from e
        if len(issame) < NFOLDS:  # now, not at the first evaluation after training
            raise ConfigError(f"{bins_flag} {path!r} holds {len(issame)} pair(s); the verification protocol needs at "
                              f"least {NFOLDS} (one per fold)")
        logger.info("loaded %s: %d pairs", path, len(issame))

        def verification(model: nn.Module, images=images, issame=issame) -> Dict[str, float]:
            with autocast():
                return evaluate_verification(model, images, issame, **kw)

        targets.append(EvalTarget(Path(path).stem, f"{len(issame)} pairs of {path}", verification))

    if reid_root:
        targets.append(_reid_target(reid_root, image_size, cfg, device, autocast, reid_flag))
    if ijb is not None:
        targets.append(_ijb_target(ijb, image_size, cfg, device, autocast))
    return targets


def pairs_seed(seed: int) -> int:
    """The seed of a run's held-out pairs: the run's plus one (the pairs of every earlier run), the
    largest seed's wrapping to 0 (a seed is at most ``2**63 - 1``)."""
    return (seed + 1) % (MAX_SEED + 1)


class LazyPairs:
    """The synthetic verification pairs of a run, rendered on the first :meth:`get` and kept.

    (Rendering 2 x 1000 images at 112x112 took most of a synthetic run's start-up.)
    """

    def __init__(self, cfg: TrainConfig, image_size: Tuple[int, int], num_pairs: int) -> None:
        self.cfg, self.image_size, self.num_pairs = cfg, tuple(image_size), num_pairs
        self._pairs = None

    @property
    def rendered(self) -> bool:
        return self._pairs is not None

    def get(self):
        """``(images_a, images_b, issame)``: :meth:`~shardfc.data.SyntheticIdentities.verification_pairs`."""
        if self._pairs is None:
            self._pairs = synthetic_dataset(self.cfg, self.image_size).verification_pairs(
                self.num_pairs, seed=pairs_seed(self.cfg.seed), unseen_identities=True
            )
        return self._pairs


@dataclass
class IJBOptions:
    """What ``shardfc eval --ijb`` asks for (see :func:`shardfc.evaluation.ijb.evaluate_ijb`)."""

    root: str
    target: str = "IJBC"
    out_dir: str | None = None
    """Where to write the scores, the ROC as CSV and its plot; None: nowhere."""
    norm_score: bool = True
    detector_score: bool = True
    workers: int = 0
    """DataLoader processes that decode and align the faces."""


def _ijb_target(opts: IJBOptions, image_size, cfg: TrainConfig, device, autocast) -> EvalTarget:
    from shardfc.evaluation.ijb import evaluate_ijb, read_ijb_meta, write_ijb_report

    meta = read_ijb_meta(opts.root, opts.target)  # parse now: a bad release fails before embedding
    logger.info("loaded %s meta of %s: %d faces, %d template pairs", opts.target, opts.root, len(meta.names), len(meta.labels))

    def evaluate(model: nn.Module) -> Dict[str, float]:
        with autocast():
            metrics, scores, _ = evaluate_ijb(
                model, opts.root, opts.target, batch_size=cfg.eval_batch_size, flip=cfg.eval_flip,
                norm_score=opts.norm_score, detector_score=opts.detector_score, device=device, meta=meta,
                image_size=tuple(image_size), workers=opts.workers,
            )
        if opts.out_dir:
            write_ijb_report(opts.out_dir, opts.target, scores, meta.labels)
        return metrics

    return EvalTarget(
        opts.target.lower(), f"{len(meta.labels)} template pairs of {opts.target} in {opts.root}", evaluate
    )


def _reid_target(root: str, image_size, cfg: TrainConfig, device, autocast, given: str) -> EvalTarget:
    try:  # scan now: a bad root fails before training, not at the first evaluation
        query, gallery = load_reid_split(root, image_size=tuple(image_size))
    except (FileNotFoundError, ValueError) as e:  # no query/ or gallery folder, no images, a name that does not parse
        raise ConfigError(f"{given}: {e}") from None
    logger.info("loaded re-ID split %s: %d query, %d gallery images", root, len(query), len(gallery))

    def evaluate(model: nn.Module) -> Dict[str, float]:
        with autocast():
            return evaluate_reid(
                model, root, image_size=tuple(image_size), batch_size=cfg.eval_batch_size, flip=cfg.eval_flip,
                device=device,
            )

    return EvalTarget("reid", f"re-ID query/gallery of {root}", evaluate)


def run_targets(targets: List[EvalTarget], model: nn.Module, bars: bool = False,
                skip_non_finite: bool = False) -> Dict[str, Dict[str, float]]:
    """``{target name: metrics}`` for every target. ``bars``: a progress bar named by the target over
    its embedding (``shardfc eval``; training's evaluations run under the training bar, without).

    Embeddings that are not finite raise :class:`NonFiniteEmbeddings` naming the target; with
    ``skip_non_finite`` (training's evaluations: the run goes on, and its divergence stop watches the
    loss) the target is logged as not evaluated and left out of the result instead."""
    metrics = {}
    for t in targets:
        try:
            with progress.labelled(t.name) if bars else contextlib.nullcontext():
                metrics[t.name] = t.evaluate(model)
        except NonFiniteEmbeddings as e:
            if not skip_non_finite:
                raise NonFiniteEmbeddings(f"{t.name}: {e}") from None
            logger.warning("%s not evaluated: %s", t.name, e)
    return metrics
