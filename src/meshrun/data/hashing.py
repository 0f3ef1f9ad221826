"""Stateless per-index hashing: every rank computes sample i's position from i and the seed
alone, so data order needs no shared state and is the same for any layout."""

from __future__ import annotations

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: i * GOLDEN mod 2^64 is equidistributed


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection on uint64 that scatters consecutive indices."""
    with np.errstate(over="ignore"):
        x = (x + GOLDEN) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def split_salt(seed: int, split_index: int) -> np.uint64:
    """The high 32 bits XORed into a split's sample indices: each (seed, split) draws its own order."""
    return np.uint64((seed * 2 + split_index) & 0xFFFFFFFF) << np.uint64(32)


def drawn_rows(first: int, count: int, num_rows: int, *, salt: np.uint64, in_order: bool) -> np.ndarray:
    """The rows of samples first .. first+count-1 among `num_rows`: in order and wrapping around
    (validation), or hash(salt, index) mod num_rows (training), as int64."""
    index = np.arange(first, first + count, dtype=np.uint64)
    mixed = index if in_order else splitmix64(index ^ salt)
    return (mixed % np.uint64(num_rows)).astype(np.int64)
