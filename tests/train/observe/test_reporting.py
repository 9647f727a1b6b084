"""What a run tells the person watching it (``train/observe/reporting.py``): the loss / lr / throughput
window, the report at a log point (its log line and metrics.csv rows, the divergence stop, corrupt
images named once and counted over ranks), the setup lines and the evaluation of targets.

In the test's process (ranks as threads where the report is collective): the trainer's own runs
(tests/train/test_trainer.py) reach this code too, but only in spawned ranks or through the whole loop.
"""

from __future__ import annotations

import csv
import logging
import math
import types

import pytest
import torch

from shardfc.parallel.context import DistContext
from shardfc.train.config import TrainConfig
from shardfc.train.observe import reporting
from shardfc.train.observe.reporting import ReportWindow, evaluate_targets, log_setup, report
from shardfc.train.observe.runlog import RunLog
from shardfc.train.state import Parts, RunState
from thread_world import ThreadWorld

ALONE = DistContext()  # no process group: one rank


class _Clock:
    """``time.time`` for reporting.py: the seconds a test sets."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(reporting, "time", c)
    return c


def _parts(lr: float = 0.05, fp16_scale: float | None = None) -> Parts:
    w = torch.nn.Parameter(torch.zeros(2))
    scaler = torch.amp.GradScaler("cpu", enabled=fp16_scale is not None, init_scale=fp16_scale or 1.0)
    return Parts(torch.nn.Linear(2, 2), None, torch.optim.SGD([w], lr=lr), None, [], scaler)


def _rows(path) -> list[tuple[int, str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [(int(r["step"]), r["name"], r["value"]) for r in csv.DictReader(f)]


@pytest.fixture
def runlog(tmp_path):
    with RunLog(tmp_path, is_main=True, progress=False) as log:
        log.start_at(0)
        log.skip_curves("a test")
        yield log


# ---------------------------------------------------------------------------- the window


def test_the_window_is_the_mean_loss_and_the_images_per_second_since_the_last_take(clock):
    state = RunState(samples_seen=100)
    window = ReportWindow(state)
    for loss, seen in ((2.0, 164), (4.0, 228), (9.0, 292)):
        clock.now += 0.5
        state.samples_seen = seen
        window.add(torch.tensor(loss), [("a.png", "truncated")] if loss == 4.0 else [])
    assert window.take() == (5.0, 192 / 1.5, [("a.png", "truncated")])
    clock.now += 2.0
    state.samples_seen += 64
    window.add(torch.tensor(1.0), [("b.png", "empty")])
    assert window.take() == (1.0, 32.0, [("b.png", "empty")])  # counted from the previous take, not the start


def test_a_window_without_steps_has_no_loss_and_never_divides_by_no_time(clock):
    window = ReportWindow(RunState(samples_seen=8))
    loss, rate, corrupt = window.take()
    assert math.isnan(loss) and rate == 0.0 and corrupt == []
    window.state.samples_seen = 9
    assert window.take()[1] == pytest.approx(1e9)  # a step within the clock's resolution: a large rate, no error


def test_the_window_keeps_the_loss_on_its_device_until_the_take():
    window = ReportWindow(RunState())
    for v in (1.5, 2.5):
        window.add(torch.tensor(v, dtype=torch.float64), [])
    assert isinstance(window.loss, torch.Tensor) and window.steps == 2  # no float() per step: no host sync
    assert window.take()[0] == 2.0
    assert window.loss is None and window.steps == 0 and window.corrupt == []


# ---------------------------------------------------------------------------- the report


def test_a_report_logs_the_step_and_writes_its_scalars(runlog, clock, tmp_path, caplog):
    state = RunState(step=40, epoch=3, samples_seen=0)
    window = ReportWindow(state)
    clock.now += 2.0
    state.samples_seen = 512
    window.add(torch.tensor(3.0), [])
    window.add(torch.tensor(4.0), [])
    shown = []
    runlog.set_postfix = shown.append  # the progress bar's (drawn only on a terminal)
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        report(runlog, window, _parts(lr=0.0125), state, 100, ALONE)
    assert caplog.messages[-1] == "step 40/100  epoch 3  loss 3.5000  lr 0.0125  256 images/s"
    assert shown == [{"loss": 3.5, "lr": 0.0125, "img/s": 256.0}]
    assert _rows(tmp_path / "metrics.csv") == [
        (40, "train/loss", "3.5"), (40, "train/lr", "0.0125"), (40, "train/images_per_s", "256"), (40, "train/epoch", "3"),
    ]


def test_an_fp16_run_also_records_its_loss_scale(runlog, tmp_path):
    window = ReportWindow(RunState(step=5))
    window.add(torch.tensor(1.0), [])
    report(runlog, window, _parts(fp16_scale=1024.0), window.state, 10, ALONE)
    assert (5, "train/loss_scale", "1024") in _rows(tmp_path / "metrics.csv")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_diverged_loss_stops_the_run_with_what_to_change(runlog, tmp_path, bad):
    window = ReportWindow(RunState(step=7))
    window.add(torch.tensor(1.0), [])
    window.add(torch.tensor(bad), [])  # one bad step in the window is enough
    with pytest.raises(FloatingPointError) as info:
        report(runlog, window, _parts(), window.state, 10, ALONE)
    assert str(info.value) == (f"the training loss is {bad} at step 7: training diverged; lower --lr, raise "
                               "--warmup-steps or set --grad-clip")
    assert _rows(tmp_path / "metrics.csv") == []  # nothing logged as if the step were fine


def test_a_report_on_another_rank_logs_and_writes_nothing(tmp_path, caplog):
    with RunLog(tmp_path, is_main=False, progress=False) as log:
        log.start_at(0)
        window = ReportWindow(RunState(step=2))
        window.add(torch.tensor(1.0), [])
        with caplog.at_level(logging.INFO, logger="shardfc.train"):
            report(log, window, _parts(), window.state, 4, DistContext(rank=1, world_size=2))
    assert not caplog.records and not (tmp_path / "metrics.csv").exists()
    assert window.steps == 0  # its window was taken all the same


def _report_on_ranks(tmp_path, corrupt_by_rank, named=(), max_corrupt=-1, step=10):
    """Two ranks (threads) each report a window holding their own corrupt images, after ``named`` were
    named at earlier reports; returns (the messages logged, each rank's named set or exception)."""
    world = ThreadWorld(2, timeout=20.0)
    records: list[logging.LogRecord] = []
    keep = logging.Handler()
    keep.emit = records.append
    lib = logging.getLogger("shardfc.train")
    lib.addHandler(keep)

    def rank(r):
        window = ReportWindow(RunState(step=step), max_corrupt)
        window.named.update(named)  # a new window names none yet
        window.add(torch.tensor(1.0), corrupt_by_rank[r])
        report(log, window, _parts(), window.state, 100, world.context())
        return window.named

    try:
        with RunLog(tmp_path, is_main=True, progress=False) as log:  # rank 1's writes are skipped by is_main
            log.start_at(0)
            log.skip_curves("a test")
            out = world.run(rank)
    finally:
        lib.removeHandler(keep)
    return [rec.getMessage() for rec in records], out


def _step_line(messages: list[str]) -> str:
    (line,) = [m for m in messages if m.startswith("step ")]
    return line


def test_corrupt_images_met_on_any_rank_are_named_once_by_rank_0_and_counted(tmp_path):
    corrupt = [[("b.png", "truncated"), ("a.png", "empty"), ("b.png", "truncated")], [("a.png", "empty"), ("c.png", "bad")]]
    messages, named = _report_on_ranks(tmp_path, corrupt, named={"c.png"})  # c.png was named at an earlier report
    assert named == [{"a.png", "b.png", "c.png"}] * 2  # every rank holds the same set
    warnings = [m for m in messages if m.startswith("corrupt image")]
    assert warnings == [
        "corrupt image skipped (the next valid sample is used instead): a.png (empty)",
        "corrupt image skipped (the next valid sample is used instead): b.png (truncated)",
    ]
    # the count is of skips (5 over both ranks), not of distinct images
    assert _step_line(messages) == "step 10/100  epoch 0  loss 1.0000  lr 0.05  0 images/s  (5 corrupt image(s) skipped)"
    assert (10, "data/corrupt_skipped", "5") in _rows(tmp_path / "metrics.csv")


def test_past_max_corrupt_images_every_rank_stops_at_the_same_report(tmp_path):
    corrupt = [[("a.png", "empty")], [("b.png", "bad")]]
    _, out = _report_on_ranks(tmp_path, corrupt, max_corrupt=1, step=12)
    assert all(isinstance(e, ValueError) for e in out)  # none left waiting in a collective
    assert str(out[0]) == ("2 different corrupt images skipped by step 12, more than max_corrupt_images=1 (train.log "
                           "names each): fix or remove them, or raise --max-corrupt-images (-1: no limit)")
    _, out = _report_on_ranks(tmp_path, corrupt, max_corrupt=2)
    assert out == [{"a.png", "b.png"}] * 2  # at the limit: on
    _, out = _report_on_ranks(tmp_path, corrupt, max_corrupt=0, named={"a.png", "b.png"}, step=14)
    assert all(isinstance(e, ValueError) for e in out) and "2 different corrupt images skipped by step 14" in str(out[1])


def test_a_report_without_corrupt_images_says_nothing_of_them(tmp_path):
    messages, out = _report_on_ranks(tmp_path, [[], []], max_corrupt=0)
    assert out == [set(), set()] and _step_line(messages) == "step 10/100  epoch 0  loss 1.0000  lr 0.05  0 images/s"
    assert all(name != "data/corrupt_skipped" for _, name, _ in _rows(tmp_path / "metrics.csv"))


# ---------------------------------------------------------------------------- evaluation


def test_targets_are_evaluated_logged_and_recorded_unless_told_not_to(runlog, tmp_path, caplog, monkeypatch, clock):
    target = types.SimpleNamespace(name="lfw", description="1000 pairs")
    seen = []

    def run_targets(targets, module, skip_non_finite):
        seen.append((targets, module, skip_non_finite))
        clock.now += 2.5
        return {"lfw": {"accuracy": 0.75}}

    monkeypatch.setattr(reporting, "run_targets", run_targets)
    parts = _parts()
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        assert evaluate_targets([target], parts, 30, runlog) == {"lfw": {"accuracy": 0.75}}
        assert evaluate_targets([target], parts, 30, runlog, record=False) == {"lfw": {"accuracy": 0.75}}
    assert seen == [([target], parts.module, True)] * 2  # a target whose embeddings are not finite: skipped
    assert _rows(tmp_path / "metrics.csv") == [(30, "val/lfw/accuracy", "0.75")]  # once
    assert caplog.messages == ["eval step 30  lfw: accuracy 75.00% ± 0.00  (1000 pairs)", "evaluation took 2.5 s"] * 2
    assert evaluate_targets([], parts, 31, runlog) == {} and len(seen) == 2  # nothing to evaluate: nothing run


def test_a_target_whose_embeddings_are_not_finite_is_neither_logged_as_evaluated_nor_recorded(runlog, tmp_path, caplog):
    from shardfc.evaluation.finite import check_finite
    from shardfc.train.observe.evaluate import EvalTarget

    targets = [EvalTarget("agedb_30", "", lambda model: check_finite("embeddings_a", torch.tensor([[float("inf")]]))),
               EvalTarget("lfw", "1000 pairs", lambda model: {"accuracy": 0.5})]
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        assert evaluate_targets(targets, _parts(), 40, runlog) == {"lfw": {"accuracy": 0.5}}  # the run trains on
    assert _rows(tmp_path / "metrics.csv") == [(40, "val/lfw/accuracy", "0.5")]
    assert caplog.messages[0].startswith("agedb_30 not evaluated: embeddings_a holds NaN or inf in 1 of 1 rows")
    assert caplog.messages[1] == "eval step 40  lfw: accuracy 50.00% ± 0.00  (1000 pairs)"


# ---------------------------------------------------------------------------- the setup lines


class _Data(list):
    num_classes = 10

    def __str__(self):
        return "synthetic"


class _Batches:
    batch_size, p, k = 8, 16, 4

    def __len__(self):
        return 3


def _setup_lines(cfg: TrainConfig, ctx, head, pipeline=None, triplet=None, amp=torch.bfloat16, **run) -> list:
    """What ``log_setup`` logs for a run of 500 steps on 40 images (a backbone of 1.00M parameters)."""
    parts = _parts()
    parts.backbone = torch.nn.Linear(1000, 1001)
    parts.head, parts.triplet = head, triplet
    replicas = 2 if pipeline is not None else ctx.world_size
    run = types.SimpleNamespace(**{"dataset": _Data(range(40)), "parts": parts, "image_size": (112, 96), "amp_dtype": amp,
                                   "batches": _Batches(), "total_steps": 500, "pipeline": pipeline,
                                   "data_ctx": types.SimpleNamespace(world_size=replicas), **run})
    records = []
    keep = logging.Handler()
    keep.emit = records.append
    lib = logging.getLogger("shardfc.train")
    lib.addHandler(keep)
    level = lib.level
    lib.setLevel(logging.INFO)
    try:
        log_setup(cfg, ctx, run)
    finally:
        lib.removeHandler(keep)
        lib.setLevel(level)
    return [(r.levelname, r.getMessage()) for r in records]


def test_the_setup_lines_of_a_plain_run():
    cfg = TrainConfig(output_dir="/runs/a", batch_size=8, grad_accum=3, warmup_steps=10, lr=0.1)
    head = types.SimpleNamespace(devices=[torch.device("cpu")], mode="ranks", margin="ArcFace(s=64.0, m=0.5)",
                                 num_classes=10, class_range=range(0, 5))
    ctx = types.SimpleNamespace(world_size=2, device=torch.device("cpu"), backend="gloo")
    assert _setup_lines(cfg, ctx, head) == [
        ("INFO", "shardfc train: 2 rank(s) on cpu (gloo), strategy ddp, output /runs/a"),
        ("INFO", "data: synthetic, 40 images, 10 classes, 112x96 input"),
        ("INFO", "model: tiny (1.00M parameters) -> 128-d embeddings; head ArcFace(s=64.0, m=0.5) over 10 classes, "
                 "5 per rank (rank 0: 0..4)"),
        ("INFO", "optimisation: sgd lr 0.1, poly schedule, 10 warm-up steps; 500 steps of 48 images (8 per rank x 2 "
                 "rank(s) x 3 accumulated), 3 micro-batches per epoch per rank; precision bfloat16"),
    ]


def test_the_setup_lines_of_a_re_id_run_over_the_devices_of_one_process():
    cfg = TrainConfig(output_dir="/runs/b", strategy="dp", batch_size=8, warmup_steps=10, lr=0.05, optimizer="adamw",
                      scheduler="cosine", sample_rate=0.1, subcenters=2, interclass_filter_threshold=0.75, compile=False,
                      num_workers=4, triplet_weight=1.5, sampler="pk", random_erasing=0.5)
    head = types.SimpleNamespace(devices=[torch.device("cuda", 0), torch.device("cuda", 1)], mode="devices",
                                 margin="CosFace(s=64.0, m=0.35)", num_classes=10, class_range=range(0, 10))
    ctx = types.SimpleNamespace(world_size=1, device=torch.device("cuda"), backend=None)
    assert _setup_lines(cfg, ctx, head, triplet="BatchHardTriplet(margin=0.3)", amp=None, channels_last=True) == [
        ("INFO", "shardfc train: 1 rank(s) on 2 cuda devices (no process group), strategy dp, output /runs/b"),
        ("INFO", "data: synthetic, 40 images, 10 classes, 112x96 input"),
        ("INFO", "model: tiny (1.00M parameters) -> 128-d embeddings; head CosFace(s=64.0, m=0.35) over 10 classes, "
                 "10 per rank (rank 0: 0..9), 2 sub-centres per class, inter-class filter at cos > 0.75"),
        ("INFO", "optimisation: adamw lr 0.05, cosine schedule, 10 warm-up steps; 500 steps of 8 images (8 per rank x 1 "
                 "rank(s) x 1 accumulated), 3 micro-batches per epoch per rank; precision fp32; Partial FC sample_rate 0.1"),
        ("INFO", "speed: backbone in channels_last memory format; 4 loader worker(s) per rank, the next batch copied to "
                 "the GPU on a side stream"),
        ("INFO", "re-ID recipe: + 1.5 x batch-hard triplet (BatchHardTriplet(margin=0.3)) on the pre-neck features; "
                 "sampler pk (16 identities x 4 images per global batch); random erasing p=0.5"),
    ]


def test_the_setup_lines_of_a_pipelined_run():
    cfg = TrainConfig(output_dir="/runs/c", strategy="pipeline", batch_size=8, warmup_steps=10, lr=0.1, micro_batches=4,
                      backbone="iresnet50", compile=True, random_erasing=0.25)
    layout = types.SimpleNamespace(stages=3, replicas=2, rank_of=lambda stage, replica: 2 * stage + replica)
    plan = types.SimpleNamespace(layout=layout, split_points=["body.2", "body.5"])
    ctx = types.SimpleNamespace(world_size=6, device=torch.device("cpu"), backend="gloo")
    assert _setup_lines(cfg, ctx, None, pipeline=plan, amp=torch.float16) == [
        ("INFO", "shardfc train: 6 rank(s) on cpu (gloo), strategy pipeline, output /runs/c"),
        ("INFO", "data: synthetic, 40 images, 10 classes, 112x96 input"),
        ("INFO", "pipeline: 3 stages x 2 replicas, cut after body.2, body.5; 1f1b schedule over 4 micro-batches; head "
                 "sharded over the last stage's 2 rank(s) (ranks 4..5); rank 0's stage: 1.00M parameters"),
        ("INFO", "model: iresnet50 -> 128-d embeddings; head arcface over 10 classes"),
        ("INFO", "optimisation: sgd lr 0.1, poly schedule, 10 warm-up steps; 500 steps of 16 images (8 per rank x 2 "
                 "rank(s) x 1 accumulated), 3 micro-batches per epoch per rank; precision float16"),
        ("INFO", "speed: backbone in contiguous (NCHW) memory format, torch.compile'd; 0 loader worker(s) per rank"),
        ("INFO", "re-ID recipe: no triplet loss; sampler random; random erasing p=0.25"),
    ]


@pytest.mark.parametrize("recipe, line", [
    ({"triplet": "Triplet", "triplet_weight": 0.5}, "re-ID recipe: + 0.5 x batch-hard triplet (Triplet) on the pre-neck "
                                                    "features; sampler random; random erasing p=0"),
    ({"sampler": "pk"}, "re-ID recipe: no triplet loss; sampler pk (16 identities x 4 images per global batch); random "
                        "erasing p=0"),
    ({"random_erasing": 0.1}, "re-ID recipe: no triplet loss; sampler random; random erasing p=0.1"),
    ({}, None),
])
def test_any_part_of_the_re_id_recipe_gets_its_line(recipe, line):
    cfg = TrainConfig(output_dir="/runs/e", **{k: v for k, v in recipe.items() if k != "triplet"})
    ctx = types.SimpleNamespace(world_size=1, device=torch.device("cpu"), backend=None)
    head = types.SimpleNamespace(devices=[torch.device("cpu")], mode="ranks", margin="ArcFace", num_classes=10,
                                 class_range=range(0, 10))
    last = _setup_lines(cfg, ctx, head, triplet=recipe.get("triplet"))[-1][1]
    assert last == line if line else last.startswith("optimisation: ")


@pytest.mark.parametrize("total, warned", [(10, True), (9, True), (11, False)])
def test_a_warm_up_as_long_as_the_run_is_warned_of(total, warned):
    cfg = TrainConfig(output_dir="/runs/d", warmup_steps=10, lr=0.1)
    head = types.SimpleNamespace(devices=[torch.device("cpu")], mode="ranks", margin="ArcFace", num_classes=10,
                                 class_range=range(0, 10))
    ctx = types.SimpleNamespace(world_size=1, device=torch.device("cpu"), backend=None)
    lines = _setup_lines(cfg, ctx, head, total_steps=total)
    warning = ("WARNING", f"warmup_steps=10 >= the {total} steps of this run: the learning rate never reaches lr=0.1")
    assert (lines[-1] == warning) == warned and len(lines) == 4 + warned


@pytest.mark.parametrize("per_rank_images, warned", [(7, True), (8, False), (20, False), (None, False)])
def test_a_batch_larger_than_a_ranks_epoch_is_warned_of(per_rank_images, warned):
    """--batch-size 100000000 on 20,000 images logged '1 steps of 100000000 images' and trained on 20,000."""
    cfg = TrainConfig(output_dir="/runs/f", warmup_steps=10, lr=0.1)
    head = types.SimpleNamespace(devices=[torch.device("cpu")], mode="ranks", margin="ArcFace", num_classes=10,
                                 class_range=range(0, 10))
    ctx = types.SimpleNamespace(world_size=2, device=torch.device("cpu"), backend="gloo")
    batches = _Batches()  # 8 images a micro-batch
    if per_rank_images is not None:  # ShardBatches' sampler; P x K batches have none (always full)
        batches.sampler = types.SimpleNamespace(num_samples=per_rank_images)
    lines = _setup_lines(cfg, ctx, head, batches=batches)
    warning = ("WARNING", f"batch_size=8 exceeds the {per_rank_images} images each rank gets per epoch (40 in the set "
                          f"over 2 rank(s)): every micro-batch is a whole epoch of {per_rank_images}, not 8")
    assert (warning in lines) == warned and len(lines) == 4 + warned
