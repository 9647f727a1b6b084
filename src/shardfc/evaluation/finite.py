"""Embeddings that are not finite refused before any metric reads them.

A backbone that overflowed (fp16 evaluation past 65,504) or diverged gives NaN or inf embeddings; every
metric still returns a number for them (verification accuracy 50%, a re-ID mAP from an arbitrary order),
which reads as a poor model rather than a broken one. :func:`check_finite` raises
:class:`NonFiniteEmbeddings` instead: ``shardfc eval`` reports it as its error, training's evaluations
log it for that target and train on (:func:`shardfc.train.observe.evaluate.run_targets`).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["NonFiniteEmbeddings", "check_finite"]


class NonFiniteEmbeddings(ValueError):
    """Embeddings hold NaN or inf: the metrics of them would be meaningless; the message names where."""


def check_finite(name: str, embeddings) -> None:
    """Raise :class:`NonFiniteEmbeddings` naming ``name``, the rows and the first one, when the
    ``[N, D]`` tensor or array ``embeddings`` holds a NaN or an infinity."""
    if isinstance(embeddings, torch.Tensor):
        bad_values = (~torch.isfinite(embeddings.detach())).cpu().numpy()
    else:
        values = np.asarray(embeddings)
        if not np.issubdtype(values.dtype, np.floating):
            return  # integers are finite
        bad_values = ~np.isfinite(values)
    rows = bad_values.any(axis=tuple(range(1, bad_values.ndim)))  # a row is bad if any of its values is
    bad = np.flatnonzero(rows)
    if len(bad):
        raise NonFiniteEmbeddings(
            f"{name} holds NaN or inf in {len(bad)} of {len(rows)} rows (the first: row {bad[0]}): the model's "
            "outputs overflowed or diverged, and no metric of them means anything"
        )
