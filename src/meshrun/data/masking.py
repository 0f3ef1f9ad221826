"""Masked language modelling's inputs and targets (BERT's 80/10/10 rule), a pure function of
(seed, global sample index, tokens): every layout, batch grouping and rank masks sample i's
tokens the same way, and a resumed run masks as the uninterrupted one did.

For sample i and position j a 64-bit hash h(seed, i, j) (SplitMix64, data/hashing.py) decides
everything: its top bits whether the position is chosen (probability `rate`), the next ones which
of mask (80%) / random token (10%) / unchanged (10%), the rest which random token. Special ids
(padding, document ends, the mask itself, a tokenizer's [CLS] ...) are never chosen and never
drawn as the random token. A sample with no chosen position gets its lowest-hash ordinary
position chosen, so every sample (and every batch) has a target.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshrun.data.hashing import splitmix64
from meshrun.data.storage import IGNORE
from meshrun.errors import ConfigError

_SCALE = 2.0**-53  # 53 random bits -> a float in [0, 1)


@dataclass(frozen=True)
class MaskingRule:
    """What masking needs of a vocabulary: its size, the mask token and the ids never masked."""

    vocab_size: int
    mask_id: int
    special_ids: tuple[int, ...]
    rate: float = 0.15

    def __post_init__(self) -> None:
        if not 0.0 < self.rate < 1.0:
            raise ValueError(f"mask rate {self.rate} is not in (0, 1)")
        if not 0 <= self.mask_id < self.vocab_size:
            raise ValueError(f"mask id {self.mask_id} is not an id of the {self.vocab_size}-token vocabulary")
        if self.mask_id not in self.special_ids:
            object.__setattr__(self, "special_ids", (*self.special_ids, self.mask_id))
        if not len(self.ordinary_ids()):
            raise ValueError("every id of the vocabulary is special: nothing to mask")

    def ordinary_ids(self) -> np.ndarray:
        """The ids a random replacement is drawn from: every id but the special ones."""
        return np.setdiff1d(np.arange(self.vocab_size, dtype=np.int64), np.array(self.special_ids, dtype=np.int64))


def mask_tokens(
    tokens: np.ndarray, sample_ids: Sequence[int] | np.ndarray, *, seed: int, rule: MaskingRule
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of samples `sample_ids` (global indices) whose tokens are `tokens` (B, L):
    inputs with the chosen positions replaced as BERT does, targets the original token at chosen
    positions and IGNORE elsewhere. Depends on nothing but the arguments."""
    tokens = np.asarray(tokens, dtype=np.int64)
    batch, length = tokens.shape
    ids = np.asarray(sample_ids, dtype=np.uint64).reshape(batch, 1)
    salt = splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    positions = np.arange(length, dtype=np.uint64).reshape(1, length)
    h = splitmix64(splitmix64(ids ^ salt) ^ positions)  # (B, L): one hash per sample and position
    ordinary = ~np.isin(tokens, np.array(rule.special_ids, dtype=np.int64))
    chosen = ordinary & ((h >> np.uint64(11)).astype(np.float64) * _SCALE < rule.rate)
    _at_least_one(chosen, ordinary, h)
    second = splitmix64(h)  # independent bits for what a chosen position becomes
    kind = (second >> np.uint64(11)).astype(np.float64) * _SCALE
    pool = rule.ordinary_ids()
    random_ids = pool[(splitmix64(second) % np.uint64(len(pool))).astype(np.int64)]
    inputs = tokens.copy()
    inputs[chosen & (kind < 0.8)] = rule.mask_id
    swapped = chosen & (kind >= 0.8) & (kind < 0.9)
    inputs[swapped] = random_ids[swapped]
    targets = np.where(chosen, tokens, IGNORE)
    return inputs, targets


def _at_least_one(chosen: np.ndarray, ordinary: np.ndarray, h: np.ndarray) -> None:
    """A row with ordinary tokens but none chosen gets its lowest-hash ordinary position chosen."""
    empty = ordinary.any(axis=1) & ~chosen.any(axis=1)
    if empty.any():
        lowest = np.where(ordinary, h, np.uint64(0xFFFFFFFFFFFFFFFF)).argmin(axis=1)
        rows = np.flatnonzero(empty)
        chosen[rows, lowest[rows]] = True


MASK_NAMES = ("<mask>", "[MASK]")  # RoBERTa / ESM and BERT spellings


def masking_vocabulary(vocab_size: int, eos_ids: Sequence[int], tokenizer_json: str | None) -> dict[str, Any]:
    """What meta.json records for masked_lm data: the mask id (the tokenizer's <mask> / [MASK], else one id
    appended after its vocabulary: the byte tokenizer's 256), the special ids never masked (the tokenizer's
    special tokens and document ends; bytes have none but the mask: a newline is text) and the vocabulary."""
    added = json.loads(tokenizer_json).get("added_tokens", []) if tokenizer_json else []
    special = {int(t["id"]): str(t["content"]) for t in added if t.get("special")}
    if tokenizer_json is not None:
        special.update({int(i): "" for i in eos_ids})
    mask_id = next((i for i, content in special.items() if content in MASK_NAMES), None)
    if mask_id is None:
        mask_id, vocab_size = vocab_size, vocab_size + 1
        special[mask_id] = "<mask>"
    return {"mask_id": mask_id, "special_ids": sorted(special), "vocab_size": vocab_size}


def rule_of(meta: dict[str, Any], rate: float) -> MaskingRule:
    """The masking rule of a dataset prepared with --task masked_lm, at `task_options.mask_rate`."""
    try:
        return MaskingRule(int(meta["vocab_size"]), int(meta["mask_id"]), tuple(map(int, meta["special_ids"])), rate)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"the dataset's meta.json has no usable masking vocabulary ({exc}); prepare it with --task masked_lm"
        ) from None
