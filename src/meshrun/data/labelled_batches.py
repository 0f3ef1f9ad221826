"""Batches of a classification folder (data/labelled.py writes it): x = each sample's first
model.seq_len token ids, padded with PAD (-1, no id of any vocabulary: the encoder masks it), y =
its label id. A training sample `i` is row hash(seed, i) mod rows, as pairs are drawn; a
validation sample `i` is row i mod rows, so eval_batches x global_batch samples read the
validation rows in order, each once when the two match.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshrun.data.hashing import drawn_rows, split_salt
from meshrun.data.labelled import LABEL_DTYPE
from meshrun.data.pairs import Rows
from meshrun.data.storage import SPLITS, read_meta
from meshrun.errors import ConfigError
from meshrun.files.confined import confined

PAD = -1  # the encoder's padding id (models/encoder.py)


class LabelledDataset:
    """Padded (x, y) batches of one split of a classification folder; a batch's targets are its samples."""

    def __init__(self, data_dir: str | Path, split: str, *, seq_len: int, seed: int) -> None:
        folder = Path(data_dir)
        meta = read_meta(folder) or {}
        again = f"prepare it again with `meshrun prepare-data --task classification --out {folder}`"
        if meta.get("format") != "classification":
            raise ConfigError(
                f"{folder} holds {meta.get('format', 'no prepared')} data, not classification data; "
                f"prepare it with `meshrun prepare-data --task classification --out DIR` and set data.dir: DIR"
            )
        try:
            dtype, self.vocab_size = np.dtype(meta["dtype"]), int(meta["vocab_size"])
            self.labels, max_id = [str(n) for n in meta["labels"]], int(meta["splits"][split]["max_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{folder / 'meta.json'} is incomplete ({type(exc).__name__}: {exc}); {again}") from None
        self.text = Rows(folder, split, "text", dtype, max_id, again=again)
        path = confined(folder, f"{split}.labels.bin", source=folder / "meta.json")
        try:
            self.label_ids = np.fromfile(path, dtype=LABEL_DTYPE).astype(np.int64)
        except OSError as exc:
            raise ConfigError(f"{path} cannot be read ({exc}); {again}") from None
        if len(self.label_ids) != len(self.text.lengths) or not len(self.label_ids):
            raise ConfigError(f"{path} holds {len(self.label_ids)} labels for {len(self.text.lengths)} texts; {again}")
        if self.label_ids.max() >= len(self.labels):
            raise ConfigError(
                f"{path} holds label id {self.label_ids.max()}, beyond the {len(self.labels)} labels of meta.json; {again}"
            )
        self.files, self.tokenizer, self.where = [self.text.file], meta.get("tokenizer"), f"{folder} ({split})"
        self.seq_len, self.in_order = seq_len, split == "val"
        self.salt = split_salt(seed, SPLITS.index(split))

    def rows(self, first: int, count: int) -> np.ndarray:
        """Row numbers of samples first .. first+count-1."""
        return drawn_rows(first, count, len(self.label_ids), salt=self.salt, in_order=self.in_order)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first+count-1 as x (count, seq_len) token ids, PAD after each text, and y (count,) labels."""
        which = self.rows(first, count)
        x = np.full((count, self.seq_len), PAD, dtype=np.int64)
        for row, k in enumerate(which):
            text = self.text.row(k)[: self.seq_len]
            x[row, : len(text)] = text
        return torch.from_numpy(x), torch.from_numpy(self.label_ids[which])

    def target_tokens(self, first: int, count: int) -> int:
        """The loss's divisor: one target per sample."""
        return count

    def source_counts(self, first: int, count: int) -> dict[str, int]:
        return {}
