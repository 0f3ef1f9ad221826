"""`prepare-data --chat / --prompt-completion`: records -> documents with a loss mask, stored.

Storage is meshrun's token shards (storage.SplitWriter) with a loss-mask shard beside each
(`{split}-{k:05d}.mask.bin`, one uint8 per token) and the document starts (`{split}.docs.bin`);
meta.json ("format": "documents") says what the folder holds: the tokenizer and chat template
it was rendered with (both copied in), what is trained, the length limit and its policy, and
what was skipped, cut or split. Written into a staging folder and renamed into place whole, as
`prepare` does; one process per `--out` at a time.

Documents longer than `max_len` tokens: `truncate` (the default) keeps their first `max_len`
tokens, so every trained token still follows the context it was written after; `split` cuts
them into pieces of `max_len` (a later piece trains its answer without the question before it);
`refuse` stops preparing, naming the record. A document with no trained token (no assistant
turn, or one cut away by truncation) trains nothing: it is skipped and counted.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.data.chat import (
    ChatTokenizer,
    Rendered,
    conversation,
    load_chat_tokenizer,
    prompt_completion,
    render_conversation,
    tokenize_rendered,
)
from meshrun.data.pairs import example_pairs
from meshrun.data.prepare import _check_out, balance_splits, check_enough, publishing, split_of
from meshrun.data.sources import Source, corpus_root, find_sources, records
from meshrun.data.storage import DOCUMENTS_FORMAT, SPLITS, SplitWriter, smallest_dtype
from meshrun.errors import ConfigError

LONG_POLICIES = ("truncate", "split", "refuse")
TRAIN_ON = ("assistant", "all")
BATCH = 256  # records tokenized per call


@dataclass(frozen=True)
class SupervisedOptions:
    """What `prepare-data` was asked: the kind of records, their field names, what is trained,
    and the length limit with its policy."""

    kind: str  # chat | prompt-completion
    fields: tuple[str, ...]  # (messages,) or (prompt, completion)
    train_on: str = "assistant"
    max_len: int = 2048
    long: str = "truncate"


def prepare_supervised(
    sources: list[str],
    out: str | Path,
    options: SupervisedOptions,
    *,
    tokenizer: str,
    chat_template: str | None = None,
    val_fraction: float = 0.05,
    shard_tokens: int = 1 << 28,
) -> dict[str, Any]:
    """Render, tokenize and store the records of `sources` in a new dataset folder `out`; returns
    its meta.json content."""
    out = Path(out)
    _check_out(out)
    chat = load_chat_tokenizer(tokenizer, template_file=chat_template, need_template=options.kind == "chat")
    found, _ = find_sources(sources) if sources else ([], [])
    if sources and not found:
        raise ConfigError(f"no files match --source {' '.join(sources)}")
    read = _records(found, options) if sources else example_conversations()
    with publishing(out) as staging:
        dtype = smallest_dtype(chat.spec.vocab_size)
        writers = {split: SplitWriter(staging, split, dtype, shard_tokens, masks=True) for split in SPLITS}
        counts: Counter[str] = Counter()
        for ids, mask in _documents(read, chat, options, counts):
            writers[split_of(ids, val_fraction)].add(ids, np.array([len(ids)]), mask)
        check_enough(writers, sources)
        balance_splits(writers, val_fraction)
        (staging / "tokenizer.json").write_text(chat.spec.json_text or "")
        if chat.template is not None:
            (staging / "chat_template.jinja").write_text(chat.template)
        splits = {split: w.close() for split, w in writers.items()}
        meta = _meta(chat, options, dtype, splits, counts, found, sources)
        (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _records(found: list[Source], options: SupervisedOptions) -> Iterator[tuple[str, dict[str, Any]]]:
    for source in found:
        yield from records(source, options.fields)


def example_conversations() -> Iterator[tuple[str, dict[str, Any]]]:
    """`prepare-data --chat` without --source: the no-download example, the encoder-decoder's
    pairs (data.pairs.example_pairs: snake_case names from the Python standard library) as
    one-turn conversations, the user giving a name and the assistant its CamelCase form."""
    for k, (name, camel) in enumerate(example_pairs()):
        messages = [{"role": "user", "content": name}, {"role": "assistant", "content": camel}]
        yield f"example conversation {k + 1}", {"messages": messages}


def _documents(
    read: Iterator[tuple[str, dict[str, Any]]], chat: ChatTokenizer, options: SupervisedOptions, counts: Counter[str]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of every stored document, in source order, after the length policy; `counts`
    gathers what was read, skipped, cut and split."""
    batch: list[Rendered] = []
    for where, record in read:
        counts["records"] += 1
        batch.append(_render(chat, options, record, where))
        if len(batch) >= BATCH:
            yield from _tokenized(chat, options, batch, counts)
            batch = []
    yield from _tokenized(chat, options, batch, counts)


def _render(chat: ChatTokenizer, options: SupervisedOptions, record: dict[str, Any], where: str) -> Rendered:
    if options.kind == "chat":
        return render_conversation(chat, conversation(record, where, options.fields[0]), where)
    return prompt_completion(record, where, (options.fields[0], options.fields[1]))


def _tokenized(
    chat: ChatTokenizer, options: SupervisedOptions, batch: list[Rendered], counts: Counter[str]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    if not batch:
        return
    plain = options.kind == "prompt-completion"
    for rendered, ids, mask in tokenize_rendered(chat, batch, train_on=options.train_on, plain=plain):
        for piece_ids, piece_mask in _within_limit(rendered, ids, mask, options, counts):
            if piece_mask.any():
                yield piece_ids, piece_mask
            else:
                counts["untrained"] += 1


def _within_limit(
    rendered: Rendered, ids: np.ndarray, mask: np.ndarray, options: SupervisedOptions, counts: Counter[str]
) -> list[tuple[np.ndarray, np.ndarray]]:
    limit = options.max_len
    if len(ids) <= limit:
        return [(ids, mask)]
    if options.long == "refuse":
        raise ConfigError(
            f"{rendered.where}: {len(ids)} tokens, longer than --max-len {limit}; raise --max-len, "
            "or pass --long truncate or --long split"
        )
    if options.long == "truncate":
        counts["truncated"] += 1
        return [(ids[:limit], mask[:limit])]
    counts["split"] += 1
    return [(ids[k : k + limit], mask[k : k + limit]) for k in range(0, len(ids), limit)]


def _meta(
    chat: ChatTokenizer,
    options: SupervisedOptions,
    dtype: np.dtype,
    splits: dict[str, dict[str, Any]],
    counts: Counter[str],
    found: list[Source],
    sources: list[str],
) -> dict[str, Any]:
    root = corpus_root(found) if found else Path()
    template = None
    if chat.template is not None:
        template = {
            "file": "chat_template.jinja",
            "from": chat.template_source,
            "sha256": hashlib.sha256(chat.template.encode()).hexdigest(),
            "assistant_tokens": "generation marks" if chat.marks_generation else "rendered prefixes",
        }
    return {
        "format": DOCUMENTS_FORMAT,
        "version": 1,
        "kind": options.kind,
        "fields": list(options.fields),
        "tokenizer": chat.spec.describe(),
        "vocab_size": chat.spec.vocab_size,
        "dtype": dtype.name,
        "chat_template": template,
        "loss_mask": {"dtype": "uint8", "trained": options.train_on, "file": "beside each shard (`mask`)"},
        "max_len": options.max_len,
        "long": options.long,
        "records": counts["records"],
        "documents": sum(s["documents"] for s in splits.values()),
        "train_tokens": splits["train"]["tokens"],
        "val_tokens": splits["val"]["tokens"],
        "trained_tokens": sum(s["trained_tokens"] for s in splits.values()),
        "skipped_untrained": counts["untrained"],
        "truncated": counts["truncated"],
        "split": counts["split"],
        "splits": splits,
        "sources": sources or ["the built-in example conversations (prepare-data --chat without --source)"],
        "files": [{"path": s.path.relative_to(root).as_posix(), "kind": s.kind, "sha256": s.sha256()} for s in found],
    }


def describe_documents(meta: dict[str, Any]) -> str:
    """The one line `prepare-data --chat / --prompt-completion` prints."""
    what = "conversations" if meta["kind"] == "chat" else "prompt/completion records"
    notes = [
        f"skipped {meta['skipped_untrained']} with no trained token" if meta["skipped_untrained"] else "",
        f"truncated {meta['truncated']} to {meta['max_len']} tokens" if meta["truncated"] else "",
        f"split {meta['split']} into pieces of {meta['max_len']} tokens" if meta["split"] else "",
    ]
    return (
        f"wrote {meta['documents']} documents from {meta['records']} {what} "
        f"({meta['train_tokens']} train and {meta['val_tokens']} val tokens, {meta['trained_tokens']} trained: "
        f"{meta['loss_mask']['trained']}; vocab {meta['vocab_size']}, {meta['dtype']})"
        + "".join(f"; {note}" for note in notes if note)
    )
