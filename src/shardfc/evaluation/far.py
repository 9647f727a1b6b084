"""When a TAR@FAR is a measurement: the one rule of every protocol here (insightface's, the
exact one, IJB's), and the words that say why a value is missing."""

from __future__ import annotations

import math
from typing import Dict

__all__ = ["far_measurable", "why_undefined"]


def far_measurable(num_negatives: int, far: float) -> bool:
    """Whether ``num_negatives`` negative pairs can measure a false-accept rate of ``far``: it takes
    at least ``1 / far`` of them (with fewer, one false accept already exceeds ``far``, and "at most
    ``far``" silently becomes "none at all"). The one rule of every TAR@FAR here, both protocols."""
    # far * n >= 1 up to the rounding of far's decimal (1e-3 * 1000 must count as measurable); no
    # negatives are never enough (0 * far is 0, and NaN for an infinite far)
    return far * num_negatives >= 1.0 - 1e-9


def why_undefined(name: str, values: Dict[str, float]) -> str:
    """Why metric ``name`` of ``values`` (a metrics dict) has no value, in words, for logs and JSON:
    a TAR@FAR (``...@far=<far>``) the set has too few negative pairs for; else that it is not
    defined for this data."""
    if "@far=" in name:
        key = name.split("@far=", 1)[1]
        try:
            far = float(key)
            need = math.ceil(1.0 / far - 1e-9)
        except (ValueError, ZeroDivisionError):
            return "not defined for this data"
        negatives = values.get("num_negative_pairs")
        if negatives is None or not math.isfinite(negatives):
            return f"FAR {key} needs at least {need} negative pairs"
        if not far_measurable(int(negatives), far):
            return f"FAR {key} needs at least {need} negative pairs, this set has {int(negatives)}"
        positives = values.get("num_pairs", math.nan) - negatives
        if positives == 0:
            return "no positive pairs: there is no true-accept rate"
    return "not defined for this data"
