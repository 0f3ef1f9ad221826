"""What is installed, checked before any worker starts.

The torch meshrun is tested with: DCP's pickled metadata classes and the pipelining internals
meshrun relies on change between torch releases, so an untested torch fails later in confusing
ways (or loads a checkpoint differently).

Optional packages (the `hf`, `lora` and `tensorboard` extras of the meshrun package): a config that needs
one that is not installed is refused in one line that names the key needing it and the pip command
that installs it (a base install and the smallest images have neither). Torch-free: only import
machinery is asked, nothing is imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING

from meshrun.config.model_sections import HFSection
from meshrun.errors import ConfigError

if TYPE_CHECKING:
    from meshrun.config.schema import Config

SUPPORTED_TORCH = (2, 13)  # (major, minor); pyproject.toml declares the same: torch>=2.13,<2.14
TORCH_REQUIREMENT = f"torch>={SUPPORTED_TORCH[0]}.{SUPPORTED_TORCH[1]},<{SUPPORTED_TORCH[0]}.{SUPPORTED_TORCH[1] + 1}"


def check_torch_version(version: str) -> None:
    """Refuse a torch outside the tested range; `version` as pip reports it (e.g. 2.13.0+cu128)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) != SUPPORTED_TORCH:
        raise ConfigError(
            f"torch {version} is not supported: meshrun is tested with {TORCH_REQUIREMENT}; "
            f"install it with `pip install '{TORCH_REQUIREMENT}'` (the CUDA build for your GPUs)"
        )


def installed_torch_version() -> str:
    """The installed torch's version from its package metadata, without importing torch (slow)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"torch is not installed; install it with `pip install '{TORCH_REQUIREMENT}'`") from None


def installed_versions() -> dict[str, str]:
    """torch and meshrun versions, recorded in every checkpoint's manifest."""
    from meshrun import __version__

    return {"torch": installed_torch_version(), "meshrun": __version__}


# package -> extra (others: pip install PACKAGE)
EXTRA_OF = {"transformers": "hf", "peft": "lora", "tensorboard": "tensorboard"}


def installed(package: str) -> bool:
    """The package can be imported here (an import hook that hides it counts as absent)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def install_hint(package: str) -> str:
    extra = EXTRA_OF.get(package)
    return f'pip install "meshrun[{extra}]"' if extra else f"pip install {package}"


def require(package: str, key: str) -> None:
    """Refuse, naming `key`, when `package` is missing."""
    if not installed(package):
        raise ConfigError(f"{key} needs the {package} package, which is not installed: {install_hint(package)}")


def missing_extra(exc: ModuleNotFoundError, where: str) -> ConfigError | None:
    """The one line for an optional package found missing only at import time (None: not one of ours)."""
    package = (exc.name or "").split(".")[0]
    if package not in (*EXTRA_OF, "sentencepiece"):
        return None
    return ConfigError(f"{where} needs the {package} package, which is not installed: {install_hint(package)}")


def check_extras(cfg: Config, *, trains: bool = True, prepares_data: bool = False) -> None:
    """Every optional package the config's keys need here: the model's, the tracker backends' when
    this command trains (`trains`: export, sample, plan and k8s log nothing), and, when the job
    prepares its data (`prepares_data`), the data tokenizer's."""
    if isinstance(cfg.model, HFSection):
        require("transformers", "model.hf" if cfg.model.hf is not None else "model.hf_config")
    if cfg.model.lora is not None:
        require("peft", "model.lora")
    tokenizer = cfg.data.tokenizer
    if prepares_data and tokenizer and tokenizer != "byte" and not tokenizer.startswith("bpe:"):
        _tokenizer_folder_needs(Path(tokenizer), "data.tokenizer")
    if trains and "tensorboard" in cfg.tracker.backends:
        require("tensorboard", "tracker.backends: tensorboard")


def _tokenizer_folder_needs(folder: Path, key: str) -> None:
    """A model folder without tokenizer.json is read by transformers; a sentencepiece
    tokenizer.model alone is converted with sentencepiece."""
    if not folder.is_dir() or (folder / "tokenizer.json").is_file():
        return
    if (folder / "tokenizer.model").is_file() or (folder / "vocab.json").is_file():
        require("transformers", f"{key} {folder} (a tokenizer without tokenizer.json)")
    if (folder / "tokenizer.model").is_file():
        require("sentencepiece", f"{key} {folder} (tokenizer.model)")
