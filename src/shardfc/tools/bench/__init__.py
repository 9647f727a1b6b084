"""``shardfc bench``: step time, per-rank peak memory and traffic of the head variants.

Python API::

    from shardfc.tools.bench import run_bench
    results = run_bench(world_size=2, batch=256, dim=64, classes=40_000, variants="sharded,chunked", steps=3)

Each result is a dict with exactly ``variant, step_time_s, peak_bytes_per_rank, balance,
comm_bytes_per_rank, floor_ratio`` (see :mod:`shardfc.tools.bench.runner` for their definitions and
:mod:`shardfc.tools.bench.memory` for the memory measure). :mod:`shardfc.tools.bench.report` writes the
Markdown table, the JSON and the PNG.
"""

from shardfc.tools.bench.runner import (
    DEFAULT_CHUNK_SIZE,
    FIELDS,
    VARIANTS,
    local_batch_sizes,
    parse_variants,
    run_bench,
)

__all__ = ["DEFAULT_CHUNK_SIZE", "FIELDS", "VARIANTS", "local_batch_sizes", "parse_variants", "run_bench"]
