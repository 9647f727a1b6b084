"""``TrainConfig``: every knob of ``shardfc train``, loadable from TOML and overridable by CLI flags.

Values are resolved in this order, later ones winning::

    TrainConfig defaults  <  --preset NAME (src/shardfc/presets/NAME.toml)  <  --config PATH  <  --flags

A TOML file may list the fields flat or under tables named after their section (``[data]``,
``[model]``, ``[head]``, ``[optim]``, ``[schedule]``, ``[run]``, ``[eval]``, ``[classes]``). Every field
is a flag ``--field-name`` (booleans also ``--no-field-name``; lists take several values, ``--betas 0.9
0.95``). Unknown keys and flags are errors that name the closest valid one. Each field's help text is
its attribute docstring, so the dataclass is the single source of truth for ``--help``.

    fields.py    TrainConfig (a docstring per field) and its rules (validate), ConfigError, absolute_paths
    sections.py  each field's section, type and help text; a value coerced to its field's type
    toml.py      TOML files read and written; the bundled presets
    flags.py     the flag parser (build_parser) and the resolution of it all (parse_config)
    targets.py   the evaluation targets a config plans: one name each, enough pairs (plan_targets)

The package answers every public name of its modules, as the single module ``shardfc.train.config``
did before it was split.
"""

from shardfc.train.config.fields import (
    DEFAULT_OUTPUT_DIR,
    MARGIN_ALIASES,
    MAX_EMBEDDING_DIM,
    MAX_IMAGE_SIDE,
    PATH_FIELDS,
    PIPELINE_REFUSES,
    PIPELINE_SCHEDULES,
    STRATEGIES,
    ConfigError,
    TrainConfig,
    absolute_paths,
)
from shardfc.train.config.flags import FLAG_ALIASES, FLAG_SYNONYMS, build_parser, parse_config
from shardfc.train.config.sections import SECTIONS, field_help
from shardfc.train.config.toml import available_presets, config_from_mapping, load_toml, preset_path, to_toml

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
    "absolute_paths",
    "DEFAULT_OUTPUT_DIR",
    "FLAG_ALIASES",
    "FLAG_SYNONYMS",
    "MARGIN_ALIASES",
    "MAX_EMBEDDING_DIM",
    "MAX_IMAGE_SIDE",
    "PATH_FIELDS",
    "PIPELINE_REFUSES",
    "PIPELINE_SCHEDULES",
]
