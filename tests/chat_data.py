"""Conversations and a chat model's tokenizer folder, built here (no download): a byte-level BPE
with ChatML's special tokens and a template with {% generation %} marks. Shared by the tests of
`prepare-data --chat` and of training on conversations."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
UNMARKED = CHATML.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def conversations(count: int = 12) -> list[list[dict[str, str]]]:
    """Several turns each, a system prompt on most, answers of varied length."""
    convs = []
    for i in range(count):
        conv = [{"role": "system", "content": f"You are helper number {i}."}] if i % 3 else []
        for turn in range(1 + i % 3):
            conv.append({"role": "user", "content": f"What is {i} plus {turn}? Answer briefly."})
            conv.append({"role": "assistant", "content": f"It is {i + turn}." + " Indeed." * (i % 4)})
        convs.append(conv)
    return convs


def write_chat_tokenizer(folder: Path) -> Path:
    """Into `folder` (made if missing): tokenizer.json and a tokenizer_config.json holding CHATML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = [m["content"] for conv in conversations(40) for m in conv]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
