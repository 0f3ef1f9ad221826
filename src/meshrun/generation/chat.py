"""`meshrun sample --chat MESSAGE`: one user turn rendered with the chat template the model was
fine-tuned with (saved with the checkpoint's data card), answered up to the end of the turn.

The prompt is what training saw before an assistant turn: the template's rendering of the
conversation with the generation prompt (transformers' sandboxed renderer, as prepare-data
used), tokenized without added special tokens (the template writes them). Generation stops at
an end-of-turn id: the tokenizer's EOS ids the data recorded, which end every trained turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from meshrun.config.schema import Config
from meshrun.data.storage import DOCUMENTS_FORMAT, read_meta
from meshrun.errors import ConfigError
from meshrun.files.confined import confined
from meshrun.generation.sample import generate


def chat_prompt(data: Path, message: str) -> tuple[Any, list[int], list[int]]:
    """(the tokenizer, the prompt ids, the end-of-turn ids) for a one-message conversation, from
    the data card `data` of a run trained on conversations."""
    from transformers import PreTrainedTokenizerFast

    meta = read_meta(data) or {}
    template = meta.get("chat_template") if meta.get("format") == DOCUMENTS_FORMAT else None
    if not isinstance(template, dict) or not (data / "chat_template.jinja").is_file():
        raise ConfigError(
            "--chat answers with the chat template a model was fine-tuned with, and this checkpoint's training data "
            "holds none (it was not prepared with prepare-data --chat); use --prompt TEXT"
        )
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(confined(data, "tokenizer.json", source=data)))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}],
        chat_template=confined(data, "chat_template.jinja", source=data).read_text(),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert isinstance(text, str)  # tokenize=False: the rendered text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer, ids, [int(i) for i in (meta.get("tokenizer") or {}).get("eos_ids") or []]


def answer(
    model: nn.Module,
    cfg: Config,
    message: str,
    *,
    data: Path,
    num_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
) -> str:
    """The model's answer to `message`, decoded, without its end-of-turn token."""
    tokenizer, ids, stop = chat_prompt(data, message)
    new = generate(
        model, ids, cfg.model.seq_len, num_tokens=num_tokens, temperature=temperature, top_k=top_k, seed=seed,
        allowed=lambda logits, _step: logits[:, : len(tokenizer)], stop=set(stop),
    )  # fmt: skip
    return tokenizer.decode(new)
