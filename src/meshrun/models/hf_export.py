"""`meshrun export RUN --hf OUT_DIR`: a folder `transformers.AutoModelForCausalLM.from_pretrained` loads.

config.json from the model's own Hugging Face config, model.safetensors with Hugging Face
tensor names (a tied matrix once: transformers ties lm_head on load), and the tokenizer files
of `model.hf` when it had any, else the training data's tokenizer (a BPE meshrun trained, say),
so that `AutoTokenizer.from_pretrained` reads the ids the model learned.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch import nn

from meshrun.config.model_sections import ModelConfig
from meshrun.data.storage import read_meta
from meshrun.data.tokenize import refuse_custom_tokenizer
from meshrun.errors import ConfigError
from meshrun.files.atomic import publish_folder, temporary_name
from meshrun.files.confined import confined
from meshrun.models.hf import HFCausalLM
from meshrun.models.hf_config import TOKENIZER_FILES, hf_dir, is_hf, model_tokenizer

CHAT_TEMPLATE = "chat_template.jinja"  # transformers prefers it to tokenizer_config.json's chat_template


def tokenizer_files(model_dir: Path | None) -> list[Path]:
    return [model_dir / name for name in TOKENIZER_FILES if model_dir and (model_dir / name).is_file()]


def export_hf(model: nn.Module, cfg: ModelConfig, out: Path, *, data: Path | None = None, merge: bool = False) -> Path:
    """Write `model` (whole, with trained weights, built from `cfg`) as a Hugging Face model folder.
    `data`: where the training data's meta.json / tokenizer.json are (export.data_card); its chat
    template, when it was fine-tuned on conversations, goes with the tokenizer. `merge`: a LoRA
    run's adapters merged into the weights they adapt (the model is changed in place)."""
    from safetensors.torch import save_file

    if not is_hf(cfg):
        raise ConfigError("--hf exports Hugging Face models (model.hf / model.hf_config); use --out FILE for this one")
    if cfg.lora is not None and not merge:  # the base's weights alone would drop what was trained
        raise ConfigError(
            "--hf of a model.lora run writes full weights with the adapters merged in: add --merge, "
            "or export them with --adapter OUT_DIR"
        )
    if cfg.lora is None and merge:
        raise ConfigError("--merge merges a model.lora run's adapters; this run trained every weight: drop --merge")
    if out.exists():
        raise ConfigError(f"{out} already exists; choose another --hf folder")
    if merge:
        merge_adapters(model)
    model = cast(HFCausalLM, model)  # what the hf family builds (models/families.py)
    state = {  # a fused projection's parts joined back into transformers' one tensor (others not copied)
        model.hf_names(name)[0]: torch.cat(parts).detach() if len(parts) > 1 else parts[0].detach().contiguous()
        for name, parts in model.hf_tensors().items()
    }
    config = copy.deepcopy(model.hf_config)  # the model's is shared (load_hf_config caches it): not changed
    config.architectures = [model.hf_class_name]
    dtypes = {tensor.dtype for tensor in state.values()}  # a LoRA base held as its folder stores it: merged so
    config.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    labels = (read_meta(data) or {}).get("labels") if data is not None and cfg.num_labels is not None else None
    if isinstance(labels, list) and len(labels) == config.num_labels:  # a classifier's: the data's label names
        config.id2label = {k: str(label) for k, label in enumerate(labels)}
        config.label2id = {str(label): k for k, label in enumerate(labels)}
    model_dir = hf_dir(model.cfg)

    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for file in tokenizer_files(model_dir):
            shutil.copy2(file, tmp / file.name)
        if model_tokenizer(model_dir) is None and data is not None:
            save_data_tokenizer(data, tmp, max_length=model.cfg.seq_len)
        if data is not None and (data / CHAT_TEMPLATE).is_file():  # the template fine-tuning rendered with
            shutil.copyfile(confined(data, CHAT_TEMPLATE, source=data), tmp / CHAT_TEMPLATE)

    return write_new_folder(out, write)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Each LoRA-adapted layer replaced in place by its base layer with the adapter merged in, by
    peft's own `merge` (W += B @ A x alpha / r: what `merge_and_unload` computes)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge(safe_merge=True)  # safe: refuses a non-finite result
            owner, _, child = name.rpartition(".")
            setattr(model.get_submodule(owner), child, module.get_base_layer())


def write_new_folder(out: Path, write: Callable[[Path], None]) -> Path:
    """`write` fills a folder of this process's own, published as `out` all or nothing, never over
    a folder that appeared meanwhile; on failure only what this call created is removed."""
    tmp = temporary_name(out)  # this process's own: a folder named OUT.tmp may be the user's
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        write(tmp)
        return publish_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_hf_tokenizer(cfg: ModelConfig):
    """The model's own tokenizer when `model.hf` has one (None: sample byte-level)."""
    model_dir = hf_dir(cfg)
    if model_dir is None or model_tokenizer(model_dir) is None:
        return None
    refuse_custom_tokenizer(model_dir, "model.hf")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)


def save_data_tokenizer(data: Path, out: Path, *, max_length: int) -> None:
    """The training data's tokenizer.json, byte for byte (so the data's tokenizer check accepts
    the exported folder), and a tokenizer_config.json for transformers' fast tokenizer: the
    end-of-document token meta.json records as eos_token, and special-token text encoded as text,
    as training encoded it. Nothing for byte-level data (ids are UTF-8 bytes) or pairs (ids are
    the tokenizer's shifted past pad/BOS/EOS)."""
    from tokenizers import Tokenizer

    from meshrun.data.storage import read_meta

    meta = read_meta(data) or {}
    if not (data / "tokenizer.json").is_file() or meta.get("format") == "pairs":
        return
    shutil.copyfile(confined(data, "tokenizer.json", source=data), out / "tokenizer.json")
    eos_ids = (meta.get("tokenizer") or {}).get("eos_ids") or []
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "split_special_tokens": True,
    }
    if eos_ids:
        config["eos_token"] = Tokenizer.from_file(str(data / "tokenizer.json")).id_to_token(eos_ids[0])
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
