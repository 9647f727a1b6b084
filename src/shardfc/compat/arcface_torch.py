"""insightface arcface_torch's ``PartialFC_V2``, computed by shardfc: change the import, nothing else.

arcface_torch's ``train_v2.py`` builds its classifier as::

    margin_loss = CombinedMarginLoss(64, 1.0, 0.5, 0.0, 0)
    module_partial_fc = PartialFC_V2(margin_loss, cfg.embedding_size, cfg.num_classes, cfg.sample_rate, cfg.fp16)
    loss = module_partial_fc(local_embeddings, local_labels)

and keeps ``module_partial_fc.parameters()`` in its SGD param groups and
``module_partial_fc.state_dict()`` in ``checkpoint_gpu_<rank>.pt``. :class:`PartialFC_V2` here has
the same constructor, call, parameter name and per-rank shape (``weight``:
``[C // W + (r < C % W), D]``, rank ``r`` holding classes from ``C // W · r + min(r, C % W)``), so
those keep working both ways: a checkpoint written by either loads into the other. What differs is
inside: it is :class:`~shardfc.ShardedMarginHead`, so the loss and its gradients are the dense ones
exactly (ranks exchange per-sample statistics, never logits), with none of arcface_torch's
clamping of the target probability at ``1e-30`` (its loss tops out at ``log(1e30) ≈ 69``; here a
sample's loss is whatever it is). ``fp16=True`` runs the matmuls under CUDA autocast, as
arcface_torch's does; the statistics stay fp32.

The margin comes from ``margin_loss``: arcface_torch's ``CombinedMarginLoss`` (its ``s``, ``m1``,
``m2``, ``m3``), its older ``ArcFace`` / ``CosFace`` modules, or any
:class:`shardfc.margins.Margin`. ``CombinedMarginLoss`` computes ArcFace(``m2``) when ``m1 = 1``
and ``m3 = 0``, and CosFace(``m3``) when ``m3 > 0`` whatever ``m1`` and ``m2`` are (it has no
combined margin; anything else raises there): the first two read as shardfc's ArcFace and CosFace,
and a ``CombinedMarginLoss`` whose ``m1`` or ``m2`` it would ignore, or that it refuses, is
refused with both ways out (shardfc's CosFace, as arcface_torch trained, or its ``Combined``).
arcface_torch's ``interclass_filtering_threshold`` zeroes the *logits* of negatives whose cosine to
the sample exceeds it; shardfc's inter-class filter removes negatives too close to the sample's
*target centre*: not the same method, so a non-zero threshold is refused with a message rather than
silently changed.

Partial FC (``sample_rate < 1``): each rank scores its positive classes and uniform negatives,
``max(⌈r·n_local⌉, B)`` classes in all (``B`` the global batch: every positive fits, with no host
read; arcface_torch: ``⌊r·n_local⌋``, or only the positives when they outnumber it, found with a
``torch.unique`` each step), and the weight gradient is dense with zeros outside them, as a plain
``torch.optim.SGD`` over the weight expects (the rows each forward sampled are let go at the
next step: nothing piles up). ``state_dict()`` keeps arcface_torch's one key, ``weight``,
and carries the sampling step in the state dict's metadata (which torch keeps and arcface_torch
ignores), so a resume from ``checkpoint_gpu_<rank>.pt`` draws the negatives the run would have drawn.
With shardfc's own optimizer instead (``shardfc.head_optimizer(fc, "sgd", ...)``: it steps the
sampled rows only and catches the others up when next read), the run is the same as with the
dense one, at the row-sparse cost.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from shardfc.head import margins as _margins
from shardfc.head.module import ShardedMarginHead

__all__ = ["PartialFC_V2", "margin_from_arcface_torch"]


def margin_from_arcface_torch(margin_loss: Any) -> _margins.Margin:
    """The shardfc margin that computes what ``margin_loss`` (an arcface_torch margin module or a
    shardfc margin) computes. Raises a TypeError for anything else, and a ValueError for an
    inter-class filtering threshold (a different method in shardfc)."""
    if isinstance(margin_loss, _margins.Margin):
        return margin_loss
    name = type(margin_loss).__name__
    if all(hasattr(margin_loss, a) for a in ("s", "m1", "m2", "m3")):  # CombinedMarginLoss
        threshold = float(getattr(margin_loss, "interclass_filtering_threshold", 0) or 0)
        if threshold > 0:
            raise ValueError(
                f"margin_loss {name} has interclass_filtering_threshold={threshold}: arcface_torch zeroes the "
                "logits of negatives whose cosine to the sample exceeds it, while shardfc's "
                "interclass_filter_threshold leaves out negatives too close to the sample's target centre; "
                "the methods differ, so pass threshold 0 here (or use ShardedMarginHead("
                "interclass_filter_threshold=...) for shardfc's)"
            )
        s, m1, m2, m3 = (float(getattr(margin_loss, a)) for a in ("s", "m1", "m2", "m3"))
        # arcface_torch's forward has two branches, not the combined margin its name suggests:
        # m1 = 1 and m3 = 0 is ArcFace(m2); else m3 > 0 is CosFace(m3), whatever m1 and m2 are;
        # else it raises.
        if m1 == 1.0 and m3 == 0.0:
            return _margins.ArcFace(s, m2)  # with arcface_torch's fallback past θ > π − m
        if m1 == 1.0 and m2 == 0.0 and m3 > 0.0:
            return _margins.CosFace(s, m3)
        given = f"{name}(s={s:g}, m1={m1:g}, m2={m2:g}, m3={m3:g})"
        combined = (f"shardfc.margins.Combined({s:g}, {m1:g}, {m2:g}, {m3:g}) for the combined margin "
                    "cos(m1·θ + m2) − m3")
        if m3 > 0.0:  # a run whose m1 or m2 arcface_torch dropped: which one the user meant is theirs to say
            raise ValueError(
                f"margin_loss {given}: arcface_torch computes CosFace(m3={m3:g}) when m3 > 0 and ignores m1 and m2; "
                f"pass CombinedMarginLoss({s:g}, 1.0, 0.0, {m3:g}) (or shardfc.margins.CosFace({s:g}, {m3:g})) to "
                f"train as arcface_torch did, or {combined}"
            )
        raise ValueError(f"margin_loss {given}: arcface_torch has no margin for these (ArcFace for m1 = 1 and m3 = 0, "
                         f"CosFace for m3 > 0; its forward raises otherwise); pass {combined}")
    if all(hasattr(margin_loss, a) for a in ("scale", "cos_m", "sinmm")):  # arcface_torch's ArcFace
        return _margins.ArcFace(float(margin_loss.scale), math.acos(float(margin_loss.cos_m)),
                                easy_margin=bool(getattr(margin_loss, "easy_margin", False)))
    if all(hasattr(margin_loss, a) for a in ("s", "m")):  # arcface_torch's CosFace
        return _margins.CosFace(float(margin_loss.s), float(margin_loss.m))
    raise TypeError(
        f"margin_loss must be arcface_torch's CombinedMarginLoss, ArcFace or CosFace, or a shardfc.margins.Margin; "
        f"got {name} (a callable on logits cannot run here: shardfc never forms the [B, C] logits)"
    )


class PartialFC_V2(ShardedMarginHead):
    """arcface_torch's ``PartialFC_V2(margin_loss, embedding_size, num_classes, sample_rate=1.0,
    fp16=False)`` over the default process group (see the module docstring).

    ``forward(local_embeddings [B_r, D], local_labels [B_r] or [B_r, 1])`` returns the mean loss
    over the global batch, the same on every rank; the embeddings' gradient follows arcface_torch's
    convention (``W×`` this rank's share, which DDP's average over ranks turns into the exact
    gradient). Unlike arcface_torch, local batches may differ in size between ranks and steps.
    """

    def __init__(self, margin_loss: Any, embedding_size: int, num_classes: int, sample_rate: float = 1.0,
                 fp16: bool = False):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "PartialFC_V2 needs torch.distributed initialised first, as arcface_torch's does "
                "(one process: use shardfc.ShardedMarginHead)"
            )
        if not isinstance(fp16, bool):
            raise TypeError(f"fp16 must be True or False, got {fp16!r}")
        super().__init__(embedding_size, num_classes, margin=margin_from_arcface_torch(margin_loss),
                         sample_rate=sample_rate, reduction="mean")
        self.fp16 = fp16
        self.embedding_size = self.embedding_dim

    def forward(self, local_embeddings: Tensor, local_labels: Tensor) -> Tensor:
        """The mean loss over the global batch (a scalar, the same on every rank) of this rank's
        ``local_embeddings [B_r, D]`` and ``local_labels [B_r]`` or ``[B_r, 1]`` (global class ids,
        any integer dtype). Raises ValueError for a label outside ``[0, num_classes)`` (other than
        ``-1``, ignored), on every rank."""
        labels = local_labels.reshape(-1)
        device = local_embeddings.device.type
        with torch.autocast(device, dtype=torch.float16, enabled=self.fp16 and device == "cuda"):
            return super().forward(local_embeddings, labels)
