"""The fused Triton kernels run here on CPU tensors under Triton's interpreter — or, on a machine
with CUDA (``scripts/gpu_check.sh``), compiled, on the GPU.

Without CUDA, ``TRITON_INTERPRET=1`` must be set before the kernel modules are first imported (``triton.jit``
reads it when it wraps a kernel). Nothing imports them before a head resolves ``impl="triton"``,
which these tests are the first to do; spawned ranks inherit the variable. Where Triton is not
installed the tests skip, saying how to get it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("triton") is not None:
        return
    skip = pytest.mark.skip(reason="triton is not installed (pip install 'shardfc[test]' brings it)")
    for item in items:
        if "head/fused" in str(item.fspath):
            item.add_marker(skip)
