"""``shardfc data``'s command line (:mod:`shardfc.cli.data`) at its edges: each flag's default and
parse, each refusal word for word, what reaches the actions (stand-ins record it), the ``inspect``
table and the ``verify`` report. ``test_recordio.py`` runs the commands on real files."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from shardfc.cli import data as data_cli


def _parse(*argv):
    return data_cli.build_parser().parse_args(list(argv))


def test_each_actions_defaults():
    pack = _parse("pack", "s", "o")
    assert (pack.list_file, pack.root, pack.resize, pack.encode, pack.quality, pack.force) == (
        False, None, None, "auto", None, False)  # quality: 95 when a JPEG is encoded, refused when none is
    inspect = _parse("inspect", "p")
    assert (inspect.path, inspect.json, inspect.sample) == ("p", False, 8)
    shuffle = _parse("shuffle", "p", "o")
    assert (shuffle.seed, shuffle.force) == (0, False)
    assert _parse("verify", "p").json is False
    assert _parse("glyphs", "o").out == "o"


@pytest.mark.parametrize("argv", [["pack", "s", "o", "--forc"], ["inspect", "p", "--jso"], ["shuffle", "p", "o", "--see", "1"],
                                  ["verify", "p", "--jso"], ["glyphs", "o", "--forc"]])
def test_no_flag_is_taken_by_a_prefix(argv, capsys, monkeypatch):
    from shardfc.data import glyphs

    monkeypatch.setattr(glyphs, "build", lambda *a, **k: None)  # were "--forc" taken for --force: no fonts read
    assert data_cli.main(argv) == 2
    assert "unrecognized arguments: " in capsys.readouterr().err
    assert data_cli.main(["--hel"]) == 2  # nor "--help" by "--hel"


def test_an_action_is_required(capsys):
    assert data_cli.main([]) == 2
    assert capsys.readouterr().err.endswith(
        "error: the following arguments are required: {pack,inspect,shuffle,verify,glyphs}\n")


@pytest.mark.parametrize("text, size", [("4x6", (4, 6)), ("4X6", (4, 6)), (" 1 x 1 ", (1, 1))])
def test_a_size_is_height_x_width(text, size):
    assert data_cli._size_arg(text) == size


@pytest.mark.parametrize("text", ["0x6", "6x0", "4y6", "4x", "-1x4", "4097x4", "4x4097", "99999x99999"])
def test_a_size_that_is_not_one_is_refused(text):
    """Each side 1..4096, training's bound: a 99999x99999 resize asked 30 GB an image and never ended."""
    with pytest.raises(argparse.ArgumentTypeError) as info:
        data_cli._size_arg(text)
    assert str(info.value) == f"expected HEIGHTxWIDTH such as 112x112, each side 1..4096, got {text!r}"


def test_the_largest_size_is_trainings():
    assert data_cli._size_arg("4096x4096") == (4096, 4096) and data_cli.MAX_IMAGE_SIDE == 4096


@pytest.mark.parametrize("text, quality", [("1", 1), ("100", 100), ("95", 95)])
def test_a_quality_from_1_to_100(text, quality):
    assert data_cli._quality_arg(text) == quality


@pytest.mark.parametrize("text", ["0", "101", "-1", "abc", "50.5"])
def test_another_quality_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        data_cli._quality_arg(text)
    assert str(info.value) == f"JPEG quality must be an integer in 1..100, got {text!r}"


# ------------------------------------------------------------------ what reaches the actions


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(data_cli, "pack", lambda *a: seen.append(("pack", a)))
    monkeypatch.setattr(data_cli, "shuffle", lambda *a: seen.append(("shuffle", a)))
    return seen


def test_pack_passes_every_flag_on(tmp_path, calls):
    src = tmp_path / "faces"
    src.mkdir()
    assert data_cli.main(["pack", str(src), "out", "--resize", "4x6", "--encode", "jpeg", "--quality", "7", "--force"]) == 0
    listing = tmp_path / "l.txt"
    listing.write_text("")
    assert data_cli.main(["pack", str(listing), "out", "--list-file", "--root", "base"]) == 0
    assert data_cli.main(["pack", str(src), "out", "--resize", "4x6", "--quality", "8"]) == 0  # auto: JPEG when resized
    assert data_cli.main(["pack", str(src), "out", "--encode", "jpeg", "--quality", "9"]) == 0
    assert data_cli.main(["pack", str(src), "out", "--encode", "png"]) == 0
    assert calls == [("pack", (str(src), "out", False, None, (4, 6), "jpeg", 7, True)),
                     ("pack", (str(listing), "out", True, "base", None, "auto", 95, False)),
                     ("pack", (str(src), "out", False, None, (4, 6), "auto", 8, False)),
                     ("pack", (str(src), "out", False, None, None, "jpeg", 9, False)),
                     ("pack", (str(src), "out", False, None, None, "png", 95, False))]


@pytest.mark.parametrize("argv, said", [
    (["--encode", "png", "--quality", "7"], "got --encode png"),
    (["--encode", "png", "--resize", "4x6", "--quality", "7"], "got --encode png"),
    (["--quality", "7"], "got --encode auto without --resize"),
])
def test_a_quality_that_no_jpeg_encoding_would_use_is_refused(tmp_path, capsys, calls, argv, said):
    src = tmp_path / "faces"
    src.mkdir()
    assert data_cli.main(["pack", str(src), "out", *argv]) == 2
    assert capsys.readouterr().err == ("shardfc data pack: error: --quality applies to re-encoding as JPEG "
                                       f"(--encode jpeg, or --resize with --encode auto); {said}\n")
    assert calls == []


@pytest.mark.parametrize("action, out, blocking", [
    ("pack", "{tmp}/file", "{tmp}/file"),
    ("pack", "{tmp}/file/sub", "{tmp}/file"),
    ("shuffle", "{tmp}/file", "{tmp}/file"),
    ("shuffle", "{tmp}/file/x.rec", "{tmp}/file"),
    ("glyphs", "{tmp}/file", "{tmp}/file"),
    ("glyphs", "{tmp}/file/a/b", "{tmp}/file"),
])
def test_an_out_folder_where_a_file_stands_is_refused_before_any_work(tmp_path, capsys, calls, action, out, blocking,
                                                                      monkeypatch):
    from shardfc.data import glyphs

    monkeypatch.setattr(glyphs, "build", lambda *a, **k: calls.append(("glyphs", a)))  # not the system's fonts
    (tmp_path / "file").write_text("keep")
    (tmp_path / "faces").mkdir()
    out = out.format(tmp=tmp_path)
    argv = {"pack": ["pack", str(tmp_path / "faces"), out], "shuffle": ["shuffle", str(tmp_path), out],
            "glyphs": ["glyphs", out]}[action]
    assert data_cli.main(argv) == 2
    assert capsys.readouterr().err == (f"shardfc data {action}: error: OUT {out!r}: "
                                       f"{blocking.format(tmp=tmp_path)!r} is a file, not a folder\n")
    assert calls == [] and (tmp_path / "file").read_text() == "keep"


@pytest.mark.parametrize("out", [".", "new/deeper", "there", "there/x.rec"])
def test_an_out_folder_that_exists_or_can_be_made_is_no_obstacle(tmp_path, monkeypatch, calls, out):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "there").mkdir()
    assert data_cli.main(["shuffle", str(tmp_path), out]) == 0
    assert calls == [("shuffle", (str(tmp_path), out, 0, False))]


@pytest.mark.parametrize("action", ["shuffle", "glyphs"])
def test_a_negative_seed_is_refused_by_its_flag(tmp_path, capsys, calls, action):
    argv = ["shuffle", str(tmp_path), "out"] if action == "shuffle" else ["glyphs", "out"]
    assert data_cli.main([*argv, "--seed", "-1"]) == 2
    assert capsys.readouterr().err.endswith(
        f"shardfc data {action}: error: argument --seed: expected an integer >= 0, got '-1'\n")
    assert calls == []


def test_shuffle_passes_its_flags_on(tmp_path, calls):
    assert data_cli.main(["shuffle", str(tmp_path), "out", "--seed", "3", "--force"]) == 0
    assert data_cli.main(["shuffle", str(tmp_path), "out"]) == 0
    assert calls == [("shuffle", (str(tmp_path), "out", 3, True)), ("shuffle", (str(tmp_path), "out", 0, False))]


def test_a_source_of_the_wrong_kind_is_named(tmp_path, capsys, calls):
    listing = tmp_path / "l.txt"
    listing.write_text("")
    assert data_cli.main(["pack", str(tmp_path), "o", "--list-file"]) == 2
    assert capsys.readouterr().err == (
        f"shardfc data pack: error: --list-file given but SRC {str(tmp_path)!r} is not a file\n")
    assert data_cli.main(["pack", str(listing), "o"]) == 2
    assert capsys.readouterr().err == (
        f"shardfc data pack: error: SRC {str(listing)!r} is not a folder (pass --list-file for a list file)\n")
    assert calls == []


@pytest.mark.parametrize("argv, what", [(["pack", "{}", "o"], "SRC"), (["inspect", "{}"], "PATH"),
                                        (["shuffle", "{}", "o"], "PATH"), (["verify", "{}"], "PATH")])
def test_a_missing_input_is_named(tmp_path, capsys, argv, what):
    missing = str(tmp_path / "nope")
    assert data_cli.main([a.format(missing) for a in argv]) == 2
    assert capsys.readouterr().err == f"shardfc data {argv[0]}: error: {what} {missing!r} does not exist\n"


def test_inspect_prints_json_or_a_table(tmp_path, monkeypatch, capsys):
    info = {"rec": "r", "layout": "im2rec", "images": 1}
    seen = []
    monkeypatch.setattr(data_cli, "inspect", lambda path, sample: seen.append((path, sample)) or info)
    monkeypatch.setattr(data_cli, "_print_inspect", lambda i: print("table of", i["rec"]))
    assert data_cli.main(["inspect", str(tmp_path), "--json", "--sample", "3"]) == 0
    assert capsys.readouterr().out == json.dumps(info, indent=2) + "\n"
    assert data_cli.main(["inspect", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "table of r\n"
    assert seen == [(str(tmp_path), 3), (str(tmp_path), 8)]
    assert data_cli.main(["inspect", str(tmp_path), "--json", "--sample", "0"]) == 0  # none decoded: allowed
    assert seen[-1] == (str(tmp_path), 0)


@pytest.mark.parametrize("value", ["-3", "2.5", "many"])
def test_inspect_names_a_bad_sample_count(tmp_path, capsys, value):
    # a negative count was read as 0: no image decoded, and the table's sizes said "-" as if none could be
    assert data_cli.main(["inspect", str(tmp_path), "--sample", value]) == 2
    assert capsys.readouterr().err.endswith(f"error: argument --sample: expected an integer >= 0, got {value!r}\n")


def test_verify_reports_each_bad_record_and_exits_1(tmp_path, monkeypatch, capsys):
    result = {"rec": "x.rec", "layout": "im2rec", "images": 4,
              "bad": [{"key": 3, "reason": "bad magic"}, {"key": None, "reason": "property: too few"}]}
    monkeypatch.setattr(data_cli, "verify", lambda path: result)
    assert data_cli.main(["verify", str(tmp_path)]) == 1
    assert capsys.readouterr().out == "bad: key 3: bad magic\nbad: property: too few\nx.rec: 4 images, 2 bad record(s)\n"
    assert data_cli.main(["verify", str(tmp_path), "--json"]) == 1
    assert capsys.readouterr().out == json.dumps(result, indent=2) + "\n"
    monkeypatch.setattr(data_cli, "verify", lambda path: {**result, "bad": []})
    assert data_cli.main(["verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "x.rec: 4 images, 0 bad record(s)\n"


def test_glyphs_passes_every_option_on(monkeypatch, capsys):
    from shardfc.data import glyphs

    seen = []
    monkeypatch.setattr(glyphs, "build", lambda out, options, font_dirs, force: seen.append((out, options, font_dirs, force)))
    argv = ["glyphs", "o", "--fonts", "a", "b", "--image-size", "40", "--channels", "3", "--min-faces", "5",
            "--identities", "7", "--unseen-identities", "6", "--holdout-faces", "2", "--copies", "4", "--pairs", "40",
            "--seed", "9", "--force"]
    assert data_cli.main(argv) == 0
    assert seen == [("o", glyphs.GlyphOptions(image_size=40, channels=3, min_faces=5, identities=7, unseen_identities=6,
                                              holdout_faces=2, copies=4, pairs=40, seed=9), ["a", "b"], True)]
    assert data_cli.main(["glyphs", "p"]) == 0
    assert seen[-1] == ("p", glyphs.GlyphOptions(), None, False)

    def refuse(*a, **k):
        raise glyphs.GlyphError("no fonts")

    monkeypatch.setattr(glyphs, "build", refuse)
    assert data_cli.main(["glyphs", "o"]) == 2
    assert capsys.readouterr().err == "shardfc data glyphs: error: no fonts\n"


# ------------------------------------------------------------------ the inspect table


def test_the_inspect_table_of_a_packed_set():
    info = {"rec": "/d/train.rec", "layout": "insightface", "images": 9, "classes": 5, "classes_from": "property",
            "empty_classes": 3, "images_per_class": {"min": 0, "median": 1.5, "max": 7},
            "property": [5, 112, 96], "image_sizes_sampled": {"112x96": 7, "50x50": 1},
            "undecodable_in_sample": ["k: bad"], "rec_bytes": 3 * 2**20 // 10, "records": 15}
    out = io.StringIO()
    data_cli._print_inspect(info, out)
    assert out.getvalue() == (
        "file          /d/train.rec\n"
        "layout        insightface (header at key 0 + identity records)\n"
        "images        9\n"
        "classes       5 (from property)\n"
        "images/class  min 0, median 1.5, max 7; 3 class(es) without images\n"
        "image size    112x96 (7), 50x50 (1)  (of the first 9 images)\n"
        "property      5,112,96\n"
        "size          0.3 MiB, 15 records\n"
        "undecodable: k: bad\n")


def test_the_inspect_table_of_an_im2rec_file(capsys):
    info = {"rec": "x.rec", "layout": "im2rec", "images": 2, "classes": 2, "classes_from": "labels",
            "empty_classes": 0, "images_per_class": {"min": 1, "median": 1.0, "max": 1}, "property": None,
            "image_sizes_sampled": {}, "undecodable_in_sample": ["x.rec#key 0: bad", "x.rec#key 1: worse"],
            "rec_bytes": 2**19, "records": 2}
    data_cli._print_inspect(info)
    assert capsys.readouterr().out == (
        "file          x.rec\n"
        "layout        im2rec (no header)\n"
        "images        2\n"
        "classes       2 (from labels)\n"
        "images/class  min 1, median 1, max 1\n"
        "image size    -  (of the first 2 images)\n"
        "property      absent\n"
        "size          0.5 MiB, 2 records\n"
        "undecodable: x.rec#key 0: bad\n"
        "undecodable: x.rec#key 1: worse\n")


def test_shuffle_into_an_existing_rec_file_checks_its_folder_not_the_file(tmp_path, calls):
    """OUT ending in .rec names the file (replaced with --force): its folder must be one, the file may exist."""
    (tmp_path / "old.rec").write_bytes(b"rec")
    assert data_cli.main(["shuffle", str(tmp_path), str(tmp_path / "old.rec"), "--force"]) == 0
    assert calls == [("shuffle", (str(tmp_path), str(tmp_path / "old.rec"), 0, True))]


def test_help_exits_0_and_a_usage_error_2(capsys):
    assert data_cli.main(["--help"]) == 0
    assert data_cli.main(["pack"]) == 2
