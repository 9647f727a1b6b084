"""The fields' metadata that the TOML reader and the flag parser share: each field's section, type and
help text, and the coercion of a value to its field's type."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
from typing import Any, Dict, Tuple

from shardfc.train.config.fields import FIELDS, ConfigError, TrainConfig

__all__ = ["SECTIONS", "SECTION_OF", "TYPES", "field_help", "closest", "type_name", "coerce"]

#: Section of each field: groups ``--help`` and the optional TOML tables.
SECTIONS: Dict[str, Tuple[str, ...]] = {
    "data": ("dataset", "data_root", "list_file", "image_size", "synthetic_identities",
             "synthetic_images_per_identity", "num_workers", "max_corrupt_images", "loader", "drop_last", "sampler", "pk_instances",
             "random_erasing", "flip_prob"),
    "model": ("backbone", "embedding_dim", "neck"),
    "head": ("margin", "scale", "m", "m1", "m2", "m3", "easy_margin", "sphereface_lambda", "adaface_h",
             "adaface_momentum", "magface_l_a", "magface_u_a", "magface_l_m", "magface_u_m", "magface_lambda_g",
             "subcenters", "interclass_filter_threshold", "sample_rate", "chunk_size", "head_impl",
             "label_smoothing", "head_dtype", "head_rounding", "sparse_grad", "head_idle_rows", "triplet_weight", "triplet_margin", "triplet_soft"),
    "optim": ("optimizer", "lr", "momentum", "head_momentum", "weight_decay", "nesterov", "betas", "eps", "grad_clip", "head_grad_clip",
              "head_update", "cuda_graph", "grad_accum"),
    "schedule": ("batch_size", "max_steps", "epochs", "scheduler", "poly_power", "warmup_steps"),
    "run": ("strategy", "pipeline_stages", "pipeline_schedule", "micro_batches", "split_points", "micro_batch_stats",
            "amp", "channels_last", "compile", "seed", "nproc", "device", "threads", "output_dir", "resume", "log_every", "progress",
            "profile", "eval_every", "ckpt_every", "keep_last", "save_on_signal", "pg_timeout", "trust_checkpoint"),
    "eval": ("val_bins", "reid_root", "synthetic_val_pairs", "eval_batch_size", "eval_flip"),
    "classes": ("init_from", "head_init", "head_warmup_steps", "backbone_lr_mult", "on_missing_classes",
                "rename_classes"),
}
SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}
assert set(SECTION_OF) == set(FIELDS), "every TrainConfig field needs a section"

#: Field name -> (scalar type, is a list).
TYPES: Dict[str, Tuple[type, bool]] = {
    "image_size": (int, True),
    "betas": (float, True),
    "val_bins": (str, True),
    "split_points": (str, True),
}
for _f in dataclasses.fields(TrainConfig):
    if _f.name not in TYPES:
        TYPES[_f.name] = ({"str": str, "int": int, "float": float, "bool": bool}[str(_f.type)], False)


def _attribute_docstrings(cls: type) -> Dict[str, str]:
    """``{field: docstring}`` from the string literal that follows each annotated attribute."""
    try:  # dedented: a class defined inside a function or class is indented
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (e.g. a zipped install): help without descriptions
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _docs() -> Dict[str, str]:
    # read on first use, not at import: parsing the class's source costs every process that imports
    # the config (each rank a launch spawns) tens of milliseconds, and only ``--help`` and the flag
    # parser read it
    return _attribute_docstrings(TrainConfig)


def field_help(name: str) -> str:
    """The help text (attribute docstring) of field ``name``."""
    return _docs().get(name, "")


def closest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def type_name(name: str) -> str:
    scalar, is_list = TYPES[name]
    return f"a list of {scalar.__name__}" if is_list else scalar.__name__


def coerce(name: str, value: Any, where: str) -> Any:
    """``value`` as field ``name``'s type (ints are accepted for floats, never bools for numbers)."""
    scalar, is_list = TYPES[name]

    def one(v: Any) -> Any:
        if scalar is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, scalar) and not (scalar in (int, float) and isinstance(v, bool)):
            return v
        raise ConfigError(f"{where}{name} must be {type_name(name)}, got {value!r} ({type(value).__name__})")

    if is_list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}{name} must be {type_name(name)}, got {value!r} ({type(value).__name__})")
        return [one(v) for v in value]
    return one(value)
