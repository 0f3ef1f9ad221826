"""Deterministic batches from token files, addressed by global sample index.

Sample `i` of the stream is the window starting at `hash(seed, i)`: the data a step sees
depends only on the step and the global batch, never on how ranks split it. Resuming or
changing dp therefore needs only the number of global samples consumed. A mixture maps
sample `i` to a source by weight (again a pure function of `i`), then reads that source's
sample `i`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from meshrun.data.hashing import GOLDEN, splitmix64
from meshrun.data.storage import DOCUMENTS_FORMAT, SPLITS, open_split, read_meta
from meshrun.data.token_ids import check_token_files
from meshrun.errors import ConfigError

if TYPE_CHECKING:
    from meshrun.config.schema import DataConfig
    from meshrun.data.packed import PackedDataset
    from meshrun.data.pairs import PairsDataset


class TokenDataset:
    """Read-only view of one split of any stored format; `batch(first, count)` returns inputs
    and next-token targets. Windows never cross from one shard to the next."""

    def __init__(
        self,
        data_dir: str | Path,
        split: str,
        *,
        seq_len: int,
        seed: int,
        format: str = "meshrun",
        val_fraction: float = 0.05,
    ) -> None:
        tokens = open_split(data_dir, split, format=format, val_fraction=val_fraction)
        if tokens.num_tokens < seq_len + 1:
            raise ConfigError(
                f"{tokens.where} holds {tokens.num_tokens} tokens, fewer than model.seq_len + 1 = "
                f"{seq_len + 1}; prepare more text or lower model.seq_len"
            )
        starts = [max(0, len(segment) - seq_len) for segment in tokens.segments]
        if not sum(starts):
            raise ConfigError(
                f"{tokens.where}: no shard holds model.seq_len + 1 = {seq_len + 1} tokens; "
                "prepare with larger --shard-tokens or lower model.seq_len"
            )
        self.segments, self.vocab_size, self.tokenizer, self.where, self.files = (
            tokens.segments,
            tokens.vocab_size,
            tokens.tokenizer,
            tokens.where,
            tokens.files,
        )
        self.first_start = np.cumsum([0, *starts[:-1]])
        self.num_starts = sum(starts)
        self.seq_len = seq_len
        self.salt = np.uint64((seed * 2 + SPLITS.index(split)) & 0xFFFFFFFF) << np.uint64(32)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first+count-1 of the stream as (x, y), each (count, seq_len) int64."""
        return self.windows(np.arange(first, first + count, dtype=np.uint64))

    def windows(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples with these global indices, as (x, y)."""
        starts = (splitmix64(index.astype(np.uint64) ^ self.salt) % np.uint64(self.num_starts)).astype(np.int64)
        length = self.seq_len + 1
        if len(self.segments) == 1:
            rows = [self.segments[0][s : s + length] for s in starts]
        else:
            which = np.searchsorted(self.first_start, starts, side="right") - 1
            local = starts - self.first_start[which]
            rows = [self.segments[w][s : s + length] for w, s in zip(which, local)]
        window = (
            torch.from_numpy(np.stack(rows).astype(np.int64)) if rows else torch.empty(0, length, dtype=torch.int64)
        )
        return window[:, :-1], window[:, 1:]

    def target_tokens(self, first: int, count: int) -> int:
        """Target tokens of samples first .. first+count-1 (windows are never padded)."""
        return count * self.seq_len

    def source_counts(self, first: int, count: int) -> dict[str, int]:
        """Samples per mixture source (none for a single dataset)."""
        return {}


class MixtureDataset:
    """Several datasets sampled by weight: global sample `i` comes from the source whose weight
    interval holds `i * golden mod 1` (shares within O(log n / n) of the weights), and is that
    source's own sample `i`."""

    def __init__(self, parts: Sequence[TokenDataset], weights: Sequence[float], names: Sequence[str]) -> None:
        self.parts, self.names = list(parts), list(names)
        # scaled by a power of two so the largest is below 1: no sum overflows ([1e308, 1e308] summed
        # to inf and sent every sample to the last source), and for any other weights the shares
        # round exactly as unscaled (a power-of-two scale is exact)
        scaled = np.asarray(weights, dtype=np.float64)
        scaled = np.ldexp(scaled, -np.frexp(scaled.max())[1])
        cumulative = np.cumsum(scaled) / scaled.sum()
        self.thresholds = np.array([int(c * 2.0**64) for c in cumulative[:-1]], dtype=np.uint64)
        self.seq_len = parts[0].seq_len

    def sources(self, index: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            position = index.astype(np.uint64) * GOLDEN
        return np.searchsorted(self.thresholds, position, side="right")

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = np.arange(first, first + count, dtype=np.uint64)
        source = self.sources(index)
        x = torch.empty(count, self.seq_len, dtype=torch.int64)
        y = torch.empty_like(x)
        for k, part in enumerate(self.parts):
            rows = torch.from_numpy(np.flatnonzero(source == k))
            if len(rows):
                x[rows], y[rows] = part.windows(index[rows.numpy()])
        return x, y

    def target_tokens(self, first: int, count: int) -> int:
        return count * self.seq_len

    def source_counts(self, first: int, count: int) -> dict[str, int]:
        """Samples first .. first+count-1 drawn from each source (counted in chunks: bounded memory)."""
        totals = np.zeros(len(self.parts), dtype=np.int64)
        for start in range(first, first + count, 1 << 20):
            index = np.arange(start, min(start + (1 << 20), first + count), dtype=np.uint64)
            totals += np.bincount(self.sources(index), minlength=len(self.parts))
        return dict(zip(self.names, totals.tolist()))


def source_names(dirs: Sequence[str]) -> list[str]:
    """Short names for metrics: the folder names, numbered where they repeat."""
    names = [Path(d).name or str(d) for d in dirs]
    return [f"{n}.{k}" if names.count(n) > 1 else n for k, n in enumerate(names)]


def open_dataset(
    data: DataConfig,
    data_dir: Path,
    split: str,
    *,
    seq_len: int,
    seed: int,
    source_len: int | None = None,
    global_batch: int = 1,
) -> TokenDataset | MixtureDataset | PairsDataset | PackedDataset:
    """The configured data (one folder, or a mixture) for one split; `source_len`: the encoder's
    share of seq_len when a pairs folder feeds an encoder-decoder (None: decoder-only);
    `global_batch`: the samples that share one length bucket (pairs with data.buckets)."""
    meta = read_meta(Path(data_dir)) if not data.mixture and data.format == "meshrun" else None
    if meta is not None and meta.get("format") == DOCUMENTS_FORMAT:
        from meshrun.data.packed import PackedDataset

        packing = data.packing is not False
        return PackedDataset(data_dir, split, seq_len=seq_len, seed=seed, packing=packing)
    if data.packing is not None:
        raise ConfigError(
            f"data.packing arranges documents prepared with --chat or --prompt-completion, but {data_dir} holds "
            "another kind of data; remove data.packing"
        )
    if meta is not None and meta.get("format") == "pairs":
        from meshrun.data.pairs import PairsDataset

        return PairsDataset(
            data_dir,
            split,
            meta,
            seq_len=seq_len,
            seed=seed,
            source_len=source_len,
            buckets=data.buckets,
            global_batch=global_batch,
        )
    if not data.mixture:
        return TokenDataset(
            data_dir, split, seq_len=seq_len, seed=seed, format=data.format, val_fraction=data.val_fraction
        )
    parts = [
        TokenDataset(m.dir, split, seq_len=seq_len, seed=seed + k, format=m.format, val_fraction=data.val_fraction)
        for k, m in enumerate(data.mixture)
    ]
    return MixtureDataset(parts, [m.weight for m in data.mixture], source_names([m.dir for m in data.mixture]))


def check_vocab(data_vocab: int | None, model_vocab_size: int, where: str, *, key: str = "model.vocab_size") -> None:
    """Token ids must fit the model's embedding. `model_vocab_size` is the built-in model's
    model.vocab_size or a Hugging Face config's vocab_size; `key` says where it is set."""
    if data_vocab is not None and data_vocab > model_vocab_size:
        raise ConfigError(
            f"{where} was tokenized with a vocabulary of {data_vocab} tokens but the model has "
            f"{model_vocab_size} ({key}); set {key} to at least {data_vocab}"
        )


def check_pretrained_reads(part: TokenDataset | PairsDataset, model_tokenizer: Path | None) -> None:
    """Pretrained weights read ids as their own tokenizer's: pairs ids are shifted past meshrun's
    pad/BOS/EOS, and byte ids are not the tokens of a model that ships a tokenizer."""
    from meshrun.data.pairs import PairsDataset

    fix = "or set model.init=random to train the architecture from scratch"
    if isinstance(part, PairsDataset):
        raise ConfigError(
            f"{part.where} holds pairs data, whose ids (the tokenizer's + 3, after pad/BOS/EOS) a pretrained model "
            f"would misread; fine-tune it on documents (`meshrun prepare-data --tokenizer MODEL_DIR`), {fix}"
        )
    if model_tokenizer is not None and part.tokenizer and part.tokenizer["name"] == "byte":
        raise ConfigError(
            f"{part.where} holds byte ids, not the tokens of the pretrained model's {model_tokenizer}; prepare it "
            f"with `meshrun prepare-data --tokenizer {model_tokenizer.parent} ...`, {fix}"
        )


def check_data(
    data: DataConfig,
    data_dir: Path,
    *,
    seq_len: int,
    model_vocab_size: int,
    vocab_key: str = "model.vocab_size",
    model_tokenizer: Path | None = None,
    pretrained: bool = False,
    source_len: int | None = None,
) -> None:
    """Fail early (before spawning) on missing, unparsable, empty or too-small data, a vocabulary
    larger than the model's, token ids beyond either or unlike what meta.json recorded (token_ids),
    mixture sources tokenized differently, data tokenized with another tokenizer than the one the
    model ships (`model_tokenizer`: its tokenizer.json, tokenizer.model or vocab.json), ids a
    `pretrained` model would misread, and length buckets that do not fit the model (`source_len`:
    as for open_dataset)."""
    tokenizers = set()
    for split in SPLITS:
        dataset = open_dataset(data, data_dir, split, seq_len=seq_len, seed=0, source_len=source_len)
        if data.buckets and not hasattr(dataset, "lengths"):
            raise ConfigError(f"data.buckets needs pairs data, but {data_dir} holds token windows; remove data.buckets")
        for part in getattr(dataset, "parts", [dataset]):
            check_vocab(part.vocab_size, model_vocab_size, part.where, key=vocab_key)
            check_token_files(part.files, vocab_size=part.vocab_size, model_vocab_size=model_vocab_size, key=vocab_key)
            if pretrained:
                check_pretrained_reads(part, model_tokenizer)
            if part.tokenizer:
                tokenizers.add((part.tokenizer["name"], part.tokenizer["sha256"]))
    if len(tokenizers) > 1:
        raise ConfigError(
            f"data.mixture sources were tokenized differently ({', '.join(sorted(n for n, _ in tokenizers))}); "
            "prepare them with the same tokenizer"
        )
    if model_tokenizer is not None and tokenizers:
        check_same_tokenizer(tokenizers.pop(), model_tokenizer)


def check_same_tokenizer(data_tokenizer: tuple[str, str], model_tokenizer: Path) -> None:
    """Token ids mean words only under the tokenizer that made them: data prepared with another
    tokenizer than the model's would train (and sample) on the wrong words. Byte-level data
    carries no tokenizer of its own and trains any model with vocab_size >= 256."""
    from meshrun.data.tokenize import read_tokenizer

    name, sha256 = data_tokenizer
    if name == "byte":
        return
    # read as `prepare-data --tokenizer FOLDER` reads it, so the same tokenizer hashes the same
    ours, _ = read_tokenizer(model_tokenizer.parent, flag="model.hf's tokenizer in")
    if hashlib.sha256(ours.to_str().encode()).hexdigest() != sha256:
        raise ConfigError(
            f"the data was tokenized with {name}, not with the model's {model_tokenizer}; "
            f"prepare it again with `meshrun prepare-data --tokenizer {model_tokenizer.parent} ...`"
        )
