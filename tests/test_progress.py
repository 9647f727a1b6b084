"""``shardfc.progress``: a bar on a terminal only, and only when tqdm is there (``data`` and
``embed`` loop through it; their tests record what they ask of it)."""

from __future__ import annotations

import io

from shardfc import progress as progress_mod


def test_a_bar_on_a_terminal_only_and_when_tqdm_is_there(monkeypatch):
    import sys
    import types

    class Tty(io.StringIO):
        def isatty(self):
            return True

    made = []
    stand_in = types.ModuleType("tqdm")
    stand_in.tqdm = lambda iterable, **kw: made.append(kw) or iterable  # what tqdm is asked for
    monkeypatch.setitem(sys.modules, "tqdm", stand_in)
    assert progress_mod.progress([1, 2], 2, "pack") == [1, 2] and made == []  # not a terminal: no bar
    monkeypatch.setattr(progress_mod.sys, "stderr", Tty())
    assert progress_mod.progress([1, 2], 2, "verify") == [1, 2]
    assert made == [dict(total=2, desc="verify", unit="img", file=progress_mod.sys.stderr, dynamic_ncols=True,
                         leave=False)]
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: the iterable itself
    assert progress_mod.progress([3], 1, "verify") == [3] and len(made) == 1
