"""The ``shardfc train`` command line: one flag per field, and the resolution of defaults, ``--preset``,
``--config`` and flags into a validated :class:`~shardfc.train.config.fields.TrainConfig`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

from shardfc.train.config.fields import DEFAULT_OUTPUT_DIR, FIELDS, ConfigError, TrainConfig, check_flags_read
from shardfc.train.config.sections import SECTIONS, TYPES, closest, field_help
from shardfc.train.config.toml import available_presets, config_from_mapping, load_toml, preset_path

__all__ = ["FLAG_SYNONYMS", "FLAG_ALIASES", "build_parser", "parse_config"]

#: Flags users reach for that mean one of ours: suggested before any spelling match, which could
#: propose a flag of another meaning (--learning-rate is not --sample-rate).
FLAG_SYNONYMS = {
    "--learning-rate": "--lr", "--learning_rate": "--lr", "--base-lr": "--lr",
    "--wd": "--weight-decay", "--bs": "--batch-size", "--batch": "--batch-size",
    "--steps": "--max-steps", "--num-epochs": "--epochs", "--workers": "--num-workers",
    "--s": "--scale", "--out": "--output-dir", "--output": "--output-dir",
}

#: More names of a field's flag, unambiguous under torchrun, whose parser takes any abbreviation of
#: its own options out of the script's arguments ('--m' could be '--max-restarts', '--nproc'
#: '--nproc-per-node'). Under torchrun, ``--`` before the flags of ``shardfc train`` also protects them.
FLAG_ALIASES: Dict[str, Tuple[str, ...]] = {"m": ("--margin-m",), "nproc": ("--num-procs",)}


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
            scalar, is_list = TYPES[name]
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
            group.add_argument(_flag(name), *FLAG_ALIASES.get(name, ()), **kwargs)
    return parser


def parse_config(argv: Sequence[str]) -> Tuple[TrainConfig, argparse.Namespace]:
    """Resolve defaults, --preset, --config and flags into a validated :class:`TrainConfig`.

    Returns the config and the parsed namespace (for ``--print-config``).
    """
    argv = list(argv)
    if argv[:1] == ["--"]:  # `torchrun ... -m shardfc train -- FLAGS`: the separator that shields FLAGS from torchrun
        argv = argv[1:]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        first = unknown[0]
        flags = [o for a in parser._actions for o in a.option_strings]
        flag = first.split("=", 1)[0]
        if flag in FLAG_SYNONYMS:
            hint = f"; did you mean {FLAG_SYNONYMS[flag]!r}?"
        else:
            hint = closest(flag, flags) if first.startswith("-") else ""
        raise ConfigError(f"unknown argument {first!r}{hint}")
    cfg = TrainConfig()
    if args.preset:
        cfg = config_from_mapping(load_toml(preset_path(args.preset)), cfg, f"preset {args.preset}")
    if args.config:
        cfg = config_from_mapping(load_toml(args.config), cfg, args.config)
    overrides = {k: v for k, v in vars(args).items() if k in FIELDS}
    cfg = dataclasses.replace(cfg, **overrides)
    if "data_root" in overrides and "dataset" not in overrides and cfg.dataset in ("synthetic", "folder", "recordio", "market1501"):
        # --data-root alone never means the synthetic demo: a release folder (train.rec) or a folder of identities.
        root = Path(cfg.data_root)
        if root.suffix == ".rec" or (root / "train.rec").is_file():
            cfg.dataset = "recordio"
        elif (root / "bounding_box_train").is_dir():
            cfg.dataset = "market1501"
        else:
            cfg.dataset = "folder"
    if cfg.dataset == "market1501" and "data_root" in overrides and "reid_root" not in overrides:
        # The release holds query/ and bounding_box_test/ beside bounding_box_train/: evaluate there.
        cfg.reid_root = cfg.data_root
    if cfg.output_dir == DEFAULT_OUTPUT_DIR and (args.preset or cfg.dataset != "synthetic"):
        # A first real run must not resume (and append to) the synthetic demo's folder.
        cfg.output_dir = f"shardfc_runs/{args.preset or cfg.dataset}"
    cfg.validate()
    check_flags_read(cfg, list(overrides))  # a flag this run would not read is refused, not dropped
    return cfg, args
