"""Modules that moved when ``train/`` was arranged by concept and every command went to :mod:`shardfc.cli`,
still importable under their old names for one release.

Importing an old name imports the module's new home, registers that same module object under the
old name too (so ``monkeypatch``, ``pickle`` and ``isinstance`` see one module whichever name they
use) and warns once, with a :class:`DeprecationWarning` naming the new path. ``python -m`` needs
the new paths: an alias is a name in ``sys.modules``, not a file.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from typing import Dict

#: old dotted path -> new dotted path (removed in the release after next)
MOVED: Dict[str, str] = {
    # every command's module, one package
    "shardfc.train.cli": "shardfc.cli.train",
    "shardfc.train.cli_eval": "shardfc.cli.eval",
    "shardfc.train.cli_export": "shardfc.cli.export",
    "shardfc.train.cli_embed": "shardfc.cli.embed",
    "shardfc.train.cli_import": "shardfc.cli.import_arcface",
    "shardfc.data.cli": "shardfc.cli.data",
    "shardfc.tools.bench.cli": "shardfc.cli.bench",
    "shardfc.tools.bench.recipes_cli": "shardfc.cli.bench_recipes",
    "shardfc.tools.bench.peers_cli": "shardfc.cli.bench_peers",
    "shardfc.tools.demo": "shardfc.cli.demo",
    # train/ by concept: the training data
    "shardfc.train.data": "shardfc.train.loader.data",
    "shardfc.train.dali_loader": "shardfc.train.loader.dali_loader",
    "shardfc.train.prefetch": "shardfc.train.loader.prefetch",
    "shardfc.train.identity_sampler": "shardfc.train.loader.identity_sampler",
    # train/ by concept: what a run saves and starts from
    "shardfc.train.resume": "shardfc.train.checkpointing.resume",
    "shardfc.train.classes": "shardfc.train.checkpointing.classes",
    "shardfc.train.fine_tune": "shardfc.train.checkpointing.fine_tune",
    "shardfc.train.arcface_import": "shardfc.train.checkpointing.arcface_import",
    "shardfc.train.artifacts": "shardfc.train.checkpointing.artifacts",
    # train/ by concept: what a run tells and measures
    "shardfc.train.reporting": "shardfc.train.observe.reporting",
    "shardfc.train.runlog": "shardfc.train.observe.runlog",
    "shardfc.train.evaluate": "shardfc.train.observe.evaluate",
    "shardfc.train.phases": "shardfc.train.observe.phases",
    "shardfc.train.profile": "shardfc.train.observe.profile",
    "shardfc.train.memory_phases": "shardfc.train.observe.memory_phases",
    # train/ by concept: building a run (the factory, strategies, pipeline, precision)
    "shardfc.train.build": "shardfc.train.builder.factory",
    "shardfc.train.strategy": "shardfc.train.builder.strategy",
    "shardfc.train.pipeline_train": "shardfc.train.builder.pipeline_train",
    "shardfc.train.head_update": "shardfc.train.builder.head_update",
    "shardfc.train.cpu": "shardfc.train.builder.cpu",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of :data:`MOVED` and loads it as its new home's module object."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=_caller_level())
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system writes the alias's spec over it: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the module keeps its own name, file and spec


def _caller_level() -> int:
    """The stack level of the first frame outside the import system and this module (the ``import``
    statement, or the caller of ``importlib.import_module``), counted as :func:`warnings.warn` counts:
    without the import system's frozen frames, which it skips."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        frozen = "importlib" in name and "_bootstrap" in name  # warnings' own test of an internal frame
        if not frozen and name != __file__ and name != importlib.__file__:
            return level
        level += not frozen
        frame = frame.f_back
    return 1


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
