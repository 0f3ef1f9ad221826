"""Token healing in `meshrun sample`: a prompt that ends inside what training text always
tokenizes as one piece ("def " + name) must not start generation from an unseen fragment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny
from plain_reference import config_from_set_args
from tokenizers import Tokenizer

from meshrun.data.tokenize import train_bpe
from meshrun.generation.sample import codec, heal_prompt

TEXTS = [f"def area_{i}(self, width):\n    return self.height * width + {i}\n" for i in range(300)]


def test_a_trailing_space_is_healed_into_the_next_token() -> None:
    tokenizer = Tokenizer.from_str(train_bpe(TEXTS, "bpe:400").json_text)
    encode, decode = (lambda text: tokenizer.encode(text).ids), tokenizer.decode
    ids = encode("def ")
    assert decode(ids[-1:]) == " "  # the fragment: in training text the space starts " area_0" etc.
    healed, allowed = heal_prompt(ids, decode, tokenizer.get_vocab_size())
    assert healed == ids[:-1] and allowed is not None
    choices = torch.nonzero(allowed).flatten().tolist()
    assert encode(" area")[0] in choices and encode("def")[0] not in choices
    assert all(decode([*healed, i]).startswith("def ") for i in choices)  # the prompt's text is kept


def test_nothing_to_heal_in_a_one_token_prompt() -> None:
    assert heal_prompt([7], lambda ids: "x", 10) == ([7], None)


def test_byte_level_data_needs_no_tokenizer_and_gets_no_warning(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model past 256 ids (pairs data: bytes + 3 specials) on byte-level data decodes bytes with no
    "no tokenizer found" warning; data that records no tokenizer (nanoGPT files) still gets it."""
    cfg = config_from_set_args(tiny(data_dir, tmp_path / "run", **{"model.vocab_size": 259}))
    *_, num_ids = codec(cfg, data_dir)
    assert num_ids == 256 and capsys.readouterr().err == ""
    codec(cfg, tmp_path)  # no meta.json: nothing says what the ids are
    assert "warning: no tokenizer found" in capsys.readouterr().err
