"""TOML files and the bundled presets: a config read from and written as TOML, flat or in ``[section]`` tables."""

from __future__ import annotations

import dataclasses
import os
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from shardfc import files
from shardfc.train.config.fields import FIELDS, ConfigError, TrainConfig
from shardfc.train.config.sections import SECTION_OF, SECTIONS, closest, coerce, type_name

__all__ = ["load_toml", "config_from_mapping", "to_toml", "available_presets", "preset_path"]


def load_toml(path: "str | os.PathLike[str]") -> Dict[str, Any]:
    """Parse a TOML config or preset into a dict through the file gate (:mod:`shardfc.files`: a
    regular file of at most 1 MiB, UTF-8, nested at most ``files.MAX_DEPTH`` deep); a ConfigError
    naming the file otherwise."""
    path = Path(path)
    try:
        return files.load_toml(path, "config")
    except files.FileMissing:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except files.FileRefused as e:
        raise ConfigError(str(e)) from None


def _once(flat: Dict[str, Any], name: str, where: str) -> None:
    """TOML refuses a key twice in one table; a field at the top and again under its section is two
    tables, and one of the values would win without a word."""
    if name in flat:
        raise ConfigError(f"{where}key {name!r} is set twice, at the top and under [{SECTION_OF[name]}]: keep one")


def _flatten(data: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """Flat ``{field: value}`` from a TOML mapping with optional section tables."""
    flat: Dict[str, Any] = {}
    where = f"{source}: " if source else ""
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, Mapping):
            for sub, subvalue in value.items():
                if sub in FIELDS and SECTION_OF[sub] != key:
                    raise ConfigError(f"{where}key {sub!r} belongs in [{SECTION_OF[sub]}], not [{key}]")
                if sub not in FIELDS:
                    raise ConfigError(f"{where}unknown key {key}.{sub}{closest(sub, SECTIONS[key] or FIELDS)}")
                _once(flat, sub, where)
                flat[sub] = subvalue
        elif key in FIELDS:
            if isinstance(value, Mapping):
                raise ConfigError(
                    f"{where}[{key}] is a table, but {key!r} is a field ({type_name(key)}): write '{key} = ...' "
                    f"at the top or under [{SECTION_OF[key]}]; the tables are {', '.join(f'[{s}]' for s in SECTIONS)}"
                )
            _once(flat, key, where)
            flat[key] = value
        else:
            raise ConfigError(f"{where}unknown key {key!r}{closest(key, list(FIELDS) + list(SECTIONS))}")
    return flat


def config_from_mapping(
    data: Mapping[str, Any], base: Optional[TrainConfig] = None, source: str = ""
) -> TrainConfig:
    """``base`` (default: the defaults) updated with ``data`` (flat or sectioned), type-checked.

    Range checks are left to :meth:`TrainConfig.validate`, run once everything is merged.
    """
    where = f"{source}: " if source else ""
    updates = {k: coerce(k, v, where) for k, v in _flatten(data, source).items()}
    return dataclasses.replace(base or TrainConfig(), **updates)


#: How a TOML basic string writes the characters it cannot hold as they are.
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quotes, backslashes and every control character escaped (a
    path may hold a newline; written raw, it would leave config.toml unreadable)."""
    out = (_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)
    return '"' + "".join(out) + '"'


def to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as a sectioned TOML document that :func:`config_from_mapping` reads back."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return _toml_string(v)
        return "[" + ", ".join(fmt(x) for x in v) + "]"

    lines = []
    for section, names in SECTIONS.items():
        lines.append(f"[{section}]")
        lines += [f"{name} = {fmt(getattr(cfg, name))}" for name in names]
        lines.append("")
    return "\n".join(lines)


# presets


def available_presets() -> List[str]:
    """Names of the bundled presets (``src/shardfc/presets/*.toml``)."""
    folder = resources.files("shardfc") / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def preset_path(name: str) -> Path:
    """Path of bundled preset ``name``; an unknown name names the closest one."""
    names = available_presets()
    if name not in names:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(names)}{closest(name, names)}")
    return Path(str(resources.files("shardfc") / "presets" / f"{name}.toml"))
