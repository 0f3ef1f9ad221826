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

The frozen base may stay in the dtype its folder stores (`model.lora.base_dtype`; by default under
precision bf16 / fp16): its parameters take the stored dtypes on the meta device, before anything is
allocated, so loading copies them bit for bit; peft then makes the adapters in the base layer's dtype
and `cast_adapter_dtype` upcasts them to fp32, as `get_peft_model` does.

A run over a folder's weights checkpoints the adapters (and their optimizer state) only, with the
folder's identity (`base_identity`: its path and a content hash) in the manifest: the base is the
folder's, never written, and a checkpoint resumes or exports only onto the same weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from meshrun.config.model_sections import HFSection, LoraSection, ModelConfig
from meshrun.config.schema import Config
from meshrun.errors import ConfigError
from meshrun.hardware.device import local_device
from meshrun.hardware.precision import resolve_precision
from meshrun.models.hf_config import hf_dir
from meshrun.models.hf_weights import has_weights, stored_dtypes, weights_digest
from meshrun.models.init import named_generator
from meshrun.models.moe import sparse_mlps

if TYPE_CHECKING:
    from meshrun.models.hf import HFCausalLM

ADAPTER = "default"  # peft's adapter name: its saved files and PeftModel expect it


def is_adapter(name: str) -> bool:
    """A parameter or state-dict name of one of peft's LoRA adapters (not of the base model)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def is_lora_layer(module: nn.Module) -> bool:
    """A layer peft's LoRA wrapped (its `lora.Linear`): the layer under `base_layer`, the adapters in
    `lora_A` and `lora_B` (tensor parallelism splits it as a whole: parallel/tp_styles.py)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "lora_A")


def frozen_base(cfg: ModelConfig) -> Path | None:
    """The folder a LoRA run's frozen base is read from: its checkpoints then hold the adapters only.
    None: no model.lora, or a base drawn at random (model.init random, model.hf_config without
    weights), which no folder restores: checkpointed whole, as full training does."""
    if cfg.lora is None or not isinstance(cfg, HFSection) or cfg.init == "random":
        return None
    folder = hf_dir(cfg)
    return folder if folder is not None and has_weights(folder) else None


def base_identity(cfg: ModelConfig) -> dict[str, str] | None:
    """What an adapter-only checkpoint records of its base: the folder and `weights_digest` of it
    (None: checkpoints hold the whole model)."""
    folder = frozen_base(cfg)
    return None if folder is None else {"path": str(folder.absolute()), "sha256": weights_digest(folder)}


def base_as_stored(cfg: Config) -> bool:
    """`model.lora.base_dtype` resolved for this job: whether the frozen base keeps the dtypes its
    folder stores (else fp32, as full fine-tuning holds weights). auto keeps them where autocast
    computes in half precision anyway, and upcasts under fp32, which the user asked for and which a
    CPU without native bf16 computes 8x faster than emulated bf16. `cfg.precision` auto means what it
    means on this machine's device (the planner resolves it for the device it plans for first)."""
    lora = cfg.model.lora
    if lora is None or lora.base_dtype == "fp32" or frozen_base(cfg.model) is None:
        return False
    if lora.base_dtype == "folder":
        return True
    return resolve_precision(cfg.precision, local_device()).precision in ("bf16", "fp16")


@torch.no_grad()
def hold_base_as_stored(part: nn.Module, cfg: Config) -> None:
    """`part` (one stage of an HFCausalLM, on the meta device) with each base parameter in the dtype
    its folder stores, when `base_as_stored`: loading then copies it bit for bit."""
    folder = frozen_base(cfg.model)
    if folder is None or not base_as_stored(cfg):
        return
    model = cast("HFCausalLM", part)
    dtypes = stored_dtypes(model.pretrained_tensors(folder), model.hf_names, folder)
    for param in part.parameters():
        if id(param) in dtypes:
            param.data = param.data.to(dtypes[id(param)])  # what nn.Module.to does; free on meta


def check_same_base(checkpoint: Path, saved: object, base: dict[str, str], *, fix: str) -> None:
    """Adapters go only onto the weights they were trained on: the same digest (a copy of the folder
    elsewhere is the same base). `saved`: the checkpoint manifest's `base` (None: a checkpoint of the
    whole model, base included, as older ones are). One line ending in `fix` otherwise."""
    if saved is None or (isinstance(saved, dict) and saved.get("sha256") == base["sha256"]):
        return
    was = f"{saved.get('path')} (sha256 {str(saved.get('sha256'))[:12]})" if isinstance(saved, dict) else "unknown"
    raise ConfigError(
        f"checkpoint {checkpoint} holds LoRA adapters trained on the base {was}, but model.hf {base['path']} "
        f"holds other weights (sha256 {base['sha256'][:12]}); {fix}"
    )


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
    from peft.tuners.tuners_utils import cast_adapter_dtype

    keys = [key for key, _ in part.named_modules()]
    held = [t for t in target_names(part, lora) if any(matches(key, t) for key in keys)]
    if not held:  # a stage without a targeted module: all frozen (peft refuses a config matching nothing)
        part.requires_grad_(False)
        return
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=held)
    inject_adapter_in_model(config, part, adapter_name=ADAPTER)
    cast_adapter_dtype(part, ADAPTER)  # made in the base layer's dtype: fp32, as get_peft_model makes them
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


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of the whole `model` (meta is fine), counted as peft's
    `get_nb_trainable_parameters` counts them: each parameter once (a tied matrix once)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def lora_row(counts: tuple[int, int], trainable_state_bytes: int) -> dict[str, int]:
    """A LoRA run's figures in each metrics row beside `state_bytes` (and in summary.json):
    `parameter_counts` and the largest rank's trainable state (the adapters' params + grads +
    optimizer state, local shards)."""
    return {"trainable_params": counts[0], "params": counts[1], "trainable_state_bytes": trainable_state_bytes}


def flops_per_token(model: HFCausalLM, length: int) -> float:
    """Training FLOPs per token of a model with adapters on `length`-token samples: the model's own
    count (6 per matmul weight, adapters included, + attention) with every frozen weight at 4, not 6:
    its forward (2) and the gradient of its input (2), which the adapters below it need, but no
    gradient of its own (the 2 the count leaves out). A tied head reads the frozen embedding matrix."""
    frozen = sum(
        p.numel() for name, p in model.named_parameters() if not p.requires_grad and not name.startswith("embed.")
    )
    if model.tied:
        frozen += model.hf_config.vocab_size * model.hf_config.hidden_size
    for mlp in sparse_mlps(model.blocks).values():  # MoE: a token runs through top_k of E experts only
        share = 1 - mlp.gate.top_k / mlp.gate.num_experts
        frozen -= share * sum(p.numel() for p in mlp.experts.parameters() if not p.requires_grad)
    return model.flops_per_token(length=length) - 2.0 * frozen


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
