"""Token healing in `meshrun sample`: a prompt that ends inside what training text always
tokenizes as one piece ("def " + name) must not start generation from an unseen fragment."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from meshrun.data.tokenize import train_bpe
from meshrun.generation.sample import heal_prompt

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
