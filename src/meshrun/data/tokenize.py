"""Tokenization: bytes (vocab 256), a Hugging Face tokenizer, or a byte-level BPE trained here.

A tokenizer travels to worker processes as a small picklable `TokenizerSpec` (its
tokenizer.json text), so every worker encodes exactly as `tokenizers` does in the main process.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.pool
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.data.sources import Document
from meshrun.data.storage import tokenizer_file
from meshrun.errors import ConfigError
from meshrun.files.json_reader import read_json

BYTE_EOS = b"\n\n"  # byte-level data has no spare id: documents end with a blank line (as before)
BPE_EOS = "<|endoftext|>"
_EOS_NAMES = (BPE_EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to encode, and what meta.json records."""

    name: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    json_text: str | None = None  # tokenizer.json; None = bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256((self.json_text or "byte").encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "eos_ids": list(self.eos_ids)}


def refuse_custom_tokenizer(folder: Path, key: str) -> None:
    """meshrun never runs a model folder's own Python: a tokenizer_config.json whose `auto_map`
    sends transformers to it is refused in one line. (Every transformers call also passes
    trust_remote_code=False: a model config.json's auto_map is built without its code, by
    transformers' own class for the model_type, which must be a supported family.)"""
    config = folder / "tokenizer_config.json"
    try:
        auto_map = read_json(config).get("auto_map") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return  # not a readable config: the tokenizer's loader says so
    if auto_map:
        raise ConfigError(
            f"{key} {folder}: {config.name} maps the tokenizer to the folder's own code (auto_map {auto_map}), "
            "which meshrun never runs; pass a tokenizer.json file instead"
        )


def byte_tokenizer() -> TokenizerSpec:
    return TokenizerSpec("byte", 256, tuple(BYTE_EOS))


def load_tokenizer(path: str | Path) -> TokenizerSpec:
    """`tokenizer.json`, or a model folder (its tokenizer.json, else transformers' fast tokenizer)."""
    return _spec(str(path), *read_tokenizer(path))


def read_tokenizer(path: str | Path, *, flag: str = "--tokenizer") -> tuple[Any, str | None]:
    """(the `tokenizers` Tokenizer, its configured end-of-document token or None) of a
    tokenizer.json or a model folder, read the one way both data preparation and the data's
    tokenizer check read it (so equal tokenizers hash equal)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        refuse_custom_tokenizer(path, flag)
    try:
        if path.is_file():
            return Tokenizer.from_file(str(path)), None
        if (path / "tokenizer.json").is_file():
            return Tokenizer.from_file(str(path / "tokenizer.json")), _configured_eos(path)
        if path.is_dir():
            return _transformers_tokenizer(path)
        raise ConfigError(f"{flag} {path} does not exist; give a tokenizer.json or a model folder")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizers / transformers parse errors
        raise ConfigError(f"{flag} {path} cannot be loaded: {' '.join(str(exc).split()) or 'unreadable'}") from None


def train_bpe(texts: Iterable[str | bytes], spec_text: str) -> TokenizerSpec:
    """`bpe:VOCAB`: a byte-level BPE (GPT-2 style) trained on the documents, with `<|endoftext|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from meshrun.config.schema import bpe_vocab

    vocab = bpe_vocab(spec_text, key="--train-tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BPE_EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator((as_text(t) for t in texts), trainer=trainer)
    return _spec(spec_text, tokenizer, BPE_EOS)


def _spec(name: str, tokenizer: Any, eos: str | None) -> TokenizerSpec:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos = eos or next((t for t in _EOS_NAMES if t in vocab), None)
    if eos is None or eos not in vocab:
        raise ConfigError(
            f"--tokenizer {name} has no end-of-document token (looked for {eos or ', '.join(_EOS_NAMES)}); "
            "add one to the tokenizer, or set eos_token in its tokenizer_config.json"
        )
    return TokenizerSpec(name, id_count(tokenizer), (vocab[eos],), tokenizer.to_str())


def id_count(tokenizer: Any) -> int:
    """Ids, not entries: a vocabulary with holes still needs room for its top id."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def _configured_eos(folder: Path) -> str | None:
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def _transformers_tokenizer(folder: Path) -> tuple[Any, str | None]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    if not getattr(tok, "is_fast", False):
        raise ConfigError(f"--tokenizer {folder}: only fast (tokenizers-backed) tokenizers are supported")
    return tok.backend_tokenizer, tok.eos_token


def as_text(doc: str | bytes) -> str:
    return doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc


class Encoder:
    """Documents -> one flat uint32 array (each document followed by EOS) and per-document lengths.
    Token ids (an int64 array, checked by the caller) are taken as they are, and get an EOS unless
    they end with one already."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self.tokenizer = None
        if spec.json_text is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_str(spec.json_text)
            # a document that mentions "<|endoftext|>" is text, not a boundary: only the
            # separator appended below is the EOS id (as tiktoken's disallowed_special guards)
            self.tokenizer.encode_special_tokens = True

    def __call__(self, docs: Sequence[Document]) -> tuple[np.ndarray, np.ndarray]:
        if self.tokenizer is None:  # bytes (token ids need a tokenizer: refused before they get here)
            pieces = [(d.encode("utf-8") if isinstance(d, str) else bytes(d)) + BYTE_EOS for d in docs]
            lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
            return np.frombuffer(b"".join(pieces), dtype=np.uint8).astype(np.uint32), lengths
        texts = [as_text(d) for d in docs if not isinstance(d, np.ndarray)]
        encoded = iter(self.tokenizer.encode_batch_fast(texts, add_special_tokens=False))
        eos = np.array(self.spec.eos_ids, dtype=np.int64)
        pieces = []
        for doc in docs:
            if isinstance(doc, np.ndarray) and len(doc) >= len(eos) and (doc[len(doc) - len(eos) :] == eos).all():
                pieces.append(doc)  # token ids that end with EOS already
            else:
                ids = doc if isinstance(doc, np.ndarray) else next(encoded).ids
                pieces.append(np.concatenate([ids, eos]))
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        return np.concatenate(pieces).astype(np.uint32) if pieces else np.empty(0, np.uint32), lengths


_worker_encoder: Encoder | None = None


def encode_texts(spec: TokenizerSpec, texts: list[str], *, shift: int) -> list[np.ndarray]:
    """Each text's token ids plus `shift` (pairs: past the special ids); the document EOS the encoder adds is dropped."""
    tokens, lengths = Encoder(spec)(list(texts))
    ends, eos = np.cumsum(lengths), len(spec.eos_ids)
    return [tokens[end - length : end - eos].astype(np.int64) + shift for end, length in zip(ends, lengths)]


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(spec)


def _encode_in_worker(docs: Sequence[Document]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_encoder is not None
    return _worker_encoder(docs)


def encode_ordered(
    spec: TokenizerSpec, tasks: Iterable[tuple[Any, Sequence[Document]]], *, workers: int
) -> Iterator[tuple[Any, tuple[np.ndarray, np.ndarray]]]:
    """(tag, documents) -> (tag, encoded), in input order, at most 2 x workers batches in flight
    (bounded memory: reading never runs far ahead of tokenizing)."""
    if workers <= 1 or spec.json_text is None:  # bytes need no tokenizing: one process is fastest
        encoder = Encoder(spec)
        for tag, docs in tasks:
            yield tag, encoder(docs)
        return
    with _start_pool(workers, spec) as pool:
        yield from _bounded(pool.apply_async, tasks, limit=2 * workers)


def _start_pool(workers: int, spec: TokenizerSpec) -> multiprocessing.pool.Pool:
    """Workers with TOKENIZERS_PARALLELISM=false from birth (one process per core already; and no
    warning from a forked tokenizer); this process's own setting is left as it was."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return _pool_context().Pool(workers, initializer=_init_worker, initargs=(spec,))
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _pool_context() -> multiprocessing.context.BaseContext:
    """spawn, never fork: a preparing process has native threads Python cannot see (a BPE trainer's
    Rust pool, BLAS, torch), and a child forked while one of them held a lock can wait forever; an
    intermittent hang at "preparing" (2 in ~10 full-suite runs, under load) matched that. Spawned
    workers cost about a second each to start, once per preparation."""
    return multiprocessing.get_context("spawn")


def _bounded(submit: Callable, tasks: Iterable[tuple[Any, Sequence]], *, limit: int) -> Iterator[tuple[Any, Any]]:
    pending: deque = deque()
    for tag, docs in tasks:
        pending.append((tag, submit(_encode_in_worker, (docs,))))
        if len(pending) >= limit:
            tag_done, result = pending.popleft()
            yield tag_done, result.get()
    while pending:
        tag_done, result = pending.popleft()
        yield tag_done, result.get()


def text_codec(data_dir: Path | None, vocab_size: int) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """(encode, decode) for the tokenizer a dataset was made with: its tokenizer.json, or bytes."""
    path = tokenizer_file(data_dir) if data_dir is not None else None
    if path is not None and path.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
        return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), tokenizer.decode
    if vocab_size == 256:
        return (lambda text: list(text.encode("utf-8"))), (lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    raise ConfigError(
        f"no tokenizer.json beside the data ({data_dir}) for this {vocab_size}-token model; "
        "put the tokenizer.json the data was made with there"
    )
