"""Model families and how a config's `model` section becomes a model: each family declared once
(`FAMILIES`: its config section and its builder), or a user's `model.factory`; built on the meta
device and checked against the protocol (documented in `meshrun.models`)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from meshrun.config.model_sections import (
    EncDecSection,
    EncoderSection,
    GPTSection,
    HFSection,
    ModelConfig,
    ModelSection,
    TimeSeriesSection,
)
from meshrun.config.schema import Config
from meshrun.errors import ConfigError
from meshrun.models import encdec, lora
from meshrun.models.encdec import EncDec
from meshrun.models.encoder import Encoder
from meshrun.models.gpt import GPT
from meshrun.models.hf_config import is_hf
from meshrun.models.moe import MoEGPT
from meshrun.models.protocol import ProtocolModule, fresh_weights, pretrained_dir
from meshrun.models.timeseries import TimeSeries
from meshrun.versions import missing_extra

if TYPE_CHECKING:
    from meshrun.models.hf import HFCausalLM

S = TypeVar("S", bound=ModelSection)


@dataclass(frozen=True)
class Family(Generic[S]):
    """One model family: the config section it reads (`model.name` picks it) and its builder.
    Its optional hooks are the protocol's (models/protocol.py), each with its default."""

    section: type[S]
    build: Callable[[S], nn.Module]
    # the encoder's share of seq_len (an encoder-decoder's data splits each sample into source and
    # target); None: decoder-only, a sample is one sequence
    source_len: Callable[[S], int | None] = lambda cfg: None


def _hugging_face(cfg: HFSection) -> nn.Module:
    """A causal LM, or with model.num_labels (task classification) a sequence classifier: a decoder's
    or an encoder's (BERT)."""
    from meshrun.models.hf import HFCausalLM  # transformers: only when asked for
    from meshrun.models.hf_classifier import HFSequenceClassifier
    from meshrun.models.hf_encoder import HFEncoderClassifier, is_encoder

    if is_encoder(cfg):
        return HFEncoderClassifier(cfg)
    return HFCausalLM(cfg) if cfg.num_labels is None else HFSequenceClassifier(cfg)


def _gpt(cfg: GPTSection) -> nn.Module:
    """GPT, or with model.moe its Mixture-of-Experts form (models/moe.py)."""
    return GPT(cfg) if cfg.moe is None else MoEGPT(cfg)


FAMILIES: tuple[Family[Any], ...] = (
    Family(GPTSection, _gpt),
    Family(EncDecSection, EncDec, source_len=encdec.source_len),
    Family(EncoderSection, Encoder),
    Family(TimeSeriesSection, TimeSeries),
    Family(HFSection, _hugging_face),
)
# A user's factory may return anything: build_model checks it.
Factory = Callable[[ModelConfig], object]
PROTOCOL = ("embed", "blocks", "norm", "head", "init_weights", "flops_per_token")


def family_of(cfg: ModelConfig) -> Family[Any] | None:
    """The family whose section `cfg` is (None: a user's model.factory)."""
    return next((f for f in FAMILIES if isinstance(cfg, f.section)), None)


def source_len(cfg: ModelConfig) -> int | None:
    """The encoder's share of seq_len, as the config's family says (a user's factory: decoder-only)."""
    family = family_of(cfg)
    return None if family is None else family.source_len(cfg)


def resolve_factory(cfg: ModelConfig) -> Factory:
    """Find the constructor of the config's family, or the one model.factory names (errors name it)."""
    family = family_of(cfg)
    if family is not None:
        return family.build
    assert cfg.factory is not None  # no family of ours: the section model.factory chose
    module_name, sep, attr = cfg.factory.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"invalid model.factory {cfg.factory!r}: expected 'package.module:function'")
    factory = getattr(_import_factory_module(cfg.factory, module_name), attr, None)
    if factory is None:
        raise ConfigError(f"invalid model.factory {cfg.factory!r}: module {module_name} has no attribute {attr!r}")
    if not callable(factory):
        raise ConfigError(f"invalid model.factory {cfg.factory!r}: {attr} is not callable")
    return factory


def _import_factory_module(factory: str, module_name: str) -> ModuleType:
    """Import the user's module; whatever goes wrong (syntax, a missing module, an exception or
    sys.exit at import time) becomes one line naming model.factory."""
    where = f"invalid model.factory {factory!r}"
    try:
        return importlib.import_module(module_name)
    except SyntaxError as exc:
        raise ConfigError(
            f"{where}: SyntaxError in {exc.filename} line {exc.lineno}: {exc.msg}; fix the module"
        ) from None
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        here = [name for name in (f"{top}.py", top) if exc.name == top and (Path.cwd() / name).exists()]
        hint = (
            (
                f"; {here[0]} is in the current directory, which is not on the Python path here: "
                "run with PYTHONPATH=. (workers inherit it) or install the module"
            )
            if here
            else ""
        )
        raise ConfigError(f"{where}: {exc}{hint}") from None
    except SystemExit as exc:
        raise ConfigError(f"{where}: importing {module_name} called sys.exit({exc.code!r}); remove that call") from None
    except Exception as exc:  # the user's module failed while importing
        raise ConfigError(f"{where}: importing {module_name} raised {type(exc).__name__}: {exc}") from exc


class _SkipRandomInit(TorchFunctionMode):
    """Random initialisers do nothing: on the meta device there are no values to fill. (torch
    runs meta `normal_` through a decomposition that imports torch._dynamo, ~1.6 s of a
    process's start on 2 CPU cores, for nothing.) `init_weights` fills the materialised model."""

    SKIPPED = frozenset(
        {torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_}
    )

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def model_source(cfg: ModelConfig) -> str:
    """Where the model comes from, as messages name it: `model.name gpt`, `model.factory pkg:fn`, ..."""
    if is_hf(cfg):
        return f"model.hf {cfg.hf}" if cfg.hf is not None else "model.hf_config"
    return f"model.factory {cfg.factory}" if cfg.factory else f"model.name {cfg.name}"


def build_model(cfg: ModelConfig) -> ProtocolModule:
    """Construct the model on the meta device (no memory, no values) and check it follows the protocol."""
    factory = resolve_factory(cfg)
    source = model_source(cfg)
    try:
        with torch.device("meta"), _SkipRandomInit():
            model = factory(cfg)
    except ConfigError:
        raise
    except ModuleNotFoundError as exc:  # an optional package (transformers) the model imports
        raise missing_extra(exc, source) or ConfigError(f"{source} failed: ModuleNotFoundError: {exc}") from None
    except SystemExit as exc:  # a factory must return or raise, never end the process
        raise ConfigError(
            f"{source} called sys.exit({exc.code!r}) while building the model; "
            "make it return the model or raise an exception"
        ) from None
    except Exception as exc:  # the user's constructor: report it as a config problem, in one line
        raise ConfigError(f"{source} failed: {type(exc).__name__}: {exc}") from exc
    missing = [name for name in PROTOCOL if not hasattr(model, name)]
    if isinstance(model, nn.Module) and not missing and isinstance(model.blocks, nn.ModuleDict):
        return cast(ProtocolModule, model)  # checked: an nn.Module with the protocol's parts
    base = "blocks as nn.ModuleDict" if isinstance(model, nn.Module) else "nn.Module as base class"
    what = ", ".join(missing) or base
    raise ConfigError(f"model from {cfg.factory or cfg.name} does not follow the model protocol (missing {what})")


def flops_at(model: ProtocolModule, length: int) -> float:
    """The model's training FLOPs per token on `length`-token samples (a length bucket is shorter
    than model.seq_len); a user's model whose `flops_per_token` takes no length is priced as it says.
    A model with LoRA adapters (model.lora): its frozen weights need no weight gradient (lora.flops_per_token)."""
    if any(lora.is_adapter(name) for name, _ in model.named_parameters()):
        return lora.flops_per_token(cast("HFCausalLM", model), length)  # only Hugging Face models take adapters
    if "length" in inspect.signature(model.flops_per_token).parameters:
        return model.flops_per_token(length=length)
    return model.flops_per_token()


def init_line(cfg: Config, model: nn.Module) -> str:
    """Where a new run's weights come from, in one line (`model`: the whole model, any device)."""
    source = pretrained_dir(model)
    if source is not None:
        drawn = fresh_weights(model)  # a classifier's new head (LoRA's adapters are drawn too, unnamed)
        loaded = [name for name in model.state_dict() if not lora.is_adapter(name) and name not in drawn]
        new = f"; {', '.join(drawn)} drawn (seed {cfg.train.seed})" if drawn else ""
        return f"weights loaded from {source} ({len(loaded)} tensors{new})"
    if cfg.model.factory is not None:  # its init_weights may load weights of its own
        return f"weights from {cfg.model.factory}'s init_weights (seed {cfg.train.seed})"
    return f"random init (seed {cfg.train.seed})"
