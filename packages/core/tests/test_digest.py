"""Piece digests and the region hash (openprime.core.digest)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from openprime.core import digest
from openprime.core.transport import as_bytes


def views(*sizes: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [as_bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)) for n in sizes]


def test_each_piece_is_the_xxh3_of_those_bytes_of_the_concatenation_even_across_views():
    parts = views(700, 0, 1300, 5)  # pieces of 512: piece 1 spans the first and third views, the last is short
    whole = torch.cat(parts).numpy()
    got = digest.piece_digests(parts, piece_bytes=512)
    want = [xxhash.xxh3_64_intdigest(whole[lo:lo + 512]) for lo in range(0, whole.size, 512)]
    assert got.dtype == np.uint64 and got.tolist() == want and len(want) == 4
    assert digest.region_hash(parts, piece_bytes=512) == digest.combine(got)
    assert digest.region_hash([torch.cat(parts)], piece_bytes=512) == digest.combine(got)  # views do not matter


@pytest.mark.parametrize("num_threads", [2, 3, 7])
def test_threads_give_the_same_digests(num_threads):
    parts = views(10_000, 3_001, seed=1)
    assert (digest.piece_digests(parts, piece_bytes=1000, num_threads=num_threads)
            == digest.piece_digests(parts, piece_bytes=1000)).all()


def test_one_flipped_bit_or_a_moved_byte_changes_the_hash():
    parts = views(4096, seed=2)
    before = digest.region_hash(parts, piece_bytes=1024)
    parts[0][3000] ^= 1
    assert digest.region_hash(parts, piece_bytes=1024) != before
    parts[0][3000] ^= 1
    swapped = torch.cat([parts[0][1024:2048], parts[0][:1024], parts[0][2048:]])  # two pieces trade places
    assert digest.region_hash([swapped], piece_bytes=1024) != before
    assert digest.region_hash(parts, piece_bytes=1024) == before


def test_checksum_is_a_signed_64_bit_int_and_an_empty_region_has_a_hash():
    digests = digest.piece_digests(views(5000, seed=3), piece_bytes=1000)
    value = digest.checksum(digests)
    assert -(1 << 63) <= value < 1 << 63 and torch.tensor([value], dtype=torch.int64).item() == value
    assert digest.piece_digests([], piece_bytes=1000).size == 0
    assert len(digest.combine(np.empty(0, dtype=np.uint64))) == 32
    with pytest.raises(ValueError, match="piece_bytes must be positive"):
        digest.piece_digests(views(10), piece_bytes=0)
