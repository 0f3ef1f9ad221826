"""Every tensor of a checkpoint index is tiled by its chunks, each with stored bytes, or nothing loads.

DCP loads what the index lists and leaves the rest of each tensor as it was: a chunk missing from the
index (a dropped shard), one outside the tensor's extent or two overlapping would load as part of the
tensor left at its fresh initialisation (resume) or at whatever memory held (export), with no error.
So before anything loads, each tensor's chunks must lie inside it, must not overlap, must cover its
whole volume, and each must have a storage entry whose bytes lie in a file inside the checkpoint folder
and can hold the chunk. Cost: O(chunks log chunks) per tensor, plus the cells of the grid the chunks'
edges cut it into (one per chunk for the grids dp, tp and FSDP shard into), bounded by `MAX_CELLS`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

# Pieces a tensor's chunk edges may cut it into: far more than any layout writes (dp x tp chunks
# of one tensor cut it into dp x tp), and a bound on the memory the overlap check takes (16 MiB).
MAX_CELLS = 1 << 22


def tiling_problem(metadata: Metadata, folder: Path) -> str | None:
    """The first tensor whose chunks do not tile it, with what is wrong, in words; None when all do."""
    file_sizes: dict[str, int | None] = {}
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            problem = _tensor_problem(name, entry, metadata.storage_data, folder, file_sizes)
            if problem is not None:
                return f"tensor {name!r} {problem}"
    return None


def _shape(value: Any) -> tuple[int, ...] | None:
    """`value` as a shape (whole numbers >= 0), or None when it is not one."""
    if not isinstance(value, tuple | list) or not all(type(v) is int and v >= 0 for v in value):
        return None
    return tuple(value)


def _tensor_problem(
    name: str,
    entry: TensorStorageMetadata,
    storage: Mapping[MetadataIndex, Any],
    folder: Path,
    file_sizes: dict[str, int | None],
) -> str | None:
    shape, dtype = _shape(entry.size), getattr(entry.properties, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype) or not isinstance(entry.chunks, list):
        return "has no valid shape, dtype or chunk list"
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in entry.chunks:
        offsets, sizes = _shape(getattr(chunk, "offsets", None)), _shape(getattr(chunk, "sizes", None))
        if offsets is None or sizes is None or len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"of shape {list(shape)} has a chunk that is not a box of its dimensions"
        where = f"its chunk at offsets {list(offsets)} of sizes {list(sizes)}"
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            return f"of shape {list(shape)}: {where} lies outside it"
        nbytes = math.prod(sizes) * dtype.itemsize  # an empty chunk (an FSDP shard past the end) holds none
        info = storage.get(MetadataIndex(name, offsets))
        if nbytes and (problem := _storage_problem(info, nbytes, folder, file_sizes)) is not None:
            return f"of shape {list(shape)}: {where} {problem}"
        boxes.append((offsets, sizes))
    return _cover_problem(shape, boxes)


def _storage_problem(info: Any, nbytes: int, folder: Path, file_sizes: dict[str, int | None]) -> str | None:
    """What is wrong with a chunk's storage entry `info` (None: it has none), for `nbytes` of data."""
    if info is None:
        return "has no stored bytes (no storage entry in the index)"
    file, offset, length = (getattr(info, key, None) for key in ("relative_path", "offset", "length"))
    if not isinstance(file, str) or type(offset) is not int or type(length) is not int or offset < 0:
        return "has a storage entry without a file, offset and length"
    if file not in file_sizes:
        file_sizes[file] = _size_inside(folder, file)
    size = file_sizes[file]
    if size is None:
        return f"is stored in {file!r}, which is not a file inside the checkpoint folder"
    if length < nbytes or offset + length > size:
        return f"is stored as {length} bytes at offset {offset} of {file!r} ({size} bytes), too few for its {nbytes}"
    return None


def _size_inside(folder: Path, file: str) -> int | None:
    """The size of `folder/file` when it is a regular file inside `folder` (no link out), else None."""
    path = folder / file
    try:
        inside = not Path(file).is_absolute() and path.resolve().is_relative_to(folder.resolve())
        return path.stat().st_size if inside and path.is_file() and not path.is_symlink() else None
    except (OSError, RuntimeError, ValueError):
        return None


def _cover_problem(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """Whether `boxes` (all inside `shape`) cover it exactly once: a hole or an overlap, in words.

    The boxes' edges cut the tensor into a grid of cells; each box paints its cells, and a cell
    painted never or twice is a hole or an overlap (exact, where comparing volumes alone cannot tell
    an overlap that hides a hole)."""
    volume, covered = math.prod(shape), sum(math.prod(sizes) for _, sizes in boxes)
    if volume == 0:
        return None
    boxes = [box for box in boxes if math.prod(box[1])]  # empty chunks cover nothing
    cuts = [
        sorted({0, dim, *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)}) for d, dim in enumerate(shape)
    ]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_CELLS:
        return f"is cut by its {len(boxes)} chunks into {cells} pieces, more than {MAX_CELLS}: no layout writes that"
    painted = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for offsets, sizes in boxes:
        where = tuple(
            slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s))
            for c, o, s in zip(cuts, offsets, sizes, strict=True)
        )
        painted[where] += 1
    for bad, what in ((painted > 1, "overlap"), (painted == 0, "leave a hole")):
        if bool(bad.any()):
            cell = [int(i) for i in bad.nonzero()[0]]
            element = [c[i] for c, i in zip(cuts, cell, strict=True)]
            return (
                f"of shape {list(shape)}: its chunks ({len(boxes)}) {what} at element {element} "
                f"(they cover {covered} elements of {volume})"
            )
    return None
