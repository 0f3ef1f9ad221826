"""Use a trained model without the mesh: consolidate a sharded checkpoint, and sample text.

Both work on one process from a checkpoint written by any dp x pp layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from meshrun.checkpoint import CONFIG, checkpoint_dir, full_model_state
from meshrun.config import Config
from meshrun.errors import ConfigError
from meshrun.models import build_model
from meshrun.models.hf_config import vocab_size
from meshrun.models.hf_export import load_tokenizer


def load_full_model(run_or_checkpoint: str | Path) -> tuple[nn.Module, Config, Path]:
    """The whole model on the CPU with the checkpoint's weights, its config and the folder used."""
    folder = checkpoint_dir(run_or_checkpoint)
    cfg = Config.model_validate(json.loads((folder / CONFIG).read_text()))
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device="cpu")
    model.load_state_dict(full_model_state(model, folder))
    return model.eval(), cfg, folder


def export(run_or_checkpoint: str | Path, out: str | Path) -> Path:
    """Write one file: `.safetensors` (config in its metadata) or `.pt` (a plain dict, weights_only-loadable)."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} already exists; choose another --out")
    model, cfg, folder = load_full_model(run_or_checkpoint)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    config = json.dumps(cfg.model_dump(mode="json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out), metadata={"meshrun_config": config, "checkpoint": folder.name})
    elif out.suffix in (".pt", ".pth"):
        torch.save({"model": state, "meshrun_config": config}, out)
    else:
        raise ConfigError(f"--out {out}: use a .safetensors or .pt file name")
    return out


@torch.no_grad()
def sample(model: nn.Module, cfg: Config, prompt: str, *, num_tokens: int, temperature: float, top_k: int | None,
           seed: int) -> str:
    """Generation with the model's tokenizer when it has one, else byte-level (UTF-8 bytes in and out)."""
    tokenizer = load_tokenizer(cfg.model)
    vocab = vocab_size(cfg.model)
    if tokenizer is None and vocab < 256:
        raise ConfigError(f"sample works on byte-level models (vocab_size >= 256) or models with a tokenizer; this one has {vocab}")
    generator = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(prompt, add_special_tokens=False) if tokenizer else list(prompt.encode("utf-8"))
    tokens = torch.tensor([ids or [10]], dtype=torch.long)  # (1, T)
    for _ in range(num_tokens):
        logits = model(tokens[:, -cfg.model.seq_len :])[:, -1, :].float()  # (1, V)
        logits = logits if tokenizer else logits[:, :256]  # byte-level: only byte ids decode
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
    if tokenizer:
        return tokenizer.decode(tokens[0].tolist())
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
