"""Sampling text from a trained model, with the tokenizer it was trained with."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch import nn

from meshrun.checkpoint.dcp import DATA_CARD
from meshrun.config.schema import Config
from meshrun.data.locations import reads_in_place, training_data_dir
from meshrun.data.pairs import BOS, EOS, NUM_SPECIAL, PAD
from meshrun.data.storage import DOCUMENTS_FORMAT, read_meta
from meshrun.data.tokenize import byte_tokenizer, id_count, read_tokenizer, text_codec
from meshrun.errors import ConfigError
from meshrun.files.console import say
from meshrun.generation.seq2seq import decode as seq2seq_decode
from meshrun.models.encdec import EncDec, source_len
from meshrun.models.hf_config import vocab_size
from meshrun.models.hf_export import load_hf_tokenizer


@torch.no_grad()
def sample(
    model: nn.Module,
    cfg: Config,
    prompt: str,
    *,
    num_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    beam: int = 1,
    data: Path | None = None,
    tokenizer: str | None = None,
) -> str:
    """Generation with the tokenizer the model was trained with (see `codec`); an encoder-decoder
    translates the prompt (greedy, or beam search with `beam` > 1) instead of continuing it, and
    a decoder-only model trained on pairs answers it as it was trained (source BOS -> target EOS).
    `data`: where the training data's meta.json / tokenizer.json are (see `data_card`);
    `tokenizer`: a tokenizer.json or model folder that overrides them."""
    data = training_data_dir(cfg) if data is None else data
    encode, decode, num_ids = codec(cfg, data, tokenizer)
    if source_len(cfg.model) is not None:  # the encdec family translates (the model it builds: EncDec)
        target = seq2seq_decode(
            cast(EncDec, model), [i + NUM_SPECIAL for i in encode(prompt)], beam=beam, max_tokens=num_tokens
        )
        return decode([i - NUM_SPECIAL for i in target if i >= NUM_SPECIAL])
    if beam > 1:
        raise ConfigError(
            "--beam is for encoder-decoder models (model.name: encdec); sample this one with --temperature"
        )
    pairs = pairs_vocab(data)
    if pairs:  # ids as training saw them: shifted past pad/BOS/EOS, the answer starts after BOS
        ids, first_allowed = [i + NUM_SPECIAL for i in encode(prompt)] + [BOS], None
    else:
        ids, first_allowed = heal_prompt(encode(prompt) or encode("\n"), decode, num_ids or vocab_size(cfg.model))

    def allowed(logits: torch.Tensor, step: int) -> torch.Tensor:
        if pairs:
            logits = logits[:, :pairs]
            logits[:, [PAD, BOS]] = float("-inf")
        elif num_ids is not None:
            logits = logits[:, :num_ids]
        if step == 0 and first_allowed is not None:
            logits = logits.masked_fill(~first_allowed[: logits.shape[-1]], float("-inf"))
        return logits

    new = generate(
        model, ids, cfg.model.seq_len, num_tokens=num_tokens, temperature=temperature, top_k=top_k, seed=seed,
        allowed=allowed, stop={EOS} if pairs else set(),
    )  # fmt: skip
    if pairs:
        return decode([i - NUM_SPECIAL for i in new])
    return decode(ids + new)


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: list[int],
    seq_len: int,
    *,
    num_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    allowed: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    stop: set[int] | frozenset[int] = frozenset(),
) -> list[int]:
    """Up to `num_tokens` ids continuing `ids`, the model reading the last `seq_len` of them;
    `allowed(logits (1, V), step)` narrows each step's choice; an id in `stop` ends it (not returned)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([ids], dtype=torch.long)  # (1, T)
    for step in range(num_tokens):
        logits = model(tokens[:, -seq_len:])[:, -1, :].float()  # (1, V)
        if allowed is not None:
            logits = allowed(logits, step)
        nxt = next_token(logits, temperature, top_k, generator)
        if nxt.item() in stop:
            break
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[0, len(ids) :].tolist()


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> torch.Tensor:
    """Greedy at temperature <= 0, else a draw from the tempered (top-k) distribution: (1, 1)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def named_codec(
    path: str, vocab: int, *, trained: dict | None
) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str], int]:
    """`sample --tokenizer PATH`: read as `prepare-data --tokenizer` reads it; sampling draws only
    its ids (a model's vocabulary is often padded past them, as nanoGPT's 50304 for GPT-2).
    `trained`: the tokenizer the training data's meta.json records (name, sha256), if any: another
    one would decode the model's ids as other words."""
    tokenizer, _ = read_tokenizer(path)
    if trained and trained.get("sha256") != hashlib.sha256(tokenizer.to_str().encode()).hexdigest():
        raise ConfigError(
            f"this model was trained on data tokenized with {trained.get('name')}, and --tokenizer {path} is "
            "another tokenizer; drop --tokenizer (the checkpoint's own is used)"
        )
    num_ids = id_count(tokenizer)
    if num_ids > vocab:
        raise ConfigError(
            f"--tokenizer {path} has {num_ids} token ids but the model has {vocab}; "
            "pass the tokenizer the model was trained with"
        )
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), tokenizer.decode, num_ids


def _byte_level(data: Path) -> bool:
    """Whether the training data's meta.json (as `data` describes it) records byte-level tokens
    (pairs data too: its ids are the bytes' plus the 3 specials, a vocabulary past 256)."""
    tokenizer = (read_meta(data) or {}).get("tokenizer")
    return isinstance(tokenizer, dict) and tokenizer.get("name") == byte_tokenizer().name


def data_card(cfg: Config, checkpoint: Path) -> Path:
    """Where the training data's meta.json / tokenizer.json are: the copies saved with the
    checkpoint, else (a checkpoint of an older meshrun) the training data folder itself."""
    saved = checkpoint / DATA_CARD
    return saved if (saved / "meta.json").is_file() else training_data_dir(cfg)


def pairs_vocab(data: Path) -> int | None:
    """The ids of pairs data (the tokenizer's + 3: source BOS target EOS) when the training data
    (as `data` describes it) is pairs, else None."""
    meta = read_meta(data)
    if meta is None or meta.get("format") != "pairs":
        return None
    if not isinstance(vocab := meta.get("vocab_size"), int) or vocab < 1:
        raise ConfigError(f"{data / 'meta.json'} has no usable vocab_size ({vocab!r}); the data card is damaged")
    return vocab


def heal_prompt(
    ids: list[int], decode: Callable[[list[int]], str], num_ids: int
) -> tuple[list[int], torch.Tensor | None]:
    """Token healing: a prompt's last token is often a fragment the model never saw at the end
    of a text (with a BPE, "def " ends in a lone space that training text always glues to the
    next word), so sampling from it starts with noise. Drop that token and let the first sampled
    token be any token that starts with its text. Returns the prompt ids and the mask of allowed
    first tokens (None: nothing to heal)."""
    if len(ids) < 2:
        return ids, None
    tail = decode(ids[-1:])
    allowed = torch.tensor([decode([i]).startswith(tail) for i in range(num_ids)])
    return ids[:-1], allowed


def codec(
    cfg: Config, data: Path, tokenizer_path: str | None = None
) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str], int | None]:
    """(encode, decode, ids that decode) for sampling: the tokenizer the user names, else the
    training data's (its tokenizer.json, or bytes) as `data` describes it, else the model
    folder's, else bytes. Bytes on a larger vocabulary sample only the 256 byte ids, with a warning."""
    vocab = vocab_size(cfg.model)
    if tokenizer_path is not None:
        return named_codec(tokenizer_path, vocab, trained=(read_meta(data) or {}).get("tokenizer"))
    tokenizer = None if (data / "meta.json").is_file() else load_hf_tokenizer(cfg.model)
    if tokenizer is not None:
        return (lambda text: tokenizer.encode(text, add_special_tokens=False)), tokenizer.decode, None
    if (data / "tokenizer.json").is_file():
        return (*text_codec(data, vocab), None)
    if vocab < 256:
        raise ConfigError(
            f"this model has {vocab} token ids and no tokenizer (beside its data or in model.hf); "
            "byte-level sampling needs at least 256"
        )
    if vocab > 256 and not _byte_level(data):  # byte-level data needs no tokenizer: nothing is missing
        say(f"warning: no tokenizer found (none saved with the checkpoint, nor in {data}); decoding the 256 byte ids")
    return (*text_codec(None, 256), None if vocab == 256 else 256)


def sample_prompt(cfg: Config) -> tuple[str, str]:
    """A `sample` flag and text that fit what the run trained on, for its `next:` line: a source to
    translate for pairs data or an encoder-decoder (a function name, for the built-in example),
    a user message for conversations (`--chat`), code for the embedded standard-library corpus, a
    placeholder for the user's own text."""
    meta = read_meta(training_data_dir(cfg)) or {}
    if source_len(cfg.model) is not None or meta.get("format") == "pairs":
        return "--prompt", "get_terminal_size" if cfg.data.pairs and not cfg.data.sources else "SOURCE TEXT"
    if meta.get("format") == DOCUMENTS_FORMAT and meta.get("kind") == "chat":
        return "--chat", "MESSAGE"
    embedded = not (cfg.data.sources or reads_in_place(cfg) or cfg.data.dir)
    return "--prompt", "def " if embedded else "TEXT TO CONTINUE"
