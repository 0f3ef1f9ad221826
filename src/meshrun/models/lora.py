"""LoRA adapters on a model (or one pipeline stage of it), made by peft itself.

peft's `inject_adapter_in_model` replaces each targeted `nn.Linear` with its `lora.Linear` (the
original under `base_layer`, the adapter as `lora_A.default` and `lora_B.default`) and freezes every
other parameter, as `get_peft_model` does. It is applied to each stage after the pipeline split, so
a stage adapts only the modules it holds; the blocks keep their global index, so an adapter has the
same name on every layout.

peft draws A from the global random stream in module order (`kaiming_uniform_(a=sqrt(5))`, B zeros),
which differs between stages. meshrun draws A again with the same distribution from a generator
seeded by (train.seed, the adapter's name): every layout starts from the same adapters. They are
not the values peft draws after `torch.manual_seed(seed)`; the tests copy meshrun's adapters into
peft's model to prove the rest equal (tests/models/test_lora.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from meshrun.config.model_sections import LoraSection, ModelConfig
from meshrun.errors import ConfigError
from meshrun.models.init import named_generator

ADAPTER = "default"  # peft's adapter name: its saved files and PeftModel expect it


def is_adapter(name: str) -> bool:
    """A parameter or state-dict name of one of peft's LoRA adapters (not of the base model)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def target_names(model: nn.Module, lora: LoraSection) -> list[str]:
    """The module names peft matches: as given, or `all-linear` as peft expands it for a
    transformers model (the leaf name of every linear layer, the output head left out): here the
    linear layers of the blocks, which hold every linear layer but the head."""
    if lora.target_modules != "all-linear":
        return list(lora.target_modules)
    blocks = getattr(model, "blocks", model)
    return sorted({name.rpartition(".")[2] for name, module in blocks.named_modules() if isinstance(module, nn.Linear)})


def matches(key: str, target: str) -> bool:
    """peft's rule for a list of target names (tuners_utils.check_target_module_exists)."""
    return key == target or key.endswith(f".{target}")


def check_targets(model: nn.Module, lora: LoraSection) -> None:
    """Every target names at least one module of the whole `model`, and every module named is a
    linear layer (the layer meshrun adapts: peft's lora.Linear); one line naming what exists."""
    modules = dict(model.named_modules())
    linear = sorted({key.rpartition(".")[2] for key, module in modules.items() if isinstance(module, nn.Linear)})
    for target in target_names(model, lora):
        found = [key for key in modules if key and matches(key, target)]
        if not found:
            raise ConfigError(
                f"model.lora.target_modules: {target!r} matches no module of this model; its linear layers are "
                f"{', '.join(linear) or 'none'}"
            )
        other = next((key for key in found if type(modules[key]) is not nn.Linear), None)
        if other is not None:
            raise ConfigError(
                f"model.lora.target_modules: {target!r} names {other}, a {type(modules[other]).__name__}: meshrun's "
                f"LoRA adapts nn.Linear layers only (this model's: {', '.join(linear) or 'none'})"
            )


def add_adapters(part: nn.Module, lora: LoraSection, *, seed: int | None) -> None:
    """peft's adapters added in place to the targeted modules `part` (a model or one stage) holds,
    every other parameter frozen; A drawn per name from `seed` (None: as made, e.g. on the meta device)."""
    from peft import LoraConfig, inject_adapter_in_model

    keys = [key for key, _ in part.named_modules()]
    held = [t for t in target_names(part, lora) if any(matches(key, t) for key in keys)]
    if not held:  # a stage without a targeted module: all frozen (peft refuses a config matching nothing)
        part.requires_grad_(False)
        return
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=held)
    inject_adapter_in_model(config, part, adapter_name=ADAPTER)
    if seed is not None:
        init_adapters(part, seed)


@torch.no_grad()
def init_adapters(part: nn.Module, seed: int) -> None:
    """peft's init drawn per adapter name: A ~ U(-b, b) with b = 1 / sqrt(in_features) (torch's
    kaiming_uniform_ with a = sqrt(5), as peft calls it), B zero."""
    for name, param in part.named_parameters():
        if is_adapter(name) and ".lora_A." in name:
            values = torch.empty(param.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=named_generator(seed, name))
            param.copy_(values)
        elif is_adapter(name):
            param.zero_()


def export_adapter(model: nn.Module, cfg: ModelConfig, out: Path) -> Path:
    """`meshrun export RUN --adapter OUT`: the trained adapters as peft saves them (what
    `PeftModel.from_pretrained(base, OUT)` loads): adapter_config.json with the modules adapted under
    their Hugging Face names, adapter_model.safetensors keyed `base_model.model.<HF module>.lora_A.weight`."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    from meshrun.models.hf import HFCausalLM
    from meshrun.models.hf_config import FUSED_PARTS, hf_dir
    from meshrun.models.hf_export import write_new_folder

    if cfg.lora is None or not isinstance(model, HFCausalLM):
        raise ConfigError("--adapter exports the adapters of a model.lora run; this run trained every weight: use --hf")
    if model.hf_config.model_type in FUSED_PARTS:
        raise ConfigError(f"--adapter: {model.hf_config.model_type}'s fused projections are not exported yet")
    if out.exists():
        raise ConfigError(f"{out} already exists; choose another --adapter folder")
    state, modules = {}, set()
    for name, param in model.named_parameters():
        module, found, tail = name.partition(f".{ADAPTER}.")  # blocks.0.self_attn.q_proj.lora_A
        if not found:
            continue
        owner, _, kind = module.rpartition(".")
        hf_module = model.hf_names(f"{owner}.weight")[0].removesuffix(".weight")  # model.layers.0.self_attn.q_proj
        state[f"base_model.model.{hf_module}.{kind}.{tail}"] = param.detach().contiguous()
        modules.add(hf_module.rpartition(".")[2])
    lora, source = cfg.lora, hf_dir(cfg)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=sorted(modules),
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(source.absolute()) if source is not None else None,
    )

    def write(tmp: Path) -> None:
        config.save_pretrained(str(tmp))
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    return write_new_folder(out, write)
