"""The per-step numbers kernels read from the device (``fused/device_scalars.py``): plain torch."""

from __future__ import annotations

import pytest
import torch

from shardfc.head import capture
from shardfc.head.fused import device_scalars


def test_scalars_on_are_fp32_on_the_device_asked_whatever_the_default_dtype():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        t = device_scalars.scalars_on((0.1, 2, 5e-4), torch.device("cpu"))
    finally:
        torch.set_default_dtype(before)
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.tolist() == torch.tensor([0.1, 2.0, 5e-4], dtype=torch.float32).tolist()
    assert device_scalars.scalars_on((1.0,), torch.device("meta")).device.type == "meta"
    out = torch.zeros(2)
    assert device_scalars.scalars_on((3, 4), torch.device("cpu"), out) is out and out.tolist() == [3.0, 4.0]


def test_device_scalars_are_held_per_device_and_a_change_in_a_capture_says_what_it_was(monkeypatch):
    held = device_scalars.DeviceScalars()
    cpu, meta = torch.device("cpu"), torch.device("meta")
    t = held.get("sgd", (0.5, 0.9), cpu)
    on_meta = held.get("sgd", (0.5, 0.9), meta)
    assert on_meta.device.type == "meta" and held.get("sgd", (0.5, 0.9), cpu) is t
    monkeypatch.setattr(capture, "capturing", lambda: True)
    assert held.get("sgd", (0.5, 0.9), cpu) is t and torch.equal(t, torch.tensor([0.5, 0.9]))  # unchanged: no copy, no error
    with pytest.raises(RuntimeError) as err:
        held.get("sgd", (0.25, 0.9), cpu)
    assert str(err.value) == (
        "the optimizer's per-step values (0.25, 0.9) changed inside a CUDA graph capture (they were (0.5, 0.9)): "
        "set the learning rate and the other hyper-parameters before capturing or replaying, not inside the captured step")
    with pytest.raises(RuntimeError, match=r"^the optimizer's per-step values \(1\.0,\) changed inside a CUDA graph capture "
                       r"\(they were never staged\): set the learning rate"):
        held.get("adamw", (1,), cpu)


def test_device_scalars_keep_fp64_apart_from_fp32_and_at_one_address_per_dtype():
    """The idle rows' step matrix is staged in fp64 (the eager record's arithmetic); the same key in
    fp32 is another tensor, and each keeps its address when its numbers change."""
    held = device_scalars.DeviceScalars()
    cpu = torch.device("cpu")
    wide = held.get("k", (0.1, 1 / 3), cpu, torch.float64)
    narrow = held.get("k", (0.1, 1 / 3), cpu)
    assert wide.dtype == torch.float64 and narrow.dtype == torch.float32 and wide is not narrow
    assert wide.tolist() == [0.1, 1 / 3]
    assert held.get("k", (0.2, 0.5), cpu, torch.float64) is wide and wide.tolist() == [0.2, 0.5]
    assert device_scalars.scalars_on((1 / 3,), cpu, dtype=torch.float64).item() == 1 / 3


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_or_a_pickle_of_device_scalars_holds_nothing_and_makes_its_tensors_again(how):
    import copy
    import pickle

    held = device_scalars.DeviceScalars()
    cpu = torch.device("cpu")
    t = held.get("sgd", (0.5, 0.9), cpu)
    other = copy.deepcopy(held) if how == "deepcopy" else pickle.loads(pickle.dumps(held))
    assert other._held == {}
    again = other.get("sgd", (0.5, 0.9), cpu)
    assert again is not t and torch.equal(again, t) and held.get("sgd", (0.5, 0.9), cpu) is t
