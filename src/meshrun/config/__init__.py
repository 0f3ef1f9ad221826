"""The one config mechanism (`schema`), its building blocks (`fields`), the model sections (`model`), the parallel and launch
sections (`topology`) and the YAML reader (`safe_yaml`). Torch-free.

`from meshrun.config import ModelConfig` (a user's `model.factory` receives one) keeps working."""

from meshrun.config.model_sections import ModelConfig
from meshrun.config.schema import Config, load_config

__all__ = ["Config", "ModelConfig", "load_config"]
