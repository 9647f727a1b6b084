"""The fused Triton kernels run here on CPU tensors under Triton's interpreter — or, on a machine
with CUDA (``scripts/gpu_check.sh``), compiled, on the GPU.

Without CUDA, ``TRITON_INTERPRET=1`` must be set when the kernel modules are imported (``triton.jit``
reads it when it wraps a kernel) and while a head runs them (the head reads it to accept CPU
tensors). Both are confined to these tests: the modules are imported here with the variable set
for the import only, and an autouse fixture sets it for each test of this folder, so no other test
of the session sees it. Spawned ranks set it themselves. Where Triton is not installed the tests
skip, saying how to get it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = HAS_TRITON and not torch.cuda.is_available()

if INTERPRET:
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for _module in ("shardfc.head.fused.shard", "shardfc.head.fused.optimizer", "shardfc.head.fused.idle_rows",
                        "shardfc.head.fused.draw"):
            importlib.import_module(_module)
    finally:
        if _before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _before


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def pytest_collection_finish(session):
    """test_aot.py's sm_90 build starts now, in a subprocess, when a test that reads it (its ``built``
    fixture) is to run (aot_build.py); the in-process builds of that file need none."""
    if HAS_TRITON and any("built" in getattr(item, "fixturenames", ()) for item in session.items):
        import aot_build

        aot_build.start()


def pytest_sessionfinish(session, exitstatus):
    if "aot_build" in sys.modules:
        sys.modules["aot_build"].stop()


def pytest_collection_modifyitems(config, items):
    if HAS_TRITON:
        return
    skip = pytest.mark.skip(reason="triton is not installed (pip install 'shardfc[test]' brings it)")
    for item in items:
        if "head/fused" in str(item.fspath):
            item.add_marker(skip)
