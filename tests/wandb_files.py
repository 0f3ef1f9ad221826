"""Read a wandb offline run (`offline-run-*/run-*.wandb`) back: config, history rows, summary.

wandb >= 0.30 has no Python reader (`wandb.sdk.internal.datastore` is gone), so this parses the
file itself. The format is a LevelDB-style record log:

    file header   7 bytes: b":W&B", magic 0xBEE1 (uint16 LE), version 0 (uint8)
    blocks        32 KiB each; a block holds chunks, each with a 7-byte header
                  (crc32 over the type byte then the data: uint32 LE, length: uint16 LE,
                  type: uint8 full=1 first=2 middle=3 last=4) followed by `length` bytes.
                  A block tail shorter than a chunk header is zero padding.
    records       first..middle..last chunks (or one full chunk) joined = one serialized
                  `wandb.proto.wandb_internal_pb2.Record`

Values inside records are JSON text (`value_json`), so numbers come back exactly as logged.
Kept in tests/ (not the package): users read runs with `wandb sync` or `wandb leet`; this exists
so tests can check the file's contents without trusting anything the writer says about itself.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK_HEADER = struct.Struct("<IHB")  # crc32, length, type
BLOCK_SIZE = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """The file is not a wandb transaction log or is corrupt."""


@dataclass
class WandbRun:
    run_id: str = ""
    project: str = ""
    display_name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    """One dict per history record, in order: metric -> value, plus `_step`, `_runtime`, ..."""
    summary: dict[str, Any] = field(default_factory=dict)

    def rows_by_step(self) -> dict[int, dict[str, Any]]:
        """History merged per `_step` (a step logged in several calls may span records)."""
        merged: dict[int, dict[str, Any]] = {}
        for row in self.history:
            merged.setdefault(row["_step"], {}).update(row)
        return merged


def records(path: Path) -> Iterator[pb.Record]:
    """Every record of a `.wandb` file, checksums verified."""
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER.size:
        raise WandbFileError(f"{path}: too short for a wandb file")
    ident, magic, version = FILE_HEADER.unpack_from(data)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise WandbFileError(f"{path}: bad header {ident!r} {magic:#x} v{version}")
    pos, pending = FILE_HEADER.size, bytearray()
    while pos < len(data):
        if BLOCK_SIZE - pos % BLOCK_SIZE < CHUNK_HEADER.size:
            pos += BLOCK_SIZE - pos % BLOCK_SIZE  # padding at the end of a block
            continue
        if pos + CHUNK_HEADER.size > len(data):
            raise WandbFileError(f"{path}: truncated chunk header at byte {pos}")
        checksum, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        pos += CHUNK_HEADER.size
        chunk = data[pos : pos + length]
        pos += length
        if len(chunk) != length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            raise WandbFileError(f"{path}: bad or truncated chunk (type {kind}) ending at byte {pos}")
        if kind in (FULL, FIRST):
            pending = bytearray()
        pending += chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(bytes(pending))
            yield record


def _set(target: dict[str, Any], item: Any) -> None:
    """Apply one config/summary/history item (`key` or `nested_key` path, JSON value)."""
    keys = list(item.nested_key) or [item.key]
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = json.loads(item.value_json)


def read_run(path: Path) -> WandbRun:
    run = WandbRun()
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project, run.display_name = record.run.run_id, record.run.project, record.run.display_name
            for item in record.run.config.update:
                _set(run.config, item)
        elif kind == "config":
            for item in record.config.update:
                _set(run.config, item)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _set(row, item)
            row.setdefault("_step", record.history.step.num)
            run.history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                _set(run.summary, item)
    run.config.pop("_wandb", None)
    return run


def offline_runs(wandb_parent: Path) -> list[Path]:
    """The `.wandb` files of all offline runs under `wandb_parent/wandb/`."""
    return sorted(Path(wandb_parent).glob("wandb/offline-run-*/run-*.wandb"))
