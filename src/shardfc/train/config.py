"""``TrainConfig``: every knob of ``shardfc train``, loadable from TOML and overridable by CLI flags.

Values are resolved in this order, later ones winning::

    TrainConfig defaults  <  --preset NAME (src/shardfc/presets/NAME.toml)  <  --config PATH  <  --flags

A TOML file may list the fields flat or under tables named after their section (``[data]``,
``[model]``, ``[head]``, ``[optim]``, ``[schedule]``, ``[run]``, ``[eval]``). Every field is a flag
``--field-name`` (booleans also ``--no-field-name``; lists take several values, ``--betas 0.9 0.95``).
Unknown keys and flags are errors that name the closest valid one. Each field's help text is its
attribute docstring below, so the dataclass is the single source of truth for ``--help``.

(Longer than the other modules on purpose: the ~60 fields and their docstrings are the CLI's
documentation, and splitting them would split ``--help`` from the parser that reads it.)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "ConfigError",
    "STRATEGIES",
    "TrainConfig",
    "SECTIONS",
    "field_help",
    "load_toml",
    "config_from_mapping",
    "available_presets",
    "preset_path",
    "build_parser",
    "parse_config",
    "to_toml",
]


class ConfigError(ValueError):
    """A configuration value, key, file or flag is invalid; the message names it."""


#: Values of ``TrainConfig.strategy`` (what each does: :mod:`shardfc.train.strategy`).
STRATEGIES = ("ddp", "dp", "horovod")

#: Other names of a margin, accepted as the Python API accepts them (shardfc.margins.build_margin).
MARGIN_ALIASES = {"amsoftmax": "cosface"}

#: Flags users reach for that mean one of ours: suggested before any spelling match, which could
#: propose a flag of another meaning (--learning-rate is not --sample-rate).
FLAG_SYNONYMS = {
    "--learning-rate": "--lr", "--learning_rate": "--lr", "--base-lr": "--lr",
    "--wd": "--weight-decay", "--bs": "--batch-size", "--batch": "--batch-size",
    "--steps": "--max-steps", "--num-epochs": "--epochs", "--workers": "--num-workers",
    "--margin-m": "--m", "--s": "--scale", "--out": "--output-dir", "--output": "--output-dir",
}


@dataclass
class TrainConfig:
    """Configuration of one training run (see the module docstring for how it is assembled)."""

    # ------------------------------------------------------------------ data
    dataset: str = "synthetic"
    """Training data: 'synthetic' (generated identities, no files), 'folder' (one sub-folder per identity under data_root), 'recordio' (insightface / MXNet train.rec + train.idx in data_root, no mxnet needed) or 'list' (insightface-style 'path label' lines in list_file)."""
    data_root: str = ""
    """Root folder of the 'folder' dataset; folder with train.rec/train.idx (or the .rec path) of 'recordio', where relative val_bins are also looked up; base folder of relative paths of the 'list' dataset (default: the list file's folder)."""
    list_file: str = ""
    """The 'path label' list file of the 'list' dataset."""
    image_size: List[int] = field(default_factory=list)
    """Input size 'H W' of the backbone; empty: the backbone's default (112x112 faces, 256x128 re-ID, 32x32 tiny)."""
    synthetic_identities: int = 1000
    """Number of identities (classes) of the synthetic dataset."""
    synthetic_images_per_identity: int = 20
    """Training images per identity of the synthetic dataset."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process; synthetic images render faster than workers could ship them on a small CPU)."""
    drop_last: bool = False
    """Drop each epoch's last partial batch; by default it is trained on (the head accepts unequal per-rank batches)."""

    # ------------------------------------------------------------------ model
    backbone: str = "tiny"
    """Backbone name: iresnet18/34/50/100, mobilefacenet, resnet50 (re-ID) or tiny (CPU demos)."""
    embedding_dim: int = 128
    """Width of the embeddings the backbone produces and the head classifies."""

    # ------------------------------------------------------------------ head
    margin: str = "arcface"
    """Margin of the classifier: arcface, cosface, sphereface, combined, normsoftmax or softmax."""
    scale: float = 32.0
    """Logit scale s of arcface, cosface, combined and normsoftmax."""
    m: float = -1.0
    """Margin m: angular (arcface, default 0.5), additive cosine (cosface, default 0.35) or the integer multiplier (sphereface, default 4); negative: the margin's default."""
    m1: float = 1.0
    """Multiplicative angular margin m1 of 'combined': cos(m1*theta + m2) - m3."""
    m2: float = 0.5
    """Additive angular margin m2 of 'combined'."""
    m3: float = 0.0
    """Additive cosine margin m3 of 'combined'."""
    easy_margin: bool = False
    """ArcFace: apply the margin only where cos(theta) > 0."""
    sphereface_lambda: float = 0.0
    """SphereFace annealing: target logit = (lambda*cos + psi) / (1 + lambda); 0 is the pure margin."""
    sample_rate: float = 1.0
    """Partial FC: fraction of each shard's negative classes sampled per step (1.0: all classes, exact softmax)."""
    chunk_size: int = 0
    """Walk each shard's classes this many at a time to bound activation memory (logits never stored); 0: all at once; -1: auto (the largest chunk whose logits fit 64 MiB)."""
    label_smoothing: float = 0.0
    """Label smoothing epsilon over all classes."""
    head_dtype: str = "float32"
    """Storage dtype of the class centres and their optimizer state: float32, bfloat16 or float16 (updates computed in fp32, rounded once)."""
    head_rounding: str = "nearest"
    """How a bf16/fp16 head's fp32 update is rounded back: nearest or stochastic (unbiased, seeded by --seed)."""
    sparse_grad: bool = False
    """Partial FC: keep only the sampled rows' weight gradient (no [n_local, D] gradient); needs sample_rate < 1 and amp != fp16."""

    # ------------------------------------------------------------------ optim
    optimizer: str = "sgd"
    """Optimizer of backbone and head: 'sgd' or 'adamw'."""
    lr: float = 0.1
    """Peak learning rate (reached after warmup_steps)."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 5e-4
    """Weight decay (SGD: L2 added to the gradient; AdamW: decoupled)."""
    nesterov: bool = False
    """SGD: Nesterov momentum."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas 'beta1 beta2'."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 5.0
    """Clip the backbone's gradient norm, and separately the head's global norm over all shards, to this value; 0: no clipping."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (the step's batch is grad_accum * batch_size * nproc)."""

    # ------------------------------------------------------------------ schedule
    batch_size: int = 64
    """Images per rank per micro-batch."""
    max_steps: int = 0
    """Optimizer steps to train; 0: derived from epochs."""
    epochs: int = 8
    """Passes over the training set, used when max_steps is 0."""
    scheduler: str = "poly"
    """Learning-rate decay after warm-up, per step: 'poly' ((1 - t)^poly_power) or 'cosine'."""
    poly_power: float = 2.0
    """Exponent of the poly schedule."""
    warmup_steps: int = 200
    """Steps of linear learning-rate warm-up from 0."""

    # ------------------------------------------------------------------ run
    strategy: str = "ddp"
    """How the run spreads over processes and devices: 'ddp' (one process per rank, spawned with --nproc or by torchrun; backbone in DistributedDataParallel, one head shard per rank), 'dp' (one process; backbone in nn.DataParallel over every visible CUDA device, one head shard per device; needs >= 2 GPUs; batch_size is per GPU) or 'horovod' (launched by `horovodrun -np N`; backbone optimizer in hvd.DistributedOptimizer, one head shard per rank over Horovod's collectives)."""
    amp: str = "none"
    """Mixed precision: 'none', 'bf16' (autocast) or 'fp16' (autocast + loss scaling; on CPU it falls back to bf16)."""
    seed: int = 0
    """Seed of the model initialisation, data order, augmentation and the synthetic dataset."""
    nproc: int = 2
    """Processes to spawn on this machine (strategy 'ddp'; ignored under torchrun and horovodrun, whose environment decides, and by 'dp', which is one process)."""
    device: str = "auto"
    """'auto' (one CUDA device per rank when available, else CPU), 'cpu' or 'cuda'."""
    output_dir: str = "shardfc_runs/synthetic"
    """Run folder: checkpoints/, metrics.csv, train.log, config.toml (default: shardfc_runs/<preset or dataset>)."""
    resume: str = "auto"
    """'auto': continue from the newest complete checkpoint in output_dir (if any); 'none': start fresh (refused if output_dir holds checkpoints); or a checkpoint folder."""
    log_every: int = 50
    """Log loss, learning rate and throughput every this many steps."""
    progress: bool = True
    """Show a progress bar on rank 0 when stderr is a terminal (tqdm if installed)."""
    eval_every: int = 250
    """Evaluate every this many steps; 0: only at the end."""
    ckpt_every: int = 500
    """Save a checkpoint every this many steps; 0: only at the end."""
    keep_last: int = 3
    """Keep this many newest checkpoints, deleting older complete ones; 0: keep all."""
    trust_checkpoint: bool = False
    """Resume from a checkpoint even if its files need full unpickling (written by shardfc before checkpoint format 2, or not by shardfc): unpickling can run arbitrary code, so only for checkpoints you trust."""

    # ------------------------------------------------------------------ eval
    val_bins: List[str] = field(default_factory=list)
    """insightface verification .bin files (lfw.bin, cfp_fp.bin, agedb_30.bin, ...) evaluated during training."""
    reid_root: str = ""
    """Re-ID dataset root with query/gallery splits (e.g. Market-1501), evaluated during training."""
    synthetic_val_pairs: int = 1000
    """Held-out verification pairs of the synthetic dataset (unseen images of unseen identities); 0: none."""
    eval_batch_size: int = 256
    """Images per forward pass during evaluation."""
    eval_flip: bool = True
    """Add the embedding of the mirrored image at evaluation (insightface protocol)."""

    # ------------------------------------------------------------------ derived helpers
    def margin_params(self) -> Dict[str, Any]:
        """Keyword arguments of :func:`shardfc.head.margins.build_margin` for ``self.margin``."""
        name = self.margin
        if name == "arcface":
            return {"scale": self.scale, "margin": 0.5 if self.m < 0 else self.m, "easy_margin": self.easy_margin}
        if name == "cosface":
            return {"scale": self.scale, "margin": 0.35 if self.m < 0 else self.m}
        if name == "sphereface":
            return {"margin": 4 if self.m < 0 else int(self.m), "lambda_": self.sphereface_lambda}
        if name == "combined":
            return {"scale": self.scale, "m1": self.m1, "m2": self.m2, "m3": self.m3}
        if name == "normsoftmax":
            return {"scale": self.scale}
        return {}

    def validate(self) -> "TrainConfig":
        """Check value ranges and combinations; raise :class:`ConfigError` naming the field and value."""
        _choice(self, "dataset", ("synthetic", "folder", "recordio", "list"))
        self.margin = MARGIN_ALIASES.get(self.margin, self.margin)
        _choice(self, "margin", ("arcface", "cosface", "sphereface", "combined", "normsoftmax", "softmax"))
        _choice(self, "optimizer", ("sgd", "adamw"))
        _choice(self, "scheduler", ("poly", "cosine"))
        _choice(self, "strategy", STRATEGIES)
        _choice(self, "amp", ("none", "bf16", "fp16"))
        _choice(self, "device", ("auto", "cpu", "cuda"))
        for name in ("synthetic_identities", "synthetic_images_per_identity", "embedding_dim", "batch_size",
                     "grad_accum", "nproc", "log_every", "eval_batch_size"):
            _at_least(self, name, 1)
        if self.chunk_size < -1:
            raise ConfigError(f"chunk_size must be >= 1, 0 (no chunking) or -1 (auto), got {self.chunk_size!r}")
        for name in ("num_workers", "max_steps", "epochs", "warmup_steps", "eval_every",
                     "ckpt_every", "keep_last", "synthetic_val_pairs", "seed"):
            _at_least(self, name, 0)
        for name in ("lr", "scale", "eps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("weight_decay", "grad_clip", "poly_power", "sphereface_lambda"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ConfigError(f"sample_rate must be in (0, 1], got {self.sample_rate!r}")
        _choice(self, "head_dtype", ("float32", "bfloat16", "float16"))
        _choice(self, "head_rounding", ("nearest", "stochastic"))
        if self.sparse_grad and self.sample_rate >= 1.0:
            raise ConfigError(f"sparse_grad needs Partial FC: set sample_rate < 1 (got {self.sample_rate!r})")
        if self.sparse_grad and self.amp == "fp16":
            raise ConfigError("sparse_grad does not work with amp='fp16' (the loss scaler unscales .grad only): "
                              "use --amp bf16 or none")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.image_size and (len(self.image_size) != 2 or min(self.image_size) < 1):
            raise ConfigError(f"image_size must be empty or two positive ints 'H W', got {self.image_size!r}")
        if self.max_steps == 0 and self.epochs == 0:
            raise ConfigError("max_steps and epochs are both 0: set one of them to say how long to train")
        if self.margin == "sphereface" and self.m >= 0 and (self.m != int(self.m) or self.m < 1):
            raise ConfigError(f"m must be an integer >= 1 for margin='sphereface', got {self.m!r}")
        from shardfc.head.margins import build_margin  # the margin's own checks, named by our flags

        try:
            build_margin(self.margin, **self.margin_params())
        except (TypeError, ValueError) as e:
            given = ", ".join(f"{k}={getattr(self, k)!r} (--{k.replace('_', '-')})" for k in _MARGIN_FIELDS[self.margin])
            raise ConfigError(f"margin={self.margin!r} with {given}: {e}") from None
        if self.dataset == "synthetic" and self.data_root:
            raise ConfigError(
                f"data_root={self.data_root!r} is set but dataset='synthetic' reads no files: pass --dataset folder "
                "(one sub-folder per identity) or --dataset list"
            )
        if self.dataset == "recordio" and not self.data_root:
            raise ConfigError("dataset='recordio' needs data_root (the folder with train.rec and train.idx, or the .rec)")
        if self.dataset == "folder" and not self.data_root:
            raise ConfigError("dataset='folder' needs data_root (the folder with one sub-folder per identity)")
        if self.dataset == "list" and not self.list_file:
            raise ConfigError("dataset='list' needs list_file (lines of 'path label')")
        if not self.output_dir:
            raise ConfigError("output_dir must not be empty")
        return self


DEFAULT_OUTPUT_DIR = "shardfc_runs/synthetic"

#: The fields each margin reads (named in its errors).
_MARGIN_FIELDS = {
    "arcface": ("scale", "m", "easy_margin"), "cosface": ("scale", "m"), "sphereface": ("m", "sphereface_lambda"),
    "combined": ("scale", "m1", "m2", "m3"), "normsoftmax": ("scale",), "softmax": (),
}


def _choice(cfg: TrainConfig, name: str, choices: Sequence[str]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}{hint}")


def _at_least(cfg: TrainConfig, name: str, low: int) -> None:
    value = getattr(cfg, name)
    if value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value!r}")


# ---------------------------------------------------------------------- field metadata

#: Section of each field: groups ``--help`` and the optional TOML tables.
SECTIONS: Dict[str, Tuple[str, ...]] = {
    "data": ("dataset", "data_root", "list_file", "image_size", "synthetic_identities",
             "synthetic_images_per_identity", "num_workers", "drop_last"),
    "model": ("backbone", "embedding_dim"),
    "head": ("margin", "scale", "m", "m1", "m2", "m3", "easy_margin", "sphereface_lambda", "sample_rate",
             "chunk_size", "label_smoothing", "head_dtype", "head_rounding", "sparse_grad"),
    "optim": ("optimizer", "lr", "momentum", "weight_decay", "nesterov", "betas", "eps", "grad_clip", "grad_accum"),
    "schedule": ("batch_size", "max_steps", "epochs", "scheduler", "poly_power", "warmup_steps"),
    "run": ("strategy", "amp", "seed", "nproc", "device", "output_dir", "resume", "log_every", "progress",
            "eval_every", "ckpt_every", "keep_last", "trust_checkpoint"),
    "eval": ("val_bins", "reid_root", "synthetic_val_pairs", "eval_batch_size", "eval_flip"),
}
_SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
assert set(_SECTION_OF) == set(_FIELDS), "every TrainConfig field needs a section"

#: Field name -> (scalar type, is a list).
_TYPES: Dict[str, Tuple[type, bool]] = {
    "image_size": (int, True),
    "betas": (float, True),
    "val_bins": (str, True),
}
for _f in dataclasses.fields(TrainConfig):
    if _f.name not in _TYPES:
        _TYPES[_f.name] = ({"str": str, "int": int, "float": float, "bool": bool}[str(_f.type)], False)


def _attribute_docstrings(cls: type) -> Dict[str, str]:
    """``{field: docstring}`` from the string literal that follows each annotated attribute."""
    try:
        tree = ast.parse(inspect.getsource(cls))
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


_DOCS = _attribute_docstrings(TrainConfig)


def field_help(name: str) -> str:
    """The help text (attribute docstring) of field ``name``."""
    return _DOCS.get(name, "")


def _closest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _type_name(name: str) -> str:
    scalar, is_list = _TYPES[name]
    return f"a list of {scalar.__name__}" if is_list else scalar.__name__


def _coerce(name: str, value: Any, where: str) -> Any:
    """``value`` as field ``name``'s type (ints are accepted for floats, never bools for numbers)."""
    scalar, is_list = _TYPES[name]

    def one(v: Any) -> Any:
        if scalar is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, scalar) and not (scalar in (int, float) and isinstance(v, bool)):
            return v
        raise ConfigError(f"{where}{name} must be {_type_name(name)}, got {value!r} ({type(value).__name__})")

    if is_list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}{name} must be {_type_name(name)}, got {value!r} ({type(value).__name__})")
        return [one(v) for v in value]
    return one(value)


# ---------------------------------------------------------------------- TOML


def load_toml(path: "str | os.PathLike[str]") -> Dict[str, Any]:
    """Parse a TOML file into a dict; errors name the file."""
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError(f"reading {path} needs Python >= 3.11 or the 'tomli' package (pip install tomli)") from None
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from e


def _flatten(data: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """Flat ``{field: value}`` from a TOML mapping with optional section tables."""
    flat: Dict[str, Any] = {}
    where = f"{source}: " if source else ""
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, Mapping):
            for sub, subvalue in value.items():
                if sub in _FIELDS and _SECTION_OF[sub] != key:
                    raise ConfigError(f"{where}key {sub!r} belongs in [{_SECTION_OF[sub]}], not [{key}]")
                if sub not in _FIELDS:
                    raise ConfigError(f"{where}unknown key {key}.{sub}{_closest(sub, SECTIONS[key] or _FIELDS)}")
                flat[sub] = subvalue
        elif key in _FIELDS:
            if isinstance(value, Mapping):
                raise ConfigError(
                    f"{where}[{key}] is a table, but {key!r} is a field ({_type_name(key)}): write '{key} = ...' "
                    f"at the top or under [{_SECTION_OF[key]}]; the tables are {', '.join(f'[{s}]' for s in SECTIONS)}"
                )
            flat[key] = value
        else:
            raise ConfigError(f"{where}unknown key {key!r}{_closest(key, list(_FIELDS) + list(SECTIONS))}")
    return flat


def config_from_mapping(
    data: Mapping[str, Any], base: Optional[TrainConfig] = None, source: str = ""
) -> TrainConfig:
    """``base`` (default: the defaults) updated with ``data`` (flat or sectioned), type-checked.

    Range checks are left to :meth:`TrainConfig.validate`, run once everything is merged.
    """
    where = f"{source}: " if source else ""
    updates = {k: _coerce(k, v, where) for k, v in _flatten(data, source).items()}
    return dataclasses.replace(base or TrainConfig(), **updates)


def to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as a sectioned TOML document that :func:`config_from_mapping` reads back."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return "[" + ", ".join(fmt(x) for x in v) + "]"

    lines = []
    for section, names in SECTIONS.items():
        lines.append(f"[{section}]")
        lines += [f"{name} = {fmt(getattr(cfg, name))}" for name in names]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------- presets


def available_presets() -> List[str]:
    """Names of the bundled presets (``src/shardfc/presets/*.toml``)."""
    folder = resources.files("shardfc") / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def preset_path(name: str) -> Path:
    """Path of bundled preset ``name``; an unknown name names the closest one."""
    names = available_presets()
    if name not in names:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(names)}{_closest(name, names)}")
    return Path(str(resources.files("shardfc") / "presets" / f"{name}.toml"))


# ---------------------------------------------------------------------- command line


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_parser(name: str, scalar: type):
    def parse(text: str) -> Any:
        try:
            return scalar(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {scalar.__name__}, got {text!r}") from None

    parse.__name__ = scalar.__name__
    return parse


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`ConfigError` instead of exiting, so callers choose how to report."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(message)


def build_parser(prog: str = "shardfc train") -> argparse.ArgumentParser:
    """The ``shardfc train`` parser: --preset, --config, and one flag per field (all default to unset)."""
    parser = _Parser(
        prog=prog,
        usage=f"{prog} [--preset NAME] [--config PATH] [--print-config] [--FIELD VALUE ...]",
        allow_abbrev=False,  # '--lr' must never silently match '--lr-something'
        description="Train an embedding backbone with a class-sharded margin head. With no arguments: the "
        "synthetic demo on 2 CPU processes. Under torchrun the launcher's processes join one group.",
        epilog=f"presets: {', '.join(available_presets())}. Values: defaults < --preset < --config < flags.",
    )
    parser.add_argument("--preset", metavar="NAME", help="start from a bundled preset")
    parser.add_argument("--config", metavar="PATH", help="TOML file with field values (flat or in [section] tables)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML and exit")
    defaults = TrainConfig()
    for section, names in SECTIONS.items():
        group = parser.add_argument_group(section)
        for name in names:
            scalar, is_list = _TYPES[name]
            default = getattr(defaults, name)
            helptext = f"{field_help(name)} (default: {default!r})".replace("%", "%%")
            kwargs: Dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS, help=helptext)
            if scalar is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _scalar_parser(name, scalar)
                kwargs["metavar"] = {int: "N", float: "X", str: "PATH" if is_list else "TEXT"}[scalar]
                if is_list:
                    kwargs["nargs"] = "*"
            group.add_argument(_flag(name), **kwargs)
    return parser


def parse_config(argv: Sequence[str]) -> Tuple[TrainConfig, argparse.Namespace]:
    """Resolve defaults, --preset, --config and flags into a validated :class:`TrainConfig`.

    Returns the config and the parsed namespace (for ``--print-config``).
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(list(argv))
    if unknown:
        first = unknown[0]
        flags = [o for a in parser._actions for o in a.option_strings]
        flag = first.split("=", 1)[0]
        if flag in FLAG_SYNONYMS:
            hint = f"; did you mean {FLAG_SYNONYMS[flag]!r}?"
        else:
            hint = _closest(flag, flags) if first.startswith("-") else ""
        raise ConfigError(f"unknown argument {first!r}{hint}")
    cfg = TrainConfig()
    if args.preset:
        cfg = config_from_mapping(load_toml(preset_path(args.preset)), cfg, f"preset {args.preset}")
    if args.config:
        cfg = config_from_mapping(load_toml(args.config), cfg, args.config)
    overrides = {k: v for k, v in vars(args).items() if k in _FIELDS}
    cfg = dataclasses.replace(cfg, **overrides)
    if "data_root" in overrides and "dataset" not in overrides and cfg.dataset in ("synthetic", "folder", "recordio"):
        # --data-root alone never means the synthetic demo: a release folder (train.rec) or a folder of identities.
        root = Path(cfg.data_root)
        cfg.dataset = "recordio" if root.suffix == ".rec" or (root / "train.rec").is_file() else "folder"
    if cfg.output_dir == DEFAULT_OUTPUT_DIR and (args.preset or cfg.dataset != "synthetic"):
        # A first real run must not resume (and append to) the synthetic demo's folder.
        cfg.output_dir = f"shardfc_runs/{args.preset or cfg.dataset}"
    return cfg.validate(), args
