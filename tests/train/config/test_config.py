"""TrainConfig: TOML loading, presets, CLI overrides, and the errors for unknown keys and bad types."""

from __future__ import annotations

import dataclasses

import pytest

from shardfc.cli import train as train_cli
from shardfc.train.config import (
    SECTIONS,
    ConfigError,
    TrainConfig,
    available_presets,
    build_parser,
    config_from_mapping,
    field_help,
    load_toml,
    parse_config,
    preset_path,
    to_toml,
)


def _write(tmp_path, text: str, name: str = "cfg.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_valid_and_equal_the_synthetic_preset():
    cfg = TrainConfig().validate()
    preset = config_from_mapping(load_toml(preset_path("synthetic")))
    assert preset == cfg
    assert cfg.dataset == "synthetic" and cfg.nproc == 2


def test_every_field_has_help_and_a_section():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert names == {n for section in SECTIONS.values() for n in section}
    assert all(field_help(n) for n in names), [n for n in names if not field_help(n)]
    text = build_parser().format_help()
    assert "--sample-rate" in text and field_help("sample_rate").split()[0] in text
    assert "--no-eval-flip" in text


@pytest.mark.parametrize("name", ["synthetic", "ms1mv3_r50_arcface", "glint360k_r100_pfc", "market1501_r50_reid", "market1501"])
def test_presets_load_and_validate(name):
    assert name in available_presets()
    cfg, _ = parse_config(["--preset", name])
    if name == "glint360k_r100_pfc":
        assert cfg.backbone == "iresnet100" and cfg.sample_rate == 0.2 and cfg.amp == "fp16"
    if name == "market1501_r50_reid":
        assert cfg.backbone == "resnet50" and cfg.image_size == [256, 128] and cfg.optimizer == "adamw"
    if name == "market1501":
        assert (cfg.dataset, cfg.backbone, cfg.neck, cfg.sampler, cfg.pk_instances) == ("market1501", "resnet50", "bnneck", "pk", 4)
        assert (cfg.triplet_weight, cfg.triplet_margin, cfg.random_erasing) == (1.0, 0.3, 0.5)
        assert cfg.reid_root and cfg.eval_every > 0


def test_flat_and_sectioned_toml_and_precedence(tmp_path):
    flat = _write(tmp_path, 'lr = 0.05\nmargin = "cosface"\nbetas = [0.8, 0.99]\nepochs = 3\n', "flat.toml")
    sectioned = _write(tmp_path, '[optim]\nlr = 0.05\n[head]\nmargin = "cosface"\nm = 0.4\n', "sec.toml")
    cfg, _ = parse_config(["--config", str(flat)])
    assert (cfg.lr, cfg.margin, cfg.betas, cfg.epochs) == (0.05, "cosface", [0.8, 0.99], 3)
    cfg, _ = parse_config(["--config", str(sectioned), "--lr", "0.2", "--no-eval-flip", "--optimizer", "adamw",
                           "--betas", "0.5", "0.6"])
    assert (cfg.lr, cfg.margin, cfg.m, cfg.eval_flip, cfg.betas) == (0.2, "cosface", 0.4, False, [0.5, 0.6])
    assert cfg.margin_params() == {"scale": 32.0, "margin": 0.4}
    # preset < config < flags
    cfg, _ = parse_config(["--preset", "ms1mv3_r50_arcface", "--config", str(flat), "--batch-size", "7"])
    assert (cfg.backbone, cfg.lr, cfg.batch_size) == ("iresnet50", 0.05, 7)


def test_int_accepted_for_float_and_roundtrip(tmp_path):
    cfg = config_from_mapping({"lr": 1, "val_bins": ["a.bin"], "image_size": [16, 16]})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    again = config_from_mapping(load_toml(_write(tmp_path, to_toml(cfg))))
    assert again == cfg


def test_unknown_toml_key_names_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'lerning_rate'|unknown key 'lrr'.*did you mean 'lr'"):
        parse_config(["--config", str(_write(tmp_path, "lrr = 0.1\n"))])
    with pytest.raises(ConfigError, match=r"unknown key optim.momentun.*did you mean 'momentum'"):
        config_from_mapping({"optim": {"momentun": 0.9}})
    with pytest.raises(ConfigError, match=r"'lr' belongs in \[optim\], not \[data\]"):
        config_from_mapping({"data": {"lr": 0.1}})


@pytest.mark.parametrize("text", ["lr = 0.1\n[optim]\nlr = 0.2\n", "[optim]\nlr = 0.2\n[run]\nseed = 1\n"])
def test_a_field_set_at_the_top_and_under_its_section_is_refused(tmp_path, text):
    """Two TOML tables, so TOML itself allows it; one value won without a word."""
    path = _write(tmp_path, text)
    if text.startswith("lr"):
        with pytest.raises(ConfigError) as err:
            parse_config(["--config", str(path)])
        assert str(err.value) == f"{path}: key 'lr' is set twice, at the top and under [optim]: keep one"
    else:  # each field once: taken
        assert parse_config(["--config", str(path)])[0].lr == 0.2
    with pytest.raises(ConfigError, match=r"^key 'lr' is set twice, at the top and under \[optim\]: keep one$"):
        config_from_mapping({"optim": {"lr": 0.2}, "lr": 0.1})  # whichever comes first


def test_unknown_flag_and_preset_name_the_closest():
    with pytest.raises(ConfigError, match=r"unknown argument '--sample-rat'.*did you mean '--sample-rate'"):
        parse_config(["--sample-rat", "0.1"])
    with pytest.raises(ConfigError, match=r"unknown preset 'glint360k'.*did you mean 'glint360k_r100_pfc'"):
        parse_config(["--preset", "glint360k"])


def test_type_errors_name_field_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"lr must be float, got 'fast' \(str\)"):
        parse_config(["--config", str(_write(tmp_path, 'lr = "fast"\n'))])
    with pytest.raises(ConfigError, match=r"batch_size must be int, got True"):
        config_from_mapping({"batch_size": True})
    with pytest.raises(ConfigError, match=r"lr must be float, got 'abc'"):
        parse_config(["--lr", "abc"])
    with pytest.raises(ConfigError, match=r"margin must be one of .*got 'arcfce'; did you mean 'arcface'"):
        parse_config(["--margin", "arcfce"])
    with pytest.raises(ConfigError, match=r"sample_rate must be in \(0, 1\], got 1.5"):
        parse_config(["--sample-rate", "1.5"])
    with pytest.raises(ConfigError, match=r"chunk_size must be >= 1, 0 \(no chunking\) or -1 \(auto\), got -2"):
        parse_config(["--chunk-size", "-2"])
    assert parse_config(["--chunk-size", "-1"])[0].chunk_size == -1
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config(["--config", str(_write(tmp_path, "lr = = 1\n"))])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(["--config", str(tmp_path / "missing.toml")])


def test_cli_reports_config_errors_in_one_line(capsys):
    assert train_cli.main(["--lrr", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "did you mean '--lr'" in err and "Traceback" not in err
    assert train_cli.main(["--print-config", "--lr", "0.3"]) == 0
    assert "lr = 0.3" in capsys.readouterr().out


def test_folder_dataset_errors_before_spawning(tmp_path, capsys):
    assert train_cli.main(["--dataset", "folder"]) == 2
    assert "dataset='folder' needs data_root" in capsys.readouterr().err
    missing = tmp_path / "nope"
    assert train_cli.main(["--dataset", "folder", "--data-root", str(missing)]) == 2
    assert f"data_root={str(missing)!r} does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------- traps a new user meets


def test_margin_aliases_are_accepted_as_the_python_api_accepts_them():
    cfg, _ = parse_config(["--margin", "amsoftmax", "--m", "0.3"])
    assert cfg.margin == "cosface" and cfg.margin_params() == {"scale": cfg.scale, "margin": 0.3}


@pytest.mark.parametrize(
    "flag,suggestion", [("--learning-rate", "--lr"), ("--wd", "--weight-decay"), ("--steps", "--max-steps")]
)
def test_synonym_flags_suggest_the_flag_of_the_same_meaning(flag, suggestion):
    with pytest.raises(ConfigError, match=f"unknown argument '{flag}'; did you mean '{suggestion}'"):
        parse_config([flag, "1"])


def test_a_table_named_after_a_field_says_it_is_a_field(tmp_path):
    path = _write(tmp_path, "[optimizer]\nname = 'sgd'\n")
    with pytest.raises(ConfigError, match=r"\[optimizer\] is a table, but 'optimizer' is a field \(str\)"):
        parse_config(["--config", str(path)])


def test_margin_parameter_errors_name_the_flag():
    with pytest.raises(ConfigError, match=r"margin='arcface' with scale=.* m=4.0 \(--m\).*"):
        parse_config(["--margin", "arcface", "--m", "4"])


def test_data_root_alone_means_the_folder_dataset_in_its_own_run_folder(tmp_path):
    cfg, _ = parse_config(["--data-root", str(tmp_path)])
    assert cfg.dataset == "folder" and cfg.output_dir == "shardfc_runs/folder"
    cfg, _ = parse_config(["--preset", "ms1mv3_r50_arcface"])
    assert cfg.output_dir == "shardfc_runs/ms1mv3_r50_arcface"
    cfg, _ = parse_config(["--data-root", str(tmp_path), "--output-dir", str(tmp_path / "mine")])
    assert cfg.output_dir == str(tmp_path / "mine")
    with pytest.raises(ConfigError, match="data_root=.* is set but dataset='synthetic' reads no files"):
        TrainConfig(data_root=str(tmp_path)).validate()


def test_every_rank_must_hold_a_class(tmp_path):
    from shardfc.parallel.context import DistContext
    from shardfc.train.builder.factory import build_run

    cfg = TrainConfig(synthetic_identities=3, synthetic_images_per_identity=4, backbone="tiny", embedding_dim=8,
                      image_size=[16, 16], output_dir=str(tmp_path)).validate()
    with pytest.raises(ConfigError, match=r"3 class\(es\) for 4 ranks: every rank must hold at least one class"):
        build_run(cfg, DistContext(None, 0, 4, True))


def test_trust_checkpoint_is_an_explicit_opt_in():
    assert TrainConfig().trust_checkpoint is False
    cfg, _ = parse_config(["--trust-checkpoint"])
    assert cfg.trust_checkpoint is True
    assert "--trust-checkpoint" in build_parser().format_help()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--sampler", "pq"], r"sampler must be one of random, pk; got 'pq'"),
        (["--sampler", "pk", "--pk-instances", "1"], r"pk_instances must be >= 2 .*got 1"),
        (["--random-erasing", "1.5"], r"random_erasing must be a probability in \[0, 1\], got 1.5"),
        (["--triplet-weight", "-1"], r"triplet_weight must be a finite number >= 0, got -1.0"),
        (["--triplet-margin", "inf", "--triplet-weight", "1"], r"triplet_margin must be a finite number, got inf"),
        (["--triplet-weight", "1", "--backbone", "iresnet18"], r"triplet_weight=1.0 needs .*resnet50, tiny give; got backbone='iresnet18'"),
        (["--neck", "none"], r"neck='none' applies to backbone='resnet50' only, got backbone='tiny'"),
        (["--neck", "bn", "--backbone", "resnet50"], r"neck must be one of auto, bnneck, none; got 'bn'"),
        (["--dataset", "market1501"], r"dataset='market1501' needs data_root"),
    ],
)
def test_reid_recipe_fields_are_validated(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(flags)


def test_data_root_of_a_market1501_release_is_detected(tmp_path):
    (tmp_path / "bounding_box_train").mkdir()
    cfg, _ = parse_config(["--data-root", str(tmp_path)])
    assert cfg.dataset == "market1501" and cfg.reid_root == str(tmp_path)
    cfg, _ = parse_config(["--data-root", str(tmp_path), "--reid-root", ""])
    assert cfg.reid_root == ""  # an explicit --reid-root wins
    cfg, _ = parse_config(["--sampler", "pk", "--pk-instances", "8", "--triplet-weight", "1", "--triplet-soft", "--neck", "none",
                           "--backbone", "resnet50"])
    assert (cfg.sampler, cfg.pk_instances, cfg.triplet_soft, cfg.neck) == ("pk", 8, True, "none")


def test_new_losses_flags_reach_the_margin_and_the_head():
    from shardfc import margins as M

    cfg, _ = parse_config(["--margin", "adaface", "--scale", "64", "--adaface-h", "0.5", "--subcenters", "3",
                           "--interclass-filter-threshold", "0.4"])
    assert cfg.margin_params() == {"scale": 64.0, "margin": 0.4, "h": 0.5, "momentum": 0.01}
    assert (cfg.subcenters, cfg.interclass_filter_threshold) == (3, 0.4)
    cfg, _ = parse_config(["--margin", "magface", "--magface-u-m", "0.7"])
    margin = M.build_margin(cfg.margin, **cfg.margin_params())
    assert isinstance(margin, M.MagFace) and (margin.l_a, margin.u_a, margin.u_m, margin.lambda_g) == (10, 110, 0.7, 35)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--subcenters", "0"], "subcenters must be >= 1, got 0"),
        (["--subcenters", "300"], "subcenters must be <= 255, got 300"),
        (["--interclass-filter-threshold", "1.5"], r"interclass_filter_threshold must be in \(0, 1\] \(0: off\), got 1.5"),
        (["--interclass-filter-threshold", "0.3", "--label-smoothing", "0.1"], "label_smoothing=0.1"),
        (["--margin", "magface", "--magface-u-a", "5"], r"margin='magface' with .*magface_u_a=5.0 \(--magface-u-a\).*u_a must be > l_a"),
        (["--margin", "adaface", "--adaface-momentum", "2"], r"adaface_momentum=2.0 \(--adaface-momentum\).*momentum must be in"),
    ],
)
def test_new_losses_bad_values_name_the_flag(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(argv)


def test_the_margin_fields_default_to_the_margin_classes_defaults():
    """The margins own their defaults: a flag left alone builds the margin its class builds by default
    (the scale excepted: shardfc train's 32 is its own)."""
    import inspect

    from shardfc.head.margins import MARGINS

    for name in ("arcface", "cosface", "sphereface", "combined", "adaface", "magface", "normsoftmax", "softmax"):
        given = TrainConfig(margin=name).margin_params()
        defaults = {k: p.default for k, p in inspect.signature(MARGINS[name]).parameters.items()}
        given.pop("scale", None)
        defaults.pop("scale", None)
        assert given == defaults, name


@pytest.mark.parametrize("changes, says", [
    (dict(nproc=2), "cuda_graph='head': nproc=2 (a head sharded over ranks"),
    (dict(sample_rate=0.5, sparse_grad=True), "cuda_graph='head': sparse_grad (each backward's compact gradient"),
    (dict(sample_rate=0.5, optimizer="adamw"), "cuda_graph='head': optimizer='adamw' with head_idle_rows='exact'"),
    (dict(head_update="optimizer"), "cuda_graph='head': head_update='optimizer' (the update must be inside"),
    (dict(grad_accum=2), "cuda_graph='head': grad_accum=2 (several backward passes"),
    (dict(head_grad_clip=1.0), "cuda_graph='head': head_grad_clip=1.0 (clipping reads the stored gradient)"),
    (dict(device="cpu"), "cuda_graph='head': the run is on the CPU"),
])
def test_a_captured_head_step_is_refused_where_the_config_rules_it_out(changes, says):
    """``cuda_graph='head'`` needs one head in one process with the fused update: the configuration
    says which condition fails, in one line ending with what to do (issue 42)."""
    cfg = TrainConfig(cuda_graph="head", **{"nproc": 1, **changes})
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith(says) and str(err.value).endswith("use cuda_graph 'off'")
    assert TrainConfig(cuda_graph="head", nproc=1, device="cuda").validate().cuda_graph == "head"  # none of that
    for ok in (dict(), dict(optimizer="adamw", head_idle_rows="lazy")):  # Partial FC is captured (issue 42)
        assert TrainConfig(cuda_graph="head", nproc=1, device="cuda", sample_rate=0.5, **ok).validate().sample_rate == 0.5
    with pytest.raises(ConfigError, match="cuda_graph must be one of"):
        TrainConfig(cuda_graph="all").validate()


# ---------------------------------------------------------------------------- each message in full


def test_toml_errors_name_the_file_they_come_from(tmp_path):
    from shardfc.train.config import toml as toml_module

    assert str(_raises(config_from_mapping, {"lrr": 1})) == "unknown key 'lrr'; did you mean 'lr'?"
    assert str(_raises(config_from_mapping, {"lrr": 1}, None, "x.toml")) == "x.toml: unknown key 'lrr'; did you mean 'lr'?"
    assert str(_raises(config_from_mapping, {"glint": 1})) == "unknown key 'glint'; did you mean 'margin'?"  # ratio 0.55
    assert str(_raises(config_from_mapping, {"zzzz": 1})) == "unknown key 'zzzz'"
    assert str(_raises(config_from_mapping, {"data": {"scael": 1}})) == (
        "unknown key data.scael; did you mean 'sampler'?")  # within the table's fields, not 'scale' of [head]
    assert str(_raises(config_from_mapping, {"data": {"lr": 1}}, None, "x.toml")) == (
        "x.toml: key 'lr' belongs in [optim], not [data]")
    assert str(_raises(config_from_mapping, {"optimizer": {"name": "sgd"}}, None, "x.toml")) == (
        "x.toml: [optimizer] is a table, but 'optimizer' is a field (str): write 'optimizer = ...' at the top or "
        "under [optim]; the tables are [data], [model], [head], [optim], [schedule], [run], [eval], [classes]")
    assert str(_raises(config_from_mapping, {"lr": "fast"})) == "lr must be float, got 'fast' (str)"
    assert str(_raises(config_from_mapping, {"optim": {"lr": None}}, None, "x.toml")) == (
        "x.toml: lr must be float, got None (NoneType)")
    assert str(_raises(config_from_mapping, {"image_size": 5})) == "image_size must be a list of int, got 5 (int)"
    assert str(_raises(config_from_mapping, {"image_size": [1, "a"]})) == (
        "image_size must be a list of int, got [1, 'a'] (list)")
    path = _write(tmp_path, "lrr = 1\n")
    assert str(_raises(parse_config, ["--config", str(path)])) == f"{path}: unknown key 'lrr'; did you mean 'lr'?"
    missing = tmp_path / "missing.toml"
    assert str(_raises(load_toml, missing)) == f"config file {str(missing)!r} does not exist"
    assert str(_raises(load_toml, tmp_path)).startswith(f"refusing to read config file {tmp_path}: ")
    assert toml_module.available_presets() == available_presets()


def test_a_presets_errors_name_the_preset(tmp_path, monkeypatch):
    from shardfc.train.config import flags

    bad = _write(tmp_path, "lrr = 1\n")
    monkeypatch.setattr(flags, "preset_path", lambda name: bad)
    assert str(_raises(parse_config, ["--preset", "mine"])) == "preset mine: unknown key 'lrr'; did you mean 'lr'?"


def test_an_unknown_preset_lists_them():
    assert str(_raises(preset_path, "glint360k")) == (
        f"unknown preset 'glint360k'; available: {', '.join(available_presets())}; did you mean 'glint360k_r100_pfc'?")


def _raises(func, *args):
    with pytest.raises(ConfigError) as info:
        func(*args)
    return info.value


def test_unknown_arguments_and_their_hints():
    assert str(_raises(parse_config, ["--learning-rate=a=b"])) == "unknown argument '--learning-rate=a=b'; did you mean '--lr'?"
    assert str(_raises(parse_config, ["--lrr=0.1"])) == "unknown argument '--lrr=0.1'; did you mean '--lr'?"
    assert str(_raises(parse_config, ["lr"])) == "unknown argument 'lr'"  # not a flag: no flag suggested
    assert parse_config(["--", "--lr", "0.2"])[0].lr == 0.2  # torchrun's separator
    assert parse_config(["--margin-m", "0.3", "--num-procs", "3"])[0].m == 0.3
    assert parse_config(["--num-procs", "3"])[0].nproc == 3


def test_the_help_says_each_flags_value_and_default(monkeypatch):
    from shardfc.train.config import flags

    parser = build_parser()
    assert parser.prog == "shardfc train" and build_parser("torchrun x").prog == "torchrun x"
    text = parser.format_help()
    flat = " ".join(text.split())
    assert text.startswith("usage: shardfc train [--preset NAME] [--config PATH] [--print-config] [--FIELD VALUE ...]\n")
    assert ("Train an embedding backbone with a class-sharded margin head. With no arguments: the synthetic demo on 2 "
            "CPU processes. Under torchrun the launcher's processes join one group.") in flat
    assert (f"presets: {', '.join(available_presets())}. Values: defaults < --preset < --config < flags.") in flat
    assert "--preset NAME start from a bundled preset" in flat
    assert "--config PATH TOML file with field values (flat or in [section] tables)" in flat
    assert "--print-config print the resolved configuration as TOML and exit" in flat
    for section in SECTIONS:
        assert f"\n{section}:\n" in text
    assert f"--lr X {field_help('lr')} (default: 0.1)" in flat
    assert "--batch-size N" in flat and "--backbone TEXT" in flat and "--val-bins [PATH ...]" in flat
    assert "--m X, --margin-m X" in flat and "--nproc N, --num-procs N" in flat
    monkeypatch.setattr(flags, "field_help", lambda name: "50% of it")  # argparse's % formatting escaped
    assert "50% of it (default: 0.1)" in " ".join(build_parser().format_help().split())


def test_a_data_root_names_the_dataset_it_holds(tmp_path):
    rec_dir, market, plain, rec_is_dir = (tmp_path / n for n in ("rec", "market", "plain", "recdir"))
    (rec_dir).mkdir()
    (rec_dir / "train.rec").write_bytes(b"")
    (market / "bounding_box_train").mkdir(parents=True)
    plain.mkdir()
    (rec_is_dir / "train.rec").mkdir(parents=True)  # a folder named train.rec: not a release
    assert parse_config(["--data-root", str(tmp_path / "x.rec")])[0].dataset == "recordio"  # not there yet: named so
    assert parse_config(["--data-root", str(rec_dir)])[0].dataset == "recordio"
    assert parse_config(["--data-root", str(rec_is_dir)])[0].dataset == "folder"
    for given in ("folder", "recordio", "market1501"):  # a dataset read from a file follows the data root
        cfg_file = _write(tmp_path, f'dataset = "{given}"\ndata_root = "{plain}"\n', f"{given}.toml")
        assert parse_config(["--config", str(cfg_file), "--data-root", str(rec_dir)])[0].dataset == "recordio"
        assert parse_config(["--config", str(cfg_file), "--data-root", str(market)])[0].dataset == "market1501"
        assert parse_config(["--config", str(cfg_file), "--data-root", str(plain)])[0].dataset == "folder"
    assert parse_config(["--dataset", "folder", "--data-root", str(rec_dir)])[0].dataset == "folder"  # said: kept
    listed = parse_config(["--dataset", "list", "--list-file", "l.txt", "--data-root", str(rec_dir)])[0]
    assert listed.dataset == "list"


def test_to_toml_writes_any_string_back_as_it_was(tmp_path):
    every = "".join(chr(c) for c in range(1, 128)) + "ü"
    cfg = TrainConfig(output_dir=every, val_bins=["a\nb.bin", 'q"uote\\'])
    assert config_from_mapping(load_toml(_write(tmp_path, to_toml(cfg)))) == cfg
    from shardfc.train.config.toml import _toml_string

    assert _toml_string(' ~\x1f\x7f\x00"\\\n\t') == '" ~\\u001f\\u007f\\u0000\\"\\\\\\n\\t"'


def test_field_help_and_the_docstrings_it_reads():
    from shardfc.train.config.fields import FIELDS
    from shardfc.train.config.sections import _attribute_docstrings, type_name

    docs = _attribute_docstrings(TrainConfig)
    assert set(docs) == set(FIELDS) and all(docs[n] == field_help(n) for n in FIELDS)
    assert docs["lr"] == "Peak learning rate (reached after warmup_steps)."
    assert "\n" not in docs["dataset"] and "  " not in docs["dataset"]
    assert field_help("no_such_field") == ""

    class Some:
        a: int = 1
        """First
        line."""
        b: int = 2
        c = 3
        """Not annotated: not a field's."""
        d: int = 4
        e: int = 5
        """E."""

    assert _attribute_docstrings(Some) == {"a": "First line.", "e": "E."}
    assert _attribute_docstrings(type("Made", (), {})) == {}  # no source: no descriptions, no error
    assert (type_name("lr"), type_name("betas"), type_name("val_bins")) == ("float", "a list of float", "a list of str")


def test_absolute_paths_resolves_against_the_base(tmp_path, monkeypatch):
    from shardfc.train.config import absolute_paths

    base = tmp_path / "work"
    (base / "data").mkdir(parents=True)
    (base / "lfw.bin").write_bytes(b"")
    (base / "data" / "lfw.bin").write_bytes(b"")  # also beside the data: the base's wins
    (base / "data" / "agedb.bin").write_bytes(b"")  # only beside the data
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = TrainConfig(data_root="data", list_file="", output_dir="runs/../out", reid_root="/abs/reid",
                      init_from="~/model", rename_classes="r.txt",
                      val_bins=["lfw.bin", "agedb.bin", "missing.bin", "/abs/cfp.bin", "sub/../x.bin"])
    got = absolute_paths(cfg, base)
    assert (got.data_root, got.list_file, got.output_dir, got.reid_root, got.init_from, got.rename_classes) == (
        str(base / "data"), "", str(base / "out"), "/abs/reid", str(tmp_path / "home" / "model"), str(base / "r.txt"))
    assert got.val_bins == [str(base / "lfw.bin"), str(base / "data" / "agedb.bin"), str(base / "missing.bin"),
                            "/abs/cfp.bin", str(base / "x.bin")]
    assert (got.lr, got.dataset) == (cfg.lr, cfg.dataset)
    monkeypatch.chdir(base)
    assert absolute_paths(cfg).val_bins == got.val_bins  # no base: the working folder
    (base / "agedb.bin").write_bytes(b"")  # in the working folder, not in the base given below
    no_root = absolute_paths(TrainConfig(val_bins=["agedb.bin"]), tmp_path)
    assert no_root.val_bins == [str(tmp_path / "agedb.bin")] and no_root.data_root == ""  # nothing beside to look in
