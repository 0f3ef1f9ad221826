"""`meshrun prepare-data`: sources -> tokens (in worker processes) -> shards + meta.json.

Streaming end to end: documents are read one file (or record batch) at a time, encoded in
batches of about 1 MB by `--workers` processes with at most two batches each in flight, and
appended to shards in input order, so memory stays bounded and the output does not depend on
the number of workers. Everything is written into a staging folder beside `--out` and renamed
into place at the end: an interrupted run leaves nothing that training accepts, and a rerun
starts the staging folder afresh and produces the same files. One process prepares an `--out` at
a time (a lock beside it): a second job waits, then uses or refuses the first one's dataset.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.data.masking import masking_vocabulary
from meshrun.data.sources import (
    Document,
    Source,
    corpus_root,
    default_sources,
    documents,
    expand_sources,
    find_sources,
)
from meshrun.data.storage import SPLITS, SplitWriter, read_meta, smallest_dtype
from meshrun.data.tokenize import (
    TokenizerSpec,
    byte_tokenizer,
    encode_ordered,
    load_tokenizer,
    train_bpe,
)
from meshrun.errors import ConfigError
from meshrun.files.atomic import disk_error, publish_folder
from meshrun.files.console import say

__all__ = ["SPLITS", "default_sources", "expand_sources", "is_prepared", "prepare"]
TASK_BYTES = 1 << 20
BPE_TRAIN_BYTES = 4 << 20  # a byte-level BPE is trained on about this much text, sampled evenly
SAY_PHASES_FROM_BYTES = 1 << 20  # sources this large take seconds: each phase says so as it starts
SHARD_TOKENS = 1 << 28  # 256 Mi tokens per shard (512 MB of uint16)
MIN_TOKENS = 64  # fewer cannot train anything: refuse rather than write a useless dataset
STAGING_MARK = ".meshrun-staging"
LOCK_SUFFIX = ".meshrun-lock"


def is_prepared(out: str | Path) -> bool:
    """A complete dataset: meta.json (written last) or meshrun 0.1's train.bin + val.bin."""
    out = Path(out)
    return (out / "meta.json").is_file() or all((out / f"{split}.bin").is_file() for split in SPLITS)


def prepare(
    sources: list[str],
    out: str | Path,
    *,
    val_fraction: float = 0.05,
    tokenizer: str = "byte",
    train_tokenizer: str | None = None,
    field: str = "text",
    workers: int | None = None,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
    reuse: bool = False,
    task: str = "causal_lm",
) -> dict[str, Any]:
    """Tokenize `sources` into a new dataset folder `out`; returns its meta.json content.

    Each document goes wholly to train or val by a hash of its content, so the split is stable
    when sources are added, moved or renamed. `reuse`: a dataset already in `out` (or one another
    job prepares there meanwhile) is used as it is, not refused (training's first-use preparation).
    `task`: causal_lm or masked_lm (the same token shards; masked_lm's meta.json adds the mask token
    and the special ids, data/masking.py).
    """
    out = Path(out)
    try:
        _check_out(out)
        found, skipped = find_sources(sources)
        if not found:
            raise ConfigError(f"no files match --source {' '.join(sources)}")
        root = corpus_root(found)
        with publishing(out) as staging:
            meta = _write(
                staging,
                found,
                root,
                sources,
                tokenizer=tokenizer,
                train_tokenizer=train_tokenizer,
                field=field,
                val_fraction=val_fraction,
                workers=workers,
                shard_tokens=shard_tokens,
                progress=progress,
                task=task,
            )
            meta["skipped_files"] = skipped
            (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    except AlreadyPrepared:
        if not reuse:
            raise
        return read_meta(out) or {}  # there already, or another job prepared it while this one waited
    return meta


def _write(
    staging: Path,
    found: list[Source],
    root: Path,
    sources: list[str],
    *,
    tokenizer: str,
    train_tokenizer: str | None,
    field: str,
    val_fraction: float,
    workers: int | None,
    shard_tokens: int,
    progress: bool,
    task: str,
) -> dict[str, Any]:
    """The tokenizer and every split's shards into `staging`; returns the meta.json content.
    `progress`: a line as each phase starts where the sources are large enough to take seconds
    (the default job's first use took ~30 s with none), and the tokenizing bar on a terminal."""
    total = sum(source.size() for source in found)
    progress = progress and total >= SAY_PHASES_FROM_BYTES  # a quick one says nothing (a refusal stays one line)
    if progress and train_tokenizer:
        sample = min(total, BPE_TRAIN_BYTES)
        say(f"training the {train_tokenizer} tokenizer on {sample / 1e6:.1f} MB sampled from {len(found)} files")
    spec = _tokenizer(tokenizer, train_tokenizer, found, field)
    if progress:
        say(f"tokenizing {total / 1e6:.1f} MB in {len(found)} files ({spec.name} tokenizer)")
    if spec.json_text is not None:
        (staging / "tokenizer.json").write_text(spec.json_text)
    dtype = smallest_dtype(spec.vocab_size)
    writers = {split: SplitWriter(staging, split, dtype, shard_tokens) for split in SPLITS}
    records: list[dict[str, Any]] = []
    tasks = _tasks(found, root, spec, field=field, val_fraction=val_fraction, records=records, progress=progress)
    for splits, (tokens, lengths) in encode_ordered(spec, tasks, workers=workers or os.cpu_count() or 1):
        for split in SPLITS:
            mine = [i for i, s in enumerate(splits) if s == split]
            if mine:
                starts = lengths.cumsum() - lengths
                parts = [tokens[starts[i] : starts[i] + lengths[i]] for i in mine]
                writers[split].add(_concat(parts), lengths[mine])
    check_enough(writers, sources)
    balance_splits(writers, val_fraction)
    meta = _meta(spec, dtype, {split: w.close() for split, w in writers.items()}, records, sources)
    if task == "masked_lm":
        meta.update(masking_vocabulary(spec.vocab_size, spec.eos_ids, spec.json_text))
    return meta | {"task": task}


class AlreadyPrepared(ConfigError):
    """`--out` holds a dataset (perhaps one another job finished while this one waited for it)."""


def _check_out(out: Path) -> None:
    if is_prepared(out):
        raise AlreadyPrepared(f"{out} already holds a prepared dataset; choose another --out or delete it")
    if out.is_dir() and any(out.iterdir()):  # a user's own files: never write among them
        names = sorted(p.name for p in out.iterdir())
        raise ConfigError(f"{out} already has {', '.join(names[:5])}; prepare into an empty folder or move those files")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"cannot prepare data in {out}: it is a file; choose a folder for --out")


@contextlib.contextmanager
def publishing(out: Path) -> Iterator[Path]:
    """A fresh staging folder to write the dataset `out` into, published as `out` in one rename
    when the block ends without an error and removed when it fails (its space back on a full
    disk). One process at a time per `out` (see `_one_writer`): a job that waited finds the
    other's complete dataset and gets `AlreadyPrepared`."""
    with _one_writer(out):
        _check_out(out)
        staging = _fresh_staging(out)
        try:
            yield staging
            (staging / STAGING_MARK).unlink()
            publish_folder(staging, out)  # every file made durable, then one rename
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise disk_error(exc, Path(exc.filename or out)) from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


@contextlib.contextmanager
def _one_writer(out: Path) -> Iterator[None]:
    """An exclusive flock on `.OUT.meshrun-lock` beside `out` (two jobs may prepare one data.dir at
    once), removed by its holder when done. A waiter that then holds a removed file's lock tries
    again on the current one, so two processes never both hold it."""
    lock = out.parent / f".{out.name}{LOCK_SUFFIX}"
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # for writing: NFS emulates flock with fcntl locks
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process preparing {out}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _same_file(fd, lock):
            break
        os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _fresh_staging(out: Path) -> Path:
    """The staging folder beside `out`; one left by a killed run is started afresh (under the
    lock, so it is no live job's)."""
    staging = out.parent / f".{out.name}.partial"
    if staging.exists():
        if not (staging / STAGING_MARK).is_file():
            raise ConfigError(f"{staging} exists and is not meshrun's; move it away and rerun")
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    (staging / STAGING_MARK).write_text("an interrupted `meshrun prepare-data`; rerunning it starts afresh\n")
    return staging


def _tokenizer(tokenizer: str, train_tokenizer: str | None, found: list[Source], field: str) -> TokenizerSpec:
    if train_tokenizer:
        if tokenizer != "byte":
            raise ConfigError("--tokenizer and --train-tokenizer exclude each other; pass one")
        return train_bpe(_spread_sample(found, field, BPE_TRAIN_BYTES), train_tokenizer)
    return byte_tokenizer() if tokenizer == "byte" else load_tokenizer(tokenizer)


def _spread_sample(found: list[Source], field: str, budget: int) -> Iterator[str | bytes]:
    """Documents totalling about `budget` bytes, spread evenly over the whole corpus: a BPE
    learns its merges as well from a few MB as from the rest, in a fraction of the time."""
    share = min(1.0, budget / max(1, sum(source.size() for source in found)))
    seen = taken = 0.0
    for source in found:
        for doc in documents(source, field=field, text=True):
            if isinstance(doc, np.ndarray):
                raise ConfigError(
                    f"{source.path}: {field!r} holds token ids, and --train-tokenizer trains on text; "
                    "pass the --tokenizer that made the ids instead"
                )
            seen += len(doc)
            if taken < share * seen:
                taken += len(doc)
                yield doc


def _tasks(
    found: list[Source],
    root: Path,
    spec: TokenizerSpec,
    *,
    field: str,
    val_fraction: float,
    records: list[dict[str, Any]],
    progress: bool,
) -> Iterator[tuple[list[str], list[Document]]]:
    """Batches of about TASK_BYTES of documents, tagged with each document's split; token ids are
    checked against `spec` here, where the file they came from is known."""
    from tqdm import tqdm

    total = sum(source.size() for source in found)
    # On a terminal only (disable=None), and cleared when done: logs and errors stay one line each.
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="tokenizing",
        file=sys.stderr,
        mininterval=0.5,
        disable=None if progress else True,
        leave=False,
        dynamic_ncols=True,
    )
    splits: list[str] = []
    docs: list[Document] = []
    size = 0
    with bar:
        for source in found:
            rel = source.path.relative_to(root).as_posix()
            num_docs = 0
            for doc in documents(source, field=field, text=spec.json_text is not None):
                if isinstance(doc, np.ndarray):
                    _check_ids(doc, source, field, spec)
                splits.append(split_of(doc, val_fraction))
                docs.append(doc)
                size += doc.nbytes if isinstance(doc, np.ndarray) else len(doc)
                num_docs += 1
                if size >= TASK_BYTES:
                    yield splits, docs
                    bar.update(size)
                    splits, docs, size = [], [], 0
            records.append(_record(source, rel, num_docs))
        if docs:
            yield splits, docs
        bar.update(max(0, total - bar.n))


def _check_ids(ids: np.ndarray, source: Source, field: str, spec: TokenizerSpec) -> None:
    """Token ids are stored as given: they must be ids of the tokenizer that made them."""
    if spec.json_text is None:
        raise ConfigError(
            f"{source.path}: {field!r} holds token ids; pass the --tokenizer (a tokenizer.json or model folder) "
            "that made them"
        )
    if len(ids) and (ids.min() < 0 or ids.max() >= spec.vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ConfigError(
            f"{source.path}: {field!r} holds token id {bad}, not an id of --tokenizer {spec.name} "
            f"({spec.vocab_size} ids); pass the tokenizer that made them"
        )


def _record(source: Source, rel: str, num_docs: int) -> dict[str, Any]:
    return {"path": rel, "kind": source.kind, "bytes": source.size(), "documents": num_docs, "sha256": source.sha256()}


def _concat(parts: list) -> Any:
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def check_enough(writers: dict[str, SplitWriter], sources: list[str]) -> None:
    tokens = sum(w.num_tokens for w in writers.values())
    if not sum(w.num_docs for w in writers.values()):
        raise ConfigError(f"--source {' '.join(sources)} holds no documents; check the files (and --field)")
    if tokens < MIN_TOKENS:
        raise ConfigError(
            f"--source {' '.join(sources)} gives only {tokens} tokens, too few to train "
            f"(at least {MIN_TOKENS}); add more text"
        )


def split_of(doc: Document, val_fraction: float) -> str:
    """A document's split follows its content alone: adding, moving or renaming sources never moves
    a document between train and val, and copies of one text all land in the same split."""
    if isinstance(doc, str):
        crc = zlib.crc32(doc.encode("utf-8", "surrogatepass"))
    else:
        crc = zlib.crc32(doc if isinstance(doc, bytes) else doc.astype("<i8", copy=False).tobytes())
    return "val" if crc % 10_000 < val_fraction * 10_000 else "train"


def balance_splits(writers: dict[str, SplitWriter], val_fraction: float) -> None:
    """Tiny corpora can hash every document to one split: move one document over, or cut a lone one in two."""
    for empty, full in (("val", "train"), ("train", "val")):
        if writers[empty].num_docs:
            continue
        doc, mask = writers[full].pop_last_document()
        if writers[full].num_docs:
            writers[empty].add(doc, np.array([len(doc)]), mask)
        else:
            cut = min(max(1, round(len(doc) * (1 - val_fraction))), len(doc) - 1)
            writers["train"].add(doc[:cut], np.array([cut]), None if mask is None else mask[:cut])
            writers["val"].add(doc[cut:], np.array([len(doc) - cut]), None if mask is None else mask[cut:])
        return


def _meta(
    spec: TokenizerSpec,
    dtype: Any,
    splits: dict[str, dict[str, Any]],
    records: list[dict[str, Any]],
    sources: list[str],
) -> dict[str, Any]:
    return {
        "format": "meshrun",
        "version": 2,
        "tokenizer": spec.describe(),
        "vocab_size": spec.vocab_size,
        "dtype": dtype.name,
        "train_tokens": splits["train"]["tokens"],
        "val_tokens": splits["val"]["tokens"],
        "documents": sum(s["documents"] for s in splits.values()),
        "num_files": len(records),
        "splits": splits,
        "sources": sources,
        "files": records,
    }


def describe_dataset(meta: dict[str, Any]) -> str:
    """The one line `prepare-data` prints."""
    return (
        f"wrote {meta['train_tokens']} train and {meta['val_tokens']} val tokens from {meta['num_files']} files "
        f"({meta['documents']} documents, {meta['tokenizer']['name']} tokenizer, vocab {meta['vocab_size']}, {meta['dtype']})"
        + (f"; for masked_lm, mask id {meta['mask_id']}" if meta.get("task") == "masked_lm" else "")
        + (f"; skipped {meta['skipped_files']} hidden or binary files" if meta.get("skipped_files") else "")
    )
