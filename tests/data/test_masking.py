"""Masked-LM masking (data/masking.py): a pure function of (seed, global sample index), so any
batch or rank grouping masks the same tokens; the rate and BERT's 80/10/10 split hold; special ids
are never masked nor drawn; a protein alphabet works as well as a BPE vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshrun.data.masking import MaskingRule, mask_tokens, masking_vocabulary, rule_of
from meshrun.data.storage import IGNORE

AMINO = "ACDEFGHIKLMNPQRSTVWY"  # the 20 standard amino acids: a character-level vocabulary
PAD, CLS, EOS, MASK = 20, 21, 22, 23
PROTEIN = MaskingRule(vocab_size=24, mask_id=MASK, special_ids=(PAD, CLS, EOS), rate=0.15)
BPE = MaskingRule(vocab_size=50_265, mask_id=50_264, special_ids=(0, 1, 2, 3), rate=0.15)  # RoBERTa's ids


def proteins(count: int, length: int, *, seed: int = 0) -> np.ndarray:
    """[CLS] residues [EOS] padded: specials at both ends and a padded tail in every row."""
    rng = np.random.default_rng(seed)
    rows = np.full((count, length), PAD, dtype=np.int64)
    for row in rows:
        n = int(rng.integers(length // 2, length - 1))
        row[0], row[1 : n + 1], row[n + 1] = CLS, rng.integers(0, len(AMINO), n), EOS
    return rows


@pytest.mark.parametrize("rule", [PROTEIN, BPE], ids=["protein-letters", "bpe"])
def test_a_sample_is_masked_the_same_however_samples_are_grouped(rule: MaskingRule) -> None:
    """dp1 (one batch of 8), dp2 (ranks 0 and 1, 4 each), dp2 x accumulation 2 (pairs, in another order)."""
    tokens = proteins(8, 32) if rule is PROTEIN else np.random.default_rng(1).integers(4, 50_000, (8, 32))
    whole = mask_tokens(tokens, np.arange(100, 108), seed=7, rule=rule)
    for groups in ([range(0, 4), range(4, 8)], [[6, 7], [0, 1], [4, 5], [2, 3]], [[k] for k in range(8)]):
        for rows in groups:
            rows = list(rows)
            inputs, targets = mask_tokens(tokens[rows], [100 + k for k in rows], seed=7, rule=rule)
            assert np.array_equal(inputs, whole[0][rows]) and np.array_equal(targets, whole[1][rows])
    other_seed = mask_tokens(tokens, np.arange(100, 108), seed=8, rule=rule)
    other_index = mask_tokens(tokens, np.arange(200, 208), seed=7, rule=rule)
    assert not np.array_equal(other_seed[1], whole[1]) and not np.array_equal(other_index[1], whole[1])


@pytest.mark.parametrize("rate", [0.15, 0.4])
def test_the_rate_and_the_80_10_10_rule_hold(rate: float) -> None:
    rule = MaskingRule(vocab_size=24, mask_id=MASK, special_ids=(PAD, CLS, EOS), rate=rate)
    tokens = np.random.default_rng(2).integers(0, len(AMINO), (400, 128))
    inputs, targets = mask_tokens(tokens, np.arange(400), seed=3, rule=rule)
    chosen = targets != IGNORE
    assert abs(chosen.mean() - rate) < 0.01  # 51,200 positions: the binomial's sd is ~0.002
    assert np.array_equal(targets[chosen], tokens[chosen])
    masked = inputs[chosen] == MASK
    changed = (inputs[chosen] != MASK) & (inputs[chosen] != tokens[chosen])
    kept = inputs[chosen] == tokens[chosen]
    assert abs(masked.mean() - 0.8) < 0.02
    # a random draw equal to the original token (1 in 20) counts as kept
    assert abs(changed.mean() - 0.1 * 19 / 20) < 0.015 and abs(kept.mean() - (0.1 + 0.1 / 20)) < 0.015
    assert np.array_equal(inputs[~chosen], tokens[~chosen])  # nothing else changes


def test_special_tokens_are_never_masked_nor_drawn() -> None:
    tokens = proteins(300, 40, seed=4)
    inputs, targets = mask_tokens(tokens, np.arange(300), seed=5, rule=MaskingRule(24, MASK, (PAD, CLS, EOS), 0.9))
    special = np.isin(tokens, [PAD, CLS, EOS])
    assert (targets[special] == IGNORE).all() and np.array_equal(inputs[special], tokens[special])
    swapped = (targets != IGNORE) & (inputs != MASK)
    assert not np.isin(inputs[swapped], [PAD, CLS, EOS, MASK]).any()  # random tokens are ordinary ids


def test_every_sample_with_ordinary_tokens_gets_a_target() -> None:
    """At a low rate a short sample would often have none: a batch with no target has no loss."""
    tokens = np.array([[CLS, 3, 4, EOS, PAD, PAD]] * 50 + [[CLS, EOS, PAD, PAD, PAD, PAD]])
    _, targets = mask_tokens(tokens, np.arange(51), seed=0, rule=MaskingRule(24, MASK, (PAD, CLS, EOS), 0.01))
    assert ((targets[:50] != IGNORE).sum(axis=1) >= 1).all()
    assert (targets[50] == IGNORE).all()  # specials only: nothing to choose


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 24, "mask_id": 24, "special_ids": ()}, "not an id of the 24-token vocabulary"),
        ({"vocab_size": 2, "mask_id": 1, "special_ids": (0,)}, "every id of the vocabulary is special"),
        ({"vocab_size": 24, "mask_id": 23, "special_ids": (), "rate": 1.0}, r"mask rate 1.0 is not in \(0, 1\)"),
    ],
)
def test_a_rule_that_cannot_mask_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MaskingRule(**kwargs)


def test_a_tokenizers_own_mask_and_special_tokens_are_used_and_bytes_get_one_appended() -> None:
    """RoBERTa-like: <s> <pad> </s> <unk> special, <mask> the last id; bytes: the mask is id 256."""
    added = [{"id": i, "content": c, "special": True} for i, c in enumerate(["<s>", "<pad>", "</s>", "<unk>"])]
    tokenizer = json.dumps({"added_tokens": [*added, {"id": 50_264, "content": "<mask>", "special": True}]})
    vocabulary = masking_vocabulary(50_265, (2,), tokenizer)
    assert vocabulary == {"mask_id": 50_264, "special_ids": [0, 1, 2, 3, 50_264], "vocab_size": 50_265}
    assert rule_of(vocabulary, 0.15) == MaskingRule(50_265, 50_264, (0, 1, 2, 3, 50_264), 0.15)
    assert masking_vocabulary(256, tuple(b"\n\n"), None) == {"mask_id": 256, "special_ids": [256], "vocab_size": 257}
