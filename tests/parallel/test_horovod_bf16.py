"""Horovod refuses bf16 tensors; HorovodCommunicator moves them as fp32 and hands back bf16 (``--amp bf16`` under horovod)."""

import json
from pathlib import Path

WORKER = Path(__file__).with_name("horovod_bf16_worker.py")


def test_horovod_collectives_on_bf16_are_exact(horovodrun, tmp_path):
    code, log = horovodrun(2, [str(WORKER), str(tmp_path)], tmp_path / "hvd.log", timeout_s=300)
    assert code == 0, log[-3000:]
    for rank in range(2):
        counted = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # counted as the fp32 bytes that travel: 5 gathered rows, 5 + 4 reduced rows, 4 flags
        assert counted == {"all_gather": 5 * 5 * 4, "reduce_scatter": (5 + 4) * 5 * 4, "all_reduce": 4 * 4}
