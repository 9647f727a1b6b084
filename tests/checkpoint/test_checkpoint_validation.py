"""The argument checks of save and load (:mod:`shardfc.checkpoint.validation`), each refusal in full,
and the compact CPU copy a save stores; the cross-rank agreement on hand-made rank infos (in a run it
is checked inside gloo ranks, which mutation testing does not see)."""

from __future__ import annotations

import re
from types import MappingProxyType

import pytest
import torch

from shardfc.checkpoint import validation as V


def test_class_range_is_a_range_of_step_one_within_the_classes():
    assert V.check_class_range(range(2, 5), 5) == range(2, 5)
    assert V.check_class_range(range(0, 0), 0) == range(0)
    for bad in ([0, 1], range(0, 4, 2)):
        with pytest.raises(ValueError, match="^" + re.escape(f"class_range must be a range with step 1, got {bad!r}") + "$"):
            V.check_class_range(bad, 5)
    with pytest.raises(ValueError, match=r"^class_range=range\(3, 6\) must lie within \[0, num_classes=5\]$"):
        V.check_class_range(range(3, 6), 5)


def test_str_keys_of_a_mapping():
    got = V.check_str_keys("extras", MappingProxyType({"a": 1}))
    assert got == {"a": 1} and type(got) is dict
    with pytest.raises(ValueError, match=r"^extras must be a dict, got list$"):
        V.check_str_keys("extras", [("a", 1)])
    with pytest.raises(ValueError, match=r"^extras keys must be str, got 1$"):
        V.check_str_keys("extras", {"a": 0, 1: 0, 2: 0})


def test_head_tensors_are_tensors_of_the_ranges_rows():
    w = torch.zeros(3, 2)
    out = V.prepare_head_tensors({"w": w, "step": torch.zeros(3)}, 3)  # a 1-d tensor of the rows: one value a class
    assert set(out) == {"w", "step"} and out["step"].shape == (3,)
    with pytest.raises(ValueError, match=r"^head_tensors must be a dict, got list$"):
        V.prepare_head_tensors([w], 3)
    with pytest.raises(ValueError, match=r"^head_tensors\['w'\] must be a torch\.Tensor, got list$"):
        V.prepare_head_tensors({"w": [0.0]}, 3)
    with pytest.raises(ValueError, match=r"^head_tensors\['w'\] has shape \(\); its first dim must equal len\(class_range\)=3$"):
        V.prepare_head_tensors({"w": torch.tensor(1.0)}, 3)
    with pytest.raises(ValueError, match=r"^head_tensors\['w'\] has shape \(4, 2\); its first dim"):
        V.prepare_head_tensors({"w": torch.zeros(4, 2)}, 3)


def test_compact_cpu_copies_only_what_is_not_its_own_storage():
    own = torch.arange(6.0).reshape(3, 2)
    assert V.compact_cpu(own).untyped_storage().data_ptr() == own.untyped_storage().data_ptr()  # no copy
    base = torch.arange(8.0)
    for view in (base[:4], base[4:], base.reshape(4, 2).t(), base[::2]):  # a prefix, an offset, transposed, strided
        got = V.compact_cpu(view)
        assert torch.equal(got, view) and got.is_contiguous() and got.storage_offset() == 0
        assert got.untyped_storage().nbytes() == view.numel() * 4
    grad = torch.ones(2, requires_grad=True) * 2
    assert not V.compact_cpu(grad).requires_grad


def _info(step=1, num_classes=6, class_range=(0, 3), specs=("w",), extras=("lr",)):
    return {"step": step, "num_classes": num_classes, "class_range": class_range, "specs": list(specs),
            "extras": list(extras)}


def test_ranks_agree_or_every_rank_says_how_they_differ():
    V.check_consistency([_info(), _info(class_range=(3, 6))])
    V.check_consistency([_info(class_range=(0, 6))])
    cases = [
        ([_info(), _info(step=2, class_range=(3, 6))], "step differs across ranks: rank 0 has 1, rank 1 has 2"),
        ([_info(), _info(num_classes=7, class_range=(3, 6))], "num_classes differs across ranks: rank 0 has 6, rank 1 has 7"),
        ([_info(), _info(class_range=(4, 6))],
         "class ranges must be contiguous in rank order: rank 1 has class_range=range(4, 6) but the previous rank ends at 3"),
        ([_info(), _info(class_range=(3, 6), specs=("v",))],
         "head_tensors differ across ranks: rank 0 has ['w'], rank 1 has ['v']"),
        ([_info(), _info(class_range=(3, 6), extras=())], "head_extras names differ across ranks: rank 0 has ['lr'], rank 1 has []"),
        ([_info(), _info(class_range=(3, 5))], "class ranges of all ranks cover [0, 5) but num_classes=6"),
    ]
    for infos, message in cases:
        with pytest.raises(ValueError) as err:
            V.check_consistency(infos)
        assert str(err.value) == message
