"""``train.checkpointing.artifacts``' checks of what ``shardfc eval`` / ``embed`` are handed before a
checkpoint is read: the ``--device`` name and the ``--images`` folder."""

from __future__ import annotations

import pytest
import torch

from shardfc.train.checkpointing import artifacts
from shardfc.train.checkpointing.artifacts import list_images, pick_device
from shardfc.train.config import ConfigError


def _cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("name", ["xyz", "meta", "mps", "cuda:x", "cuda:-1", "", "CPU", "auto:0"])
def test_a_device_that_is_not_cpu_or_cuda_is_refused_by_name(name):
    with pytest.raises(ConfigError) as err:
        pick_device(name)
    assert str(err.value) == f"--device must be auto, cpu, cuda or cuda:N, got {name!r}"


@pytest.mark.parametrize("name", ["cpu", "cpu:0"])
def test_the_cpu_is_taken_as_named(name):
    assert pick_device(name) == torch.device(name)


def test_auto_is_the_cpu_without_cuda_and_cuda_with_it(monkeypatch):
    _cuda(monkeypatch, 0)
    assert pick_device("auto") == torch.device("cpu")
    _cuda(monkeypatch, 2)
    assert pick_device("auto") == torch.device("cuda")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_device_is_refused(monkeypatch, name):
    _cuda(monkeypatch, 0)
    with pytest.raises(ConfigError) as err:
        pick_device(name)
    assert str(err.value) == f"--device {name!r} but CUDA is not available here"


def test_a_cuda_index_past_the_machines_devices_is_refused_with_the_count(monkeypatch):
    _cuda(monkeypatch, 2)
    assert pick_device("cuda") == torch.device("cuda")
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError) as err:
        pick_device("cuda:2")
    assert str(err.value) == "--device 'cuda:2' but this machine has 2 CUDA device(s) (cuda:0..cuda:1)"


def test_list_images_walks_the_folder_sorted_and_skips_hidden_and_other_files(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ("b/2.JPG", "a.png", ".hidden.png", "notes.txt", "b/1.webp"):
        (tmp_path / name).write_bytes(b"x")
    assert list_images(str(tmp_path)) == [tmp_path / "a.png", tmp_path / "b" / "1.webp", tmp_path / "b" / "2.JPG"]


def test_list_images_names_a_missing_folder_a_file_and_a_folder_without_images(tmp_path):
    (tmp_path / "f.png").write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    for given, said in ((tmp_path / "none", "does not exist or is not a folder"),
                        (tmp_path / "f.png", "does not exist or is not a folder"),
                        (tmp_path / "empty", "holds no images (extensions: .bmp,")):
        with pytest.raises((FileNotFoundError, ValueError)) as err:
            list_images(str(given))
        assert str(err.value).startswith(f"--images {str(given)!r} {said}")


def test_the_module_lists_both_checks():
    assert {"list_images", "pick_device"} <= set(artifacts.__all__)
