"""Tiny Hugging Face models made with transformers itself, saved with save_pretrained, and the
independent reference: the plain transformers model's loss and gradient norm on a batch."""

from __future__ import annotations

from pathlib import Path

import torch

SEQ_LEN = 16
# 8 layers so dp1 x pp4 with 2 virtual stages (8 stages) fits; hidden 32: each run takes seconds.
CONFIGS = {
    "llama": {  # GQA (4 query heads, 2 kv heads), untied head, sharded safetensors
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "bert": {  # an encoder (task classification only); no dropout so layouts can agree
        "model_type": "bert",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
    "gpt2": {  # learned positions, tied embeddings, no dropout so layouts can agree
        "model_type": "gpt2",
        "n_embd": 32,
        "n_layer": 8,
        "n_head": 2,
        "vocab_size": 256,
        "n_positions": 64,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
}


def make_model(
    family: str, out: Path, *, seed: int = 0, shard: bool = False, auto: str = "AutoModelForCausalLM", **changes: object
) -> Path:
    """Build with transformers (its own random init, seeded) and save_pretrained to `out`
    (`changes`: config fields other than the family's defaults; `auto`: transformers' class, e.g.
    AutoModelForSequenceClassification)."""
    import transformers
    from transformers import AutoConfig

    fields = {**CONFIGS[family], **changes}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, auto).from_config(config, attn_implementation="sdpa")
    model.save_pretrained(out, max_shard_size="40KB" if shard else "5GB")
    return out


def load_reference(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=dtype)


def backward_microbatches(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_microbatches: int, *, autocast: bool = False
) -> float:
    """transformers' own loss on each microbatch's whole window, one backward each; the batch's loss
    (`autocast`: each forward under CPU bf16 autocast, as meshrun's precision bf16 runs it)."""
    total = 0.0
    for xm, ym in zip(x.chunk(num_microbatches), y.chunk(num_microbatches)):
        window = torch.cat([xm, ym[:, -1:]], dim=1)  # (B, T + 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=window, labels=window).loss / num_microbatches
        loss.backward()
        total += loss.item()
    return total


def reference_loss_and_grad_norm(
    model_dir: Path, x: torch.Tensor, y: torch.Tensor, *, num_microbatches: int
) -> tuple[float, float]:
    """Plain transformers, no meshrun code: `model(input_ids=window, labels=window)` on the whole
    window (x plus its last target; HF shifts the labels itself, and causality keeps the extra
    position out of the other logits), one backward per microbatch."""
    model = load_reference(model_dir).train()
    total = backward_microbatches(model, x, y, num_microbatches)
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # a tied matrix is one parameter
    return total, torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def bpe_json(texts: list[str], vocab: int) -> str:
    """A byte-level BPE made with `tokenizers` directly, as tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer.to_str()
