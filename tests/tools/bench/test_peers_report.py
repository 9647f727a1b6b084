"""``bench --peers``'s output functions (``tools/bench/peers_report.py``) on a made-up result: the
exact lines a reader sees, the JSON's fields, and what the plot draws for each row. The run that
produces a real result is held in test_peers.py."""

from __future__ import annotations

import json
import textwrap

import pytest
from matplotlib.colors import to_rgba
from matplotlib.font_manager import FontProperties

from shardfc.head.margins import build_margin
from shardfc.tools.bench import peers_report
from shardfc.tools.bench.peers import ROW_FIELDS
from shardfc.tools.bench.report import MEASURES


def _row(label, group="margin", status="ok", **values):
    row = {k: None for k in ROW_FIELDS} | {"system": label.lower(), "label": label, "group": group,
                                             "status": status, "note": ""}
    return row | values


def _result(rows=None, dtype="bfloat16", interpret=True, measure="cpu_live_tensors"):
    return {
        "environment": {"device": "cpu", "torch": "2.13.0", "cuda": None, "triton": "3.9.0", "triton_interpret": interpret},
        "workload": {"batch": 8, "dim": 16, "classes": 12345, "margin": "arcface", "dtype": dtype, "sample_rate": 0.1,
                     "chunk_size": 256, "steps": 10, "warmup": 3},
        "memory_measure": measure, "loss_rtol": 1e-4, "references": {"margin": 1.5, "softmax": 2.5},
        "rows": rows if rows is not None else [],
    }


ROWS = [
    _row("Floor", group="floor", step_time_ms=0.5, extra_memory_bytes=3 * 2**20, note="3 GEMMs"),
    _row("Shardfc torch", step_time_ms=1.23456, ratio_to_floor=2.469, extra_memory_bytes=1536, loss=1.234567,
         reference_loss=1.2345, loss_rel_err=5.4e-5, loss_agrees=True),
    _row("Liger", group="softmax", status="unavailable", reason="needs CUDA"),
    _row("CCE", group="softmax", step_time_ms=20.0, ratio_to_floor=40.0, extra_memory_bytes=None, loss=3.0,
         reference_loss=2.5, loss_rel_err=0.2, loss_agrees=False, note="bf16"),
]


@pytest.mark.parametrize("n, text", [
    (None, "—"), (0, "0.0 KiB"), (1536, "1.5 KiB"), (2**20 - 1, "1,024.0 KiB"), (2**20, "1.00 MiB"),
    (2**30 - 2**10, "1,024.00 MiB"), (2**30, "1.00 GiB"), (5 * 2**40, "5,120.00 GiB"),
])
def test_bytes_are_shown_in_the_largest_unit_they_fill(n, text):
    assert peers_report.human_bytes(n) == text


def test_the_header_says_what_ran_where_and_how_it_was_measured():
    margin = build_margin("arcface")
    assert peers_report.header(_result()) == [
        "device: cpu; torch 2.13.0 (CUDA None), triton 3.9.0, TRITON_INTERPRET=1",
        f"workload (one rank's): B=8 D=16 C=12,345, {margin}, bfloat16 autocast compute, fp32 centres, "
        "SGD momentum 0.9 wd 5e-4; Partial FC r=0.1, chunk_size=256",
        f"step ms: median of 10 steps after a check step and 3 warm-up, synchronised; extra memory: "
        f"{MEASURES['cpu_live_tensors']}",
        "loss: the first step's, against shardfc.reference_loss on the same inputs and centres "
        "(relative error; agrees within 0.0001)",
    ]
    plain = peers_report.header(_result(dtype="float32", interpret=False, measure="rss"))
    assert plain[0] == "device: cpu; torch 2.13.0 (CUDA None), triton 3.9.0"
    assert ", fp32 (no autocast) compute, " in plain[1]
    assert plain[2].endswith("; extra memory: rss")  # a measure without a description: its name


def test_the_table_keeps_every_row_in_place_with_its_cells():
    table = peers_report.markdown_table(_result(ROWS))
    lines = table.split("\n")
    assert lines[:4] == peers_report.header(_result(ROWS))
    assert lines[4:] == [
        "",
        "| system | step ms | × floor | extra memory | loss (rel. err.) | note |",
        "|---|---:|---:|---:|---:|---|",
        "| Floor | 0.500 | — | 3.00 MiB | — | 3 GEMMs |",
        "| Shardfc torch | 1.235 | 2.47 | 1.5 KiB | 1.2346 (5.4e-05) |  |",
        "| Liger | — | — | — | — | unavailable: needs CUDA |",
        "| CCE | 20.000 | 40.00 | — | 3 (2.0e-01) **disagrees** | bf16 |",
    ]
    # a loss with no reference to hold it to: the loss alone
    lone = _row("X", step_time_ms=1.0, extra_memory_bytes=0, loss=0.123456789)
    assert peers_report.markdown_table(_result([lone])).split("\n")[-1] == "| X | 1.000 | — | 0.0 KiB | 0.12346 |  |"


def test_the_json_has_the_documented_fields_and_no_others(tmp_path):
    extra = [r | {"internal": object()} for r in ROWS]  # a field outside ROW_FIELDS is not written
    result = _result(extra) | {"unlisted": 1}
    path = tmp_path / "new" / "folder" / "peers.json"
    peers_report.write_json(result, str(path))
    text = path.read_text()
    assert text.endswith("}\n") and text.startswith('{\n  "workload": {')  # indented, one trailing newline
    doc = json.loads(text)
    assert list(doc) == ["workload", "environment", "memory_measure", "loss_rtol", "references", "rows"]
    assert doc["workload"] == result["workload"] and doc["references"] == {"margin": 1.5, "softmax": 2.5}
    assert [list(r) for r in doc["rows"]] == [list(ROW_FIELDS)] * len(ROWS)
    assert doc["rows"] == json.loads(json.dumps(ROWS))


def _drawn(monkeypatch, tmp_path, rows, result=None):
    """The figure ``plot`` saves (and where), for ``rows`` in a made-up result, or for ``result``."""
    saved = {}
    monkeypatch.setattr(peers_report, "save_png", lambda fig, path: saved.update(fig=fig, path=path))
    peers_report.plot(result or _result(rows), str(tmp_path / "p.png"))
    return saved["fig"], saved["path"]


def test_the_plot_draws_a_bar_per_row_that_ran_and_marks_the_others(monkeypatch, tmp_path):
    fig, path = _drawn(monkeypatch, tmp_path, ROWS)
    assert path == str(tmp_path / "p.png")
    step, memory = fig.axes[:2]
    heights = lambda ax: [(round(p.get_x() + p.get_width() / 2), p.get_height()) for p in ax.patches]  # noqa: E731
    assert heights(step) == [(0, 0.5), (1, 1.23456), (3, 20.0)]
    assert heights(memory) == [(0, 3.0), (1, 1536 / 2**20)]  # MiB; CCE's memory unknown
    colours = [p.get_facecolor() for p in step.patches]
    assert colours == [to_rgba("tab:gray"), to_rgba("tab:blue"), to_rgba("tab:orange")]
    # 'n/a' where a row did not run (Liger, both panels) or its value is unknown (CCE's memory)
    na = lambda ax: [t.xy[0] for t in ax.texts if t.get_text() == "n/a"]  # noqa: E731
    assert na(step) == [2] and na(memory) == [2, 3]
    # the step panel says each bar's ms and its ratio to the floor, where there is one
    notes = [(t.xy, t.get_text()) for t in step.texts if t.get_text() != "n/a"]
    assert notes == [((1, 1.23456), "1.23\n2.47×"), ((3, 20.0), "20\n40.00×")]
    assert not [t for t in memory.texts if t.get_text() != "n/a"]
    # 20 ms is over 30x the floor's 0.5: a log scale, said in the label; memory's 3 MiB / 1.5 KiB too
    assert step.get_yscale() == "log" and step.get_ylabel() == "step (ms), log scale"
    assert memory.get_yscale() == "log" and memory.get_ylabel() == "extra memory (MiB), log scale"
    assert [t.get_text() for t in memory.get_xticklabels()] == ["Floor", "Shardfc torch", "Liger", "CCE"]
    assert [t.get_text() for t in step.get_legend().get_texts()] == ["floor", "margin", "softmax"]
    title = fig._suptitle.get_text()
    assert title.startswith("device: cpu; torch 2.13.0") and "workload (one rank's): B=8" in title
    assert "step ms:" not in title  # the first two header lines only
    assert title == "\n".join(textwrap.fill(h, 140) for h in peers_report.header(_result(ROWS))[:2])
    assert max(map(len, title.split("\n"))) > 100  # the workload line is not wrapped at 70
    assert step.get_shared_x_axes().joined(step, memory)  # one set of labels under both panels
    assert step.margins()[1] == memory.margins()[1] == 0.2  # room above the bars for their notes


def _points(size) -> float:
    return FontProperties(size=size).get_size_in_points()


def test_the_plots_notes_sit_on_their_bars_in_small_print(monkeypatch, tmp_path):
    fig, _ = _drawn(monkeypatch, tmp_path, ROWS)
    step, memory = fig.axes[:2]
    for t in step.texts + memory.texts:
        if t.get_text() == "n/a":  # at the foot of the panel, wherever its scale puts 0
            assert t.xy[1] == 0.01 and t.xycoords == ("data", "axes fraction"), t.xy
            assert t.get_color() == "gray" and t.get_fontsize() == _points("small")
        else:  # just above the bar's top
            assert t.xyann == (0, 2) and t.anncoords == "offset points" and t.get_fontsize() == _points("x-small")
        assert (t.get_ha(), t.get_va()) == ("center", "bottom")
    assert {ax.yaxis.label.get_fontsize() for ax in (step, memory)} == {_points("small")}
    assert {t.get_fontsize() for t in memory.get_xticklabels()} == {_points("x-small")}
    assert {t.get_fontsize() for t in step.get_legend().get_texts()} == {_points("small")}
    legend = {t.get_text(): h.get_facecolor() for t, h in zip(step.get_legend().get_texts(), step.get_legend().legend_handles)}
    assert legend == {g: to_rgba(c) for g, c in peers_report.COLOURS.items()}
    assert fig._suptitle.get_fontsize() == _points("x-small")
    assert not peers_report.pyplot().fignum_exists(fig.number)  # closed once saved: a long bench leaves no figures open


def test_a_row_that_failed_is_not_drawn_even_with_a_time_and_an_unknown_group_is_green(monkeypatch, tmp_path):
    rows = [_row("Floor", group="floor", step_time_ms=1.0, extra_memory_bytes=2**20),
            _row("Broken", status="FAILED", reason="loss disagrees", step_time_ms=2.0, extra_memory_bytes=2**20),
            _row("Other", group="elsewhere", step_time_ms=3.0, extra_memory_bytes=2**20)]
    fig, _ = _drawn(monkeypatch, tmp_path, rows)
    step = fig.axes[0]
    assert [round(p.get_x() + p.get_width() / 2) for p in step.patches] == [0, 2]
    assert [t.xy[0] for t in step.texts if t.get_text() == "n/a"] == [1]
    assert step.patches[1].get_facecolor() == to_rgba("tab:green")


@pytest.mark.parametrize("slowest, scale", [(30.0, "linear"), (30.5, "log")])
def test_a_log_scale_from_over_thirty_times_the_fastest(monkeypatch, tmp_path, slowest, scale):
    rows = [_row("Floor", group="floor", step_time_ms=1.0, extra_memory_bytes=2**20),
            _row("Slow", step_time_ms=slowest, extra_memory_bytes=2**20)]
    fig, _ = _drawn(monkeypatch, tmp_path, rows)
    assert fig.axes[0].get_yscale() == scale and fig.axes[1].get_yscale() == "linear"
    assert {ax.yaxis.label.get_fontsize() for ax in fig.axes[:2]} == {_points("small")}  # either scale


def test_the_plots_title_wraps_a_header_line_past_140_characters(monkeypatch, tmp_path):
    result = _result(ROWS)
    # a device name that makes the first header line 141 characters: wrapped once, at its last space
    short = len(peers_report.header(result)[0]) - len("cpu")
    result["environment"]["device"] = "GPU" + "x" * (141 - short - 3)
    line = peers_report.header(result)[0]
    assert len(line) == 141
    fig, _ = _drawn(monkeypatch, tmp_path, None, result)
    title = fig._suptitle.get_text().split("\n")
    assert title[:2] == line.rsplit(" ", 1) and max(map(len, title)) <= 140


def test_the_plot_keeps_a_linear_scale_when_the_rows_are_close_and_wraps_long_labels(monkeypatch, tmp_path):
    rows = [_row("Floor", group="floor", step_time_ms=1.0, extra_memory_bytes=2**20),
            _row("A rather long system label", step_time_ms=29.0, ratio_to_floor=29.0, extra_memory_bytes=29 * 2**20)]
    fig, _ = _drawn(monkeypatch, tmp_path, rows)
    step, memory = fig.axes[:2]
    assert step.get_yscale() == "linear" and step.get_ylabel() == "step (ms)"
    assert memory.get_yscale() == "linear" and memory.get_ylabel() == "extra memory (MiB)"
    assert [t.get_text() for t in memory.get_xticklabels()] == ["Floor", "A rather long\nsystem label"]
    fig, _ = _drawn(monkeypatch, tmp_path, [_row("Liger-Kernel fused linear CE", step_time_ms=1.0, extra_memory_bytes=1)])
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["Liger-Kernel\nfused linear\nCE"]  # 14 a line
    fig, _ = _drawn(monkeypatch, tmp_path, rows)
    assert fig.get_size_inches().tolist() == [8.0, 8.5]
    many = [_row(f"S{i}", step_time_ms=1.0, extra_memory_bytes=1) for i in range(10)]
    fig, _ = _drawn(monkeypatch, tmp_path, many)
    assert fig.get_size_inches().tolist() == pytest.approx([11.5, 8.5])  # 1.15 inch a bar past 8
