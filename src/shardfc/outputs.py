"""The files a command writes for the user (``export --out/--onnx/--fc``, ``embed --out``, the
``--json`` / ``--plot`` of ``bench`` and ``plan``): checked by flag before any work, and written
whole or not at all. A bottom layer, as :mod:`shardfc.files` (the reading gate) is: it imports
nothing of shardfc, so the commands and ``shardfc.tools`` both use it.

Checked up front because the work before the write (loading a checkpoint, tracing a model,
embedding a folder of images) can take minutes: a folder named as the file, or a folder that cannot
be made, is said then, by the flag that named it, not as a traceback about a scratch file after the
work. Written through a scratch file in the same folder and ``os.replace``: a crash or a full disk
never leaves a half-written file under the user's name, and the scratch file is removed on failure.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

__all__ = ["OutputRefused", "blocking_file", "check_folder", "check_output", "check_outputs", "write_atomically"]


class OutputRefused(ValueError):
    """A path named to write to cannot be one (a folder, a file in the way, a folder not makeable);
    the message names the flag and the path."""


def blocking_file(folder: Path) -> Optional[Path]:
    """The file standing at ``folder`` or at one of the folders above it (so that it cannot be made
    or written into), or None."""
    return next((f for f in (folder, *folder.parents) if f.exists() and not f.is_dir()), None)


def check_folder(flag: str, folder: Path) -> None:
    """Refuse output folder ``folder`` (named by ``flag``) when a file stands at it or above it:
    said before the work, not as ``FileExistsError`` when the results are to be written."""
    blocking = blocking_file(Path(folder))
    if blocking is not None:
        raise OutputRefused(f"{flag} {str(folder)!r}: {str(blocking)!r} is a file, not a folder")


def check_output(flag: str, path: Path, force: bool) -> None:
    """Refuse ``path`` (named by ``flag``) unless a file can be written there; make its folder."""
    if path.is_dir():
        raise OutputRefused(f"{flag} {str(path)!r} is a folder; name the file to write")
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to replace it")
    blocking = blocking_file(path.parent)
    if blocking is not None:
        raise OutputRefused(f"{flag} {str(path)!r}: {str(blocking)!r} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputRefused(f"{flag} {str(path)!r}: cannot make its folder ({e.strerror or e})") from None


def check_outputs(**given: "Optional[str]") -> None:
    """:func:`check_output` of each path given (None: not asked for), replacing allowed: the
    ``--json`` / ``--plot`` files of a benchmark, named by their flag (``json="a.json"`` is ``--json``)."""
    for name, path in given.items():
        if path is not None:
            check_output("--" + name.replace("_", "-"), Path(path), force=True)


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(scratch)`` then move the scratch file onto ``path``; an ``OSError`` names ``path``.

    The scratch file is created exclusively first (``O_EXCL``): in a shared folder a link planted
    under its name is never followed, and only a file this call made is ever removed."""
    scratch = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    made = False
    try:
        os.close(os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        made = True
        write(scratch)
        os.replace(scratch, path)
        made = False
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if made:
            scratch.unlink(missing_ok=True)
