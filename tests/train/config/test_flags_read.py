"""A flag the run would not read is refused, naming the setting that leaves it unread, not dropped
(``--momentum`` beside ``--optimizer adamw`` trained with AdamW's own settings and said nothing)."""

from __future__ import annotations

import re

import pytest

from shardfc.train.config import ConfigError, TrainConfig, parse_config
from shardfc.train.config.fields import _MARGIN_FIELDS, _READ_WHEN

#: Each conditional flag: (its value, flags that make a run read it, the setting a default run has instead).
CASES = {
    "momentum": (["--momentum", "0.5"], ["--optimizer", "sgd"], ["--optimizer", "adamw"]),
    "nesterov": (["--nesterov"], ["--optimizer", "sgd"], ["--optimizer", "adamw"]),
    "betas": (["--betas", "0.8", "0.9"], ["--optimizer", "adamw"], ["--optimizer", "sgd"]),
    "eps": (["--eps", "1e-6"], ["--optimizer", "adamw"], ["--optimizer", "sgd"]),
    "poly_power": (["--poly-power", "3"], ["--scheduler", "poly"], ["--scheduler", "cosine"]),
    "pipeline_stages": (["--pipeline-stages", "4"], ["--strategy", "pipeline", "--nproc", "4", "--micro-batches", "4"],
                        ["--strategy", "ddp"]),
    "pipeline_schedule": (["--pipeline-schedule", "gpipe"], ["--strategy", "pipeline", "--nproc", "2"],
                          ["--strategy", "dp"]),
    "micro_batches": (["--micro-batches", "4"], ["--strategy", "pipeline", "--nproc", "2"], ["--strategy", "ddp"]),
    "split_points": (["--split-points", "layer1"], ["--strategy", "pipeline", "--nproc", "2", "--backbone", "resnet50"],
                     ["--strategy", "ddp"]),
    "micro_batch_stats": (["--micro-batch-stats"], ["--strategy", "pipeline", "--nproc", "2"], ["--strategy", "horovod"]),
    "nproc": (["--nproc", "3"], ["--strategy", "ddp"], ["--strategy", "dp"]),
    "head_init": (["--head-init", "imprint"], ["--resume", "auto"], ["--resume", "none"]),
    "on_missing_classes": (["--on-missing-classes", "keep"], ["--resume", "none", "--init-from", "/m.pt"],
                           ["--resume", "none"]),
    "rename_classes": (["--rename-classes", "/r.tsv"], ["--resume", "/run/checkpoints/step_00000010"],
                       ["--resume", "None"]),
    "list_file": (["--list-file", "/l.txt"], ["--dataset", "list"], ["--dataset", "synthetic"]),
    "synthetic_identities": (["--synthetic-identities", "7"], ["--dataset", "synthetic"],
                             ["--dataset", "list", "--list-file", "/l.txt"]),
    "synthetic_images_per_identity": (["--synthetic-images-per-identity", "3"], ["--dataset", "synthetic"],
                                      ["--dataset", "list", "--list-file", "/l.txt"]),
    "head_idle_rows": (["--head-idle-rows", "lazy"], ["--sample-rate", "0.5"], ["--sample-rate", "1"]),
    "pk_instances": (["--pk-instances", "3"], ["--sampler", "pk"], ["--sampler", "random"]),
    "triplet_soft": (["--triplet-soft"], ["--triplet-weight", "1"], ["--triplet-weight", "0"]),
    "triplet_margin": (["--triplet-margin", "0.2"], ["--triplet-weight", "1"], ["--triplet-weight", "1", "--triplet-soft"]),
    # dropped without a word before: evaluation settings of a run that evaluates nothing, synthetic pairs of a
    # dataset that has none, the rounding of a head that is not rounded
    "synthetic_val_pairs": (["--synthetic-val-pairs", "100"], ["--dataset", "synthetic"],
                            ["--dataset", "list", "--list-file", "/l.txt"]),
    "eval_flip": (["--no-eval-flip"], ["--synthetic-val-pairs", "20"], ["--synthetic-val-pairs", "0"]),
    "eval_batch_size": (["--eval-batch-size", "8"], ["--dataset", "synthetic"],
                        ["--dataset", "list", "--list-file", "/l.txt"]),
    "head_rounding": (["--head-rounding", "stochastic"], ["--head-dtype", "bfloat16"], ["--head-dtype", "float32"]),
    "eval_every": (["--eval-every", "100"], ["--synthetic-val-pairs", "20"], ["--synthetic-val-pairs", "0"]),
    "epochs": (["--epochs", "3"], ["--max-steps", "0"], ["--max-steps", "100"]),
    "drop_last": (["--drop-last"], ["--sampler", "random"], ["--sampler", "pk"]),
    "trust_checkpoint": (["--trust-checkpoint"], ["--resume", "auto"], ["--resume", "none"]),
    "chunk_size": (["--chunk-size", "64"], ["--head-impl", "auto"], ["--head-impl", "triton"]),
    "max_corrupt_images": (["--max-corrupt-images", "5"], ["--dataset", "folder", "--data-root", "/faces"],
                           ["--loader", "dali", "--dataset", "folder", "--data-root", "/faces"]),
}


@pytest.fixture(autouse=True)
def _dali_installed(monkeypatch):
    """--loader dali is checked for its package before the flags are: here it is taken as installed."""
    from shardfc.train.loader import dali_loader

    monkeypatch.setattr(dali_loader, "dali_missing", lambda: None)


def test_every_conditional_field_has_a_case():
    assert set(CASES) == set(_READ_WHEN)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_flag_is_taken_where_it_is_read_and_refused_where_it_is_not(name):
    flag, reading, not_reading = CASES[name]
    cfg, _ = parse_config([*reading, *flag])
    assert getattr(cfg, name) != getattr(TrainConfig(), name)  # taken
    _, what, decides = _READ_WHEN[name]
    if callable(decides):
        decides = decides(parse_config(not_reading)[0])
    with pytest.raises(ConfigError) as refused:
        parse_config([*not_reading, *flag])
    message = str(refused.value)
    assert message.startswith(f"--{name.replace('_', '-')} is read only with {what}, not by this run's {decides}=")
    assert message.endswith(f": remove it, or set --{decides.replace('_', '-')}")
    parse_config(not_reading)  # the setting alone is fine


def test_the_refusal_names_the_value_that_leaves_the_flag_unread():
    with pytest.raises(ConfigError, match=re.escape(
            "--momentum is read only with optimizer 'sgd', not by this run's optimizer='adamw': remove it, or set "
            "--optimizer")):
        parse_config(["--optimizer", "adamw", "--momentum", "0.5"])
    with pytest.raises(ConfigError, match=re.escape(
            "--triplet-margin is read only with the hinge triplet loss (triplet_weight > 0, no triplet_soft), not by "
            "this run's triplet_weight=1.0")):
        parse_config(["--triplet-weight", "1", "--triplet-soft", "--triplet-margin", "0.2"])


MARGIN_VALUES = {"scale": "30", "m": "0.4", "easy_margin": None, "sphereface_lambda": "5", "m1": "1.0", "m2": "0.3",
                 "m3": "0.1", "adaface_h": "0.4", "adaface_momentum": "0.02", "magface_l_a": "10", "magface_u_a": "110",
                 "magface_l_m": "0.45", "magface_u_m": "0.8", "magface_lambda_g": "30"}


def _margin_flag(name, margin):
    flag = f"--{name.replace('_', '-')}"
    if name == "m" and margin == "sphereface":  # its margin is an integer multiple of the angle
        return [flag, "2"]
    return [flag] if MARGIN_VALUES[name] is None else [flag, MARGIN_VALUES[name]]


@pytest.mark.parametrize("margin", sorted(_MARGIN_FIELDS))
def test_a_margins_own_flags_are_taken_and_the_others_refused(margin):
    fields = {name for names in _MARGIN_FIELDS.values() for name in names}
    assert fields == set(MARGIN_VALUES)
    for name in sorted(fields):
        argv = ["--margin", margin, *_margin_flag(name, margin)]
        if name in _MARGIN_FIELDS[margin]:
            parse_config(argv)
        else:
            readers = " / ".join(sorted(m for m, names in _MARGIN_FIELDS.items() if name in names))
            with pytest.raises(ConfigError, match="^" + re.escape(
                    f"--{name.replace('_', '-')} is read by margin {readers}, not by this run's margin={margin!r}: "
                    "remove it, or set --margin") + "$"):
                parse_config(argv)


def test_an_alias_is_judged_as_the_margin_it_names():
    cfg, _ = parse_config(["--margin", "amsoftmax", "--m", "0.3"])  # cosface's other name
    assert cfg.margin == "cosface"


def test_nproc_is_refused_by_horovod_too():
    # horovodrun's -np decides its processes; outside horovodrun it trains as a world of one
    with pytest.raises(ConfigError, match=re.escape("--nproc is read only with strategy 'ddp' or 'pipeline', not by "
                                                    "this run's strategy='horovod'")):
        parse_config(["--strategy", "horovod", "--nproc", "2"])
    assert parse_config(["--strategy", "pipeline", "--nproc", "4"])[0].nproc == 4


def test_turning_the_synthetic_pairs_off_is_taken_on_any_dataset():
    # how scripts sharing flags across datasets turn evaluation off: harmless where there are none
    cfg, _ = parse_config(["--dataset", "list", "--list-file", "/l.txt", "--synthetic-val-pairs", "0"])
    assert cfg.synthetic_val_pairs == 0


def test_the_evaluation_settings_are_read_by_every_target_and_by_imprinting():
    off = ["--synthetic-val-pairs", "0"]
    for reading in (["--val-bins", "/lfw.bin"], ["--reid-root", "/market"], ["--synthetic-val-pairs", "20"],
                    ["--head-init", "imprint", "--init-from", "/m.pt"]):
        cfg, _ = parse_config([*off, *reading, "--eval-batch-size", "8"])
        assert cfg.eval_batch_size == 8
    for reading in (["--val-bins", "/lfw.bin"], ["--reid-root", "/market"]):
        assert parse_config([*off, *reading, "--no-eval-flip"])[0].eval_flip is False
    with pytest.raises(ConfigError, match="^--eval-flip is read only with an evaluation target"):
        parse_config([*off, "--head-init", "imprint", "--init-from", "/m.pt", "--no-eval-flip"])  # imprinting never flips
    # a dataset other than the synthetic one has no synthetic pairs: its default 1000 is no target
    with pytest.raises(ConfigError, match="not by this run's val_bins=\\[\\]: remove it, or set --val-bins$"):
        parse_config(["--dataset", "list", "--list-file", "/l.txt", "--no-eval-flip"])


def test_turning_evaluation_off_is_taken_with_no_target_and_a_pipeline_always_drops_the_last_batch():
    assert parse_config(["--synthetic-val-pairs", "0", "--eval-every", "0"])[0].eval_every == 0
    with pytest.raises(ConfigError, match=re.escape(
            "--drop-last is read only with sampler 'random' outside strategy 'pipeline' (P x K batches are always "
            "whole, and so are a pipeline's, whose micro-batches divide them), not by this run's strategy='pipeline': "
            "remove it, or set --strategy")):
        parse_config(["--strategy", "pipeline", "--nproc", "2", "--no-drop-last"])


def test_values_from_a_config_file_are_not_judged(tmp_path):
    # a run's saved config.toml holds every field: only the command line's flags say what was asked for
    path = tmp_path / "c.toml"
    path.write_text('optimizer = "adamw"\nmomentum = 0.5\nmicro_batches = 4\n', encoding="utf-8")
    cfg, _ = parse_config(["--config", str(path)])
    assert (cfg.optimizer, cfg.momentum, cfg.micro_batches) == ("adamw", 0.5, 4)
