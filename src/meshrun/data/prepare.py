"""Text files -> byte-level token memmaps (`train.bin`, `val.bin`, `meta.json`)."""

from __future__ import annotations

import glob
import json
import os
import sysconfig
import tempfile
import zlib
from pathlib import Path

import numpy as np

from meshrun.errors import ConfigError

SPLITS = ("train", "val")
OUTPUTS = ("train.bin", "val.bin", "meta.json")


def default_sources() -> list[str]:
    """A corpus every machine with Python has: the standard library's own source files
    (installed packages and the stdlib's test suite left out), about 20 MB."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    folders = sorted(d for d in stdlib.iterdir() if d.is_dir() and d.name not in skip)
    return [str(stdlib / "*.py")] + [str(d / "**" / "*.py") for d in folders]


def expand_sources(sources: list[str]) -> list[Path]:
    files: set[Path] = set()
    for source in sources:
        matches = glob.glob(source, recursive=True) if glob.has_magic(source) else [source]
        for match in matches:
            path = Path(match)
            if path.is_dir():
                files.update(p for p in path.rglob("*") if p.is_file())
            elif path.is_file():
                files.add(path)
    return sorted(files)


def is_prepared(out: str | Path) -> bool:
    return all((Path(out) / f"{split}.bin").is_file() for split in SPLITS)


def prepare(sources: list[str], out: str | Path, *, val_fraction: float = 0.05) -> dict:
    """Write the memmaps; refuses to touch a folder that already holds a prepared dataset.

    Each file goes wholly to train or val by a hash of its path, so the split is stable when
    files are added. Files are written under temporary names and renamed into place, so a
    crash never leaves a half-written dataset that looks complete.
    """
    out = Path(out)
    if is_prepared(out):
        raise ConfigError(f"{out} already holds a prepared dataset; choose another --out or delete it")
    existing = [name for name in OUTPUTS if (out / name).exists()]
    if existing:  # a user's own file with one of our names: never overwrite it
        raise ConfigError(f"{out} already has {', '.join(existing)}; prepare into an empty folder or move those files")
    files = expand_sources(sources)
    if not files:
        raise ConfigError(f"no files match --source {' '.join(sources)}")
    chunks: dict[str, list[bytes]] = {split: [] for split in SPLITS}
    root = Path(os.path.commonpath([f.parent for f in files]))
    for path in files:
        # Hash the path below the corpus root: the same files split the same wherever they live.
        key = str(path.relative_to(root)).encode()
        split = "val" if zlib.crc32(key) % 10_000 < val_fraction * 10_000 else "train"
        chunks[split].append(path.read_bytes() + b"\n\n")
    _ensure_both_splits(chunks, val_fraction)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"vocab_size": 256, "num_files": len(files), "sources": sources}
    for split in SPLITS:
        data = np.frombuffer(b"".join(chunks[split]), dtype=np.uint8)
        meta[f"{split}_tokens"] = int(data.size)
        _write_atomic(out / f"{split}.bin", data.tobytes())
    _write_atomic(out / "meta.json", json.dumps(meta, indent=2).encode())
    return meta


def _ensure_both_splits(chunks: dict[str, list[bytes]], val_fraction: float) -> None:
    """Tiny corpora can hash every file to one split: move one file over, or cut a lone file in two."""
    for empty, full in (("val", "train"), ("train", "val")):
        if chunks[empty]:
            continue
        if len(chunks[full]) > 1:
            chunks[empty].append(chunks[full].pop())
        else:
            blob = chunks[full].pop()
            cut = min(max(1, round(len(blob) * (1 - val_fraction))), len(blob) - 1)
            chunks["train"], chunks["val"] = [blob[:cut]], [blob[cut:]]


def _write_atomic(path: Path, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; datasets are shared (other users, container uids)
    os.replace(tmp, path)
