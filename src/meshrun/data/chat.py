"""Conversations and prompt/completion records -> token ids and a loss mask (what is trained).

A conversation is rendered to text by the model's own chat template, through transformers'
sandboxed jinja renderer (`render_jinja_template`: an ImmutableSandboxedEnvironment; no code of
the folder's runs, trust_remote_code=False), and tokenized as `apply_chat_template` tokenizes it
(the tokenizer on the whole text, add_special_tokens=False). The trained characters are the
assistant turns: the `{% generation %}` blocks where the template marks them, else found by
rendered prefixes (the conversation up to an assistant turn with the generation prompt, then
through that turn: the characters between are the turn, its end-of-turn token included). A
token is trained when it overlaps a trained character span (transformers' rule for
`return_assistant_tokens_mask`). A prompt/completion record is plain text: prompt, completion,
EOS, the completion and EOS trained; no template.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.data.tokenize import TokenizerSpec, load_tokenizer, refuse_custom_tokenizer
from meshrun.errors import ConfigError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TEMPLATE_BYTES = 1 << 20  # the largest released templates are ~20 KB
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
Spans = list[tuple[int, int]]  # [start, end) character ranges of the rendered text that are trained


@dataclass(frozen=True)
class Rendered:
    """One record as text, its trained character spans, and where it came from (FILE:LINE)."""

    where: str
    text: str
    spans: Spans


@dataclass
class ChatTokenizer:
    """The tokenizer (transformers' fast tokenizer, as apply_chat_template uses it), what the
    dataset stores of it, and the chat template with the special tokens it reads."""

    tokenizer: Any
    spec: TokenizerSpec
    template: str | None
    template_source: str | None

    @property
    def marks_generation(self) -> bool:
        return self.template is not None and GENERATION_MARK.search(self.template) is not None


def load_chat_tokenizer(path: str, *, template_file: str | None, need_template: bool) -> ChatTokenizer:
    """The tokenizer of a model folder (or a tokenizer.json file) and, when `need_template`, its chat
    template: `template_file`, else the folder's own (tokenizer_config.json's `chat_template` or
    chat_template.jinja, as transformers reads them). No template: refused in one line."""
    folder = Path(path)
    spec = load_tokenizer(folder)  # refuses a missing file, an auto_map, a tokenizer without EOS
    tokenizer = _fast_tokenizer(folder)
    template, source = None, None
    if template_file is not None:
        template, source = _read_template(Path(template_file)), template_file
    elif need_template:
        try:
            template, source = tokenizer.get_chat_template(), str(folder)
        except ValueError:  # none set, or several with no default
            template = None
        if not isinstance(template, str):
            raise ConfigError(
                f"--tokenizer {folder} has no chat template (no chat_template in tokenizer_config.json, no "
                "chat_template.jinja); pass --chat-template FILE"
            )
    if template is not None:
        _check_parses(template, source or "")
    return ChatTokenizer(tokenizer, spec, template, source)


def _fast_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if path.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        refuse_custom_tokenizer(path, "--tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' parse errors
        raise ConfigError(f"--tokenizer {path} cannot be loaded: {' '.join(str(exc).split())}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"--tokenizer {path}: only fast (tokenizers-backed) tokenizers are supported")
    return tokenizer


def _read_template(path: Path) -> str:
    if not path.is_file():
        raise ConfigError(f"--chat-template {path} is not a file; give a jinja chat template")
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise ConfigError(f"--chat-template {path} is over {MAX_TEMPLATE_BYTES >> 20} MiB: not a chat template")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--chat-template {path} is not UTF-8 text; give a jinja chat template") from None


def _check_parses(template: str, source: str) -> None:
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template of {source} does not parse (line {exc.lineno}: {exc.message})") from None


# -- records -> text and trained spans -----------------------------------------------------------


def conversation(record: dict[str, Any], where: str, field: str) -> list[dict[str, Any]]:
    """The record's messages, checked: a list of {role, content} with a known role and text
    content (keys holding None dropped, as transformers does). An unknown role is refused: it
    is mostly another schema (ShareGPT's from/value, human/gpt), which skipping would hide."""
    messages = record.get(field)
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: {field!r} is not a list of messages; pass --messages-field NAME")
    checked = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ConfigError(f"{where}: message {k} is not a {{role, content}} object with text content; fix it")
        if message.get("role") not in ROLES:
            raise ConfigError(
                f"{where}: message {k} has role {message.get('role')!r}, not one of {', '.join(ROLES)}; "
                "map the roles first (ShareGPT human/gpt: user/assistant)"
            )
        checked.append({key: value for key, value in message.items() if value is not None})
    return checked


def render_conversation(chat: ChatTokenizer, messages: list[dict[str, Any]], where: str) -> Rendered:
    """The conversation as the template renders it, and its assistant turns' character spans."""
    assert chat.template is not None
    if chat.marks_generation:
        text, spans = _render(chat, messages, where, marks=True)
        return Rendered(where, text, spans)
    text, _ = _render(chat, messages, where)
    spans: Spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _ = _render(chat, messages[:k], where, generation_prompt=True)
        through, _ = _render(chat, messages[: k + 1], where)
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError(
                f"{where}: the chat template of {chat.template_source} renders message {k} differently once later "
                "turns follow, so its assistant tokens cannot be found; pass --chat-template FILE with "
                "{% generation %} marks"
            )
        spans.append((len(before), len(through)))
    return Rendered(where, text, spans)


def _render(
    chat: ChatTokenizer, messages: list[dict[str, Any]], where: str, *, marks: bool = False, generation_prompt=False
) -> tuple[str, Spans]:
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, indices = render_jinja_template(
            conversations=[messages],
            chat_template=chat.template,
            return_assistant_tokens_mask=marks,
            add_generation_prompt=generation_prompt,
            **chat.tokenizer.special_tokens_map,
        )
    except Exception as exc:  # noqa: BLE001 - whatever the template raises (raise_exception, a type error)
        raise ConfigError(
            f"{where}: the chat template of {chat.template_source} fails on this conversation: "
            f"{' '.join(str(exc).split()) or type(exc).__name__}"
        ) from None
    return texts[0], [(int(start), int(end)) for start, end in indices[0]] if marks else []


def prompt_completion(record: dict[str, Any], where: str, fields: tuple[str, str]) -> Rendered:
    prompt, completion = (record.get(name) for name in fields)
    for name, value in zip(fields, (prompt, completion)):
        if not isinstance(value, str):
            raise ConfigError(
                f"{where}: {name!r} is not text; pass --prompt-field / --completion-field (conversations: --chat)"
            )
    assert isinstance(prompt, str) and isinstance(completion, str)
    return Rendered(where, prompt + completion, [(len(prompt), len(prompt) + len(completion))])


# -- text -> token ids and loss mask -------------------------------------------------------------


def tokenize_rendered(
    chat: ChatTokenizer, batch: list[Rendered], *, train_on: str, plain: bool
) -> Iterator[tuple[Rendered, np.ndarray, np.ndarray]]:
    """(record, ids, mask) of each rendered record, tokenized in one call per batch. `plain`
    (prompt/completion text): the tokenizer's own special tokens around the text, and EOS after
    it (trained) unless it ends with EOS already; chat text carries its special tokens itself."""
    out = chat.tokenizer(
        [r.text for r in batch], add_special_tokens=plain, return_offsets_mapping=True, return_attention_mask=False
    )
    eos = np.array(chat.spec.eos_ids, dtype=np.int64)
    for rendered, ids, offsets in zip(batch, out["input_ids"], out["offset_mapping"]):
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.ones(len(ids), np.uint8) if train_on == "all" else trained_tokens(offsets, rendered.spans)
        if plain and not (len(ids) >= len(eos) and (ids[len(ids) - len(eos) :] == eos).all()):
            ids, mask = np.concatenate([ids, eos]), np.concatenate([mask, np.ones(len(eos), np.uint8)])
        yield rendered, ids, mask


def trained_tokens(offsets: Iterable[tuple[int, int]], spans: Spans) -> np.ndarray:
    """1 for each token whose characters overlap a trained span, else 0."""
    bounds = np.asarray(list(offsets), dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(bounds), dtype=bool)
    for start, end in spans:
        mask |= (bounds[:, 1] > start) & (bounds[:, 0] < end)
    return mask.astype(np.uint8)
