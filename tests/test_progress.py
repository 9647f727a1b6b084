"""``shardfc.progress``: a bar on a terminal only, and only when tqdm is there (``data`` and
``embed`` loop through it; their tests record what they ask of it); evaluation's embedding loop draws
one only inside a label (``shardfc eval``'s, per target), never under training's own bar."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from shardfc import progress as progress_mod


def test_a_bar_on_a_terminal_only_and_when_tqdm_is_there(monkeypatch, bars):
    import sys
    import types

    terminal = progress_mod.sys  # the fixture's: stderr a terminal, tqdm a stand-in recording into bars
    monkeypatch.setattr(progress_mod, "sys", types.SimpleNamespace(stderr=io.StringIO()))
    assert progress_mod.progress([1, 2], 2, "pack") == [1, 2] and bars == []  # not a terminal: no bar
    monkeypatch.setattr(progress_mod, "sys", terminal)
    assert progress_mod.progress([1, 2], 2, "verify") == [1, 2]
    assert bars == [dict(total=2, desc="verify", unit="img", file=progress_mod.sys.stderr, dynamic_ncols=True,
                         leave=False)]
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: the iterable itself
    assert progress_mod.progress([3], 1, "verify") == [3] and len(bars) == 1


def test_a_counter_draws_on_a_terminal_only_and_when_tqdm_is_there(monkeypatch, bars):
    import sys
    import types

    bar = progress_mod.counter("replaying", "op")
    bar.update(1024)
    bar.close()
    assert bars == [dict(total=None, desc="replaying", unit="op", file=progress_mod.sys.stderr, dynamic_ncols=True,
                         leave=False, unit_scale=True, updated=1024, closed=True)]
    assert progress_mod.counter("x", "op", total=5) and bars[-1]["total"] == 5
    terminal = progress_mod.sys
    monkeypatch.setattr(progress_mod, "sys", types.SimpleNamespace(stderr=io.StringIO()))  # a log file or a pipe
    silent = progress_mod.counter("replaying", "op")
    silent.update(3)
    silent.close()
    monkeypatch.setattr(progress_mod, "sys", terminal)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed
    progress_mod.counter("replaying", "op").update(1)
    assert len(bars) == 2 and type(silent).__name__ == "_NoBar"


def test_a_labelled_bar_only_inside_a_label_and_the_label_ends_with_it(bars):
    assert progress_mod.labelled_bar([1, 2], 2) == [1, 2] and bars == []  # no label: no bar, even on a terminal
    with progress_mod.labelled("lfw"):
        assert progress_mod.labelled_bar([1, 2], 2) == [1, 2]
        with progress_mod.labelled("reid"):  # the nearest label names it
            progress_mod.labelled_bar([3], None, unit="img")
        progress_mod.labelled_bar([4], 1)
    assert [(kw["desc"], kw["total"], kw["unit"]) for kw in bars] == [
        ("lfw", 2, "batch"), ("reid", None, "img"), ("lfw", 1, "batch")]
    with pytest.raises(RuntimeError), progress_mod.labelled("ijbc"):
        raise RuntimeError  # an evaluation that fails
    progress_mod.labelled_bar([5], 1)
    assert len(bars) == 3  # its label ended with it


def test_embedding_shows_a_bar_of_its_batches_under_a_label_only(bars):
    from shardfc.evaluation.verification import embed_batches, embed_images

    torch.manual_seed(0)
    model, images = nn.Sequential(nn.Flatten(), nn.Linear(12, 3)), torch.randn(5, 3, 2, 2)
    plain = embed_images(model, images, batch_size=2)  # training's evaluations: no label, no bar
    assert bars == []
    with progress_mod.labelled("lfw"):
        assert torch.equal(embed_images(model, images, batch_size=2), plain)  # the bar changes nothing computed
        embed_batches(model, (b for b in images.split(2)))  # a generator: a count without an end
    assert [(kw["desc"], kw["total"], kw["unit"]) for kw in bars] == [("lfw", 3, "batch"), ("lfw", None, "batch")]
