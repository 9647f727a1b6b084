"""Classes per chunk of the GEMM path (``chunks.chunk_classes``) as sized on a GPU. Every other test
here runs under Triton's interpreter, whose chunks are a fixed 16 classes, so the GPU's sizing is
checked here by itself, against figures worked out by hand from its rule: ``[B, K·c]`` products of
about 32 MiB, ``c`` a multiple of 128, no more than the shard's classes rounded up to 128."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("n_cls,batch,K,elem,expected", [
    (10**6, 512, 1, 2, 32768),  # 32 MiB / (512 x 2 B) = 32768 classes, already a multiple of 128
    (10**6, 1000, 3, 4, 2688),  # 32 MiB / (1000 x 3 x 4 B) = 2796.2: down to 21 x 128
    (10**6, 512, 2, 2, 16384),  # sub-centres: K rows a class
    (300, 512, 1, 2, 384),  # a small shard: its 300 classes, rounded up to 3 x 128
    (10**6, 10**6, 1, 2, 128),  # a huge batch: 16 classes would fit, but never fewer than 128
    (10**6, 0, 1, 2, 1000064),  # no batch (a rank without samples): the whole shard, rounded up
    (0, 64, 1, 2, 128),  # an empty shard
])
def test_chunk_classes_on_a_gpu(monkeypatch, n_cls, batch, K, elem, expected):
    from shardfc.head.fused import chunks

    monkeypatch.setattr(chunks, "interpreting", lambda: False)
    assert chunks.chunk_classes(n_cls, batch, K, elem) == expected
    monkeypatch.setattr(chunks, "interpreting", lambda: True)
    assert chunks.chunk_classes(n_cls, batch, K, elem) == chunks.INTERPRETER_CHUNK == 16
