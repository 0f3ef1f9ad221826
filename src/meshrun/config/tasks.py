"""The job's objective (`task`) and its options (`task_options`): what a batch holds and what the
last stage computes. Torch-free, like every config module.

seq2seq is today's pairs path (data.pairs, or an encoder-decoder model): a config that does not
name its task gets seq2seq there and causal_lm elsewhere, so configs written before `task`
existed mean what they meant.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from meshrun.config.fields import Float, Int, Section, lowercase
from meshrun.errors import ConfigError

TaskName = Annotated[
    Literal["causal_lm", "seq2seq", "classification", "regression", "masked_lm"], BeforeValidator(lowercase)
]
GENERATIVE_TASKS = ("causal_lm", "seq2seq")  # the tasks whose models `meshrun sample` continues
# the model families that can do a task (a task not named here: any but these)
TASK_MODELS = {"classification": ("encoder", "hf"), "regression": ("timeseries",), "masked_lm": ("encoder",)}
ENCODER_HEADS = {"classification": "labels", "masked_lm": "tokens"}  # the built-in encoder's head for each task


def nonnegative_weights(weights: Any) -> Any:
    """A class weight below zero is refused (0 leaves a label out of the loss)."""
    values = weights.values() if isinstance(weights, dict) else weights if isinstance(weights, list) else None
    if values is None:
        return weights
    if any(w < 0 for w in values):
        raise ValueError("class weights must be >= 0 (0 leaves a label out of the loss)")
    return weights


ClassWeights = Annotated[
    Literal["balanced"] | list[Float] | dict[str, Float] | None,
    BeforeValidator(lowercase),
    AfterValidator(nonnegative_weights),
]


class TaskOptions(Section):
    horizon: Int = Field(default=1, ge=1)
    """regression: future values each window predicts (after model.seq_len past values)."""
    loss: Annotated[Literal["mse", "mae", "huber"], BeforeValidator(lowercase)] = "mse"
    """regression: mse (mean squared error), mae (mean absolute error) or huber (smooth L1, delta 1)."""
    class_weights: ClassWeights = None
    """classification: each label's weight in the cross-entropy, as torch's `F.cross_entropy(weight=...)`
    weighs it: a sample counts its label's weight, and the loss divides by the summed weights of the
    global batch's samples (not their number), on every layout. A {label: weight} mapping (labels
    not named weigh 1), a list of one weight per label in the data's label order (meta.json `labels`:
    whole numbers by value, then text), or `balanced`: rows / (labels x the label's training rows),
    scikit-learn's rule. Weights >= 0; the validation loss is weighted alike, accuracy and macro F1 not."""
    mask_rate: Float = Field(default=0.15, gt=0.0, lt=1.0)
    """masked_lm: share of (non-special) tokens chosen for prediction; of those 80% become the mask token,
    10% a random token, 10% stay (BERT's rule). The number of labels of classification comes from its data."""

    def check_for(self, task: str) -> None:
        """An option of another task, set away from its default, is refused rather than ignored."""
        for key, owner in TASK_OF_OPTION.items():
            if task != owner and getattr(self, key) != TaskOptions.model_fields[key].default:
                raise ConfigError(
                    f"task_options.{key} is an option of task {owner}, not of task {task}; remove it or set task: {owner}"
                )


TASK_OF_OPTION = {
    "horizon": "regression",
    "loss": "regression",
    "class_weights": "classification",
    "mask_rate": "masked_lm",
}


def default_task(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (the raw config mapping) with `task` filled in where it is not given: seq2seq for pairs
    data or an encoder-decoder model, else causal_lm; and the encoder's `model.head` where it is not
    given: the task's (ENCODER_HEADS)."""
    if not isinstance(data, dict):
        return data
    if "task" not in data:
        data = {**data, "task": "seq2seq" if _is_seq2seq(data) else "causal_lm"}
    model, head = data.get("model"), ENCODER_HEADS.get(str(data["task"]).lower())
    if isinstance(model, dict) and model.get("name") == "encoder" and "head" not in model and head:
        data = {**data, "model": {**model, "head": head}}
    return data


def _is_seq2seq(data: dict[str, Any]) -> bool:
    section, model = data.get("data"), data.get("model")
    pairs = section.get("pairs") if isinstance(section, dict) else getattr(section, "pairs", False)
    name = model.get("name") if isinstance(model, dict) else getattr(model, "name", None)
    return pairs is True or str(pairs).lower() == "true" or name == "encdec"


def check_task(
    task: str,
    *,
    pairs: bool,
    model_name: str,
    options: TaskOptions,
    encoder_head: str | None = None,
    hf_num_labels: int | None = None,
) -> None:
    """data.pairs and an encoder-decoder model are seq2seq's, the encoder is classification's (head labels) and
    masked_lm's (head tokens), timeseries regression's; task_options belong to their task; a Hugging Face model
    has model.num_labels (a score head) exactly under task classification."""
    if task != "seq2seq" and pairs:
        raise ConfigError(f"data.pairs prepares seq2seq text pairs, not data for task {task}: set task: seq2seq")
    if task != "seq2seq" and model_name == "encdec":
        raise ConfigError(f"model.name encdec is an encoder-decoder, trained as task seq2seq, not {task}")
    if task == "seq2seq" and not pairs and model_name != "encdec":  # it would train causal_lm under its name
        raise ConfigError(
            f"task seq2seq trains on text pairs (data.pairs: true) or an encoder-decoder (model.name: encdec); "
            f"this config has neither (model.name {model_name}): set them, or leave task out for causal_lm"
        )
    models = TASK_MODELS.get(task)
    if models is not None and model_name not in models:
        raise ConfigError(
            f"task {task} trains model.name {' or '.join(models)} in this version, not {model_name}: set model.name: {models[0]}"
        )
    if model_name == "encoder" and task not in ENCODER_HEADS:
        raise ConfigError(
            f"model.name encoder is a bidirectional encoder, trained as task classification or masked_lm, not {task}"
        )
    if model_name == "encoder" and encoder_head != ENCODER_HEADS[task]:
        raise ConfigError(
            f"model.head {encoder_head} is not task {task}'s head: set model.head: {ENCODER_HEADS[task]} or remove it"
        )
    if model_name == "timeseries" and task != "regression":
        raise ConfigError(f"model.name timeseries forecasts numeric series, trained as task regression, not {task}")
    if model_name == "hf" and task == "classification" and hf_num_labels is None:
        raise ConfigError(
            "task classification with a Hugging Face model needs model.num_labels (the data's label count, "
            "meta.json's num_labels): set it"
        )
    if model_name == "hf" and task != "classification" and hf_num_labels is not None:
        raise ConfigError(
            f"model.num_labels gives a Hugging Face model a classification head, trained as task classification, "
            f"not {task}: remove model.num_labels or set task: classification"
        )
    options.check_for(task)
