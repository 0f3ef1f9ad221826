"""`task` and `task_options` (config/tasks.py): the default follows the data as before `task`
existed, options belong to their task, the encoder's head follows its task, and a task the model
family cannot do is refused in one line before any worker, by `train` (with or without --dry-run)
and `plan` alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun import cli
from meshrun.config.schema import load_config
from meshrun.errors import ConfigError

CONFIGS = Path(__file__).parents[1] / "configs"


def test_the_task_defaults_to_what_the_config_trained_before_task_existed() -> None:
    assert load_config().task == "causal_lm"
    assert load_config(None, ["data.pairs=true"]).task == "seq2seq"
    assert load_config(CONFIGS / "encdec-example.yaml").task == "seq2seq"
    assert (
        load_config(None, ["task=Regression", "model.name=timeseries", "task_options.horizon=4"]).task_options.horizon
        == 4
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.pairs=true", "task=causal_lm"], "data.pairs prepares seq2seq text pairs, not data for task causal_lm"),
        (["model.name=encdec", "task=classification"], "model.name encdec is an encoder-decoder"),
        (["task=seq2seq"], "task seq2seq trains on text pairs .* this config has neither"),  # would train causal_lm
        (
            ["task_options.mask_rate=0.3"],
            "task_options.mask_rate is an option of task masked_lm, not of task causal_lm",
        ),
        (["task=regression", "model.name=timeseries", "task_options.mask_rate=0.3"], "not of task regression"),
        (["task=translation"], "invalid task: use 'causal_lm', 'seq2seq'"),
        (["task=classification"], "task classification trains model.name encoder or hf in this version, not gpt"),
        (["model.name=encoder"], "model.name encoder is a bidirectional encoder, trained as task classification or"),
        (["task=masked_lm"], "task masked_lm trains model.name encoder in this version, not gpt"),
        (["task=masked_lm", "model.name=encdec"], "model.name encdec is an encoder-decoder, trained as task seq2seq"),
        (["task=classification", "model.name=encoder", "model.head=tokens"], "model.head tokens is not task classif"),
        (["task=masked_lm", "model.name=encoder", "model.num_labels=3"], "an encoder with head tokens has none"),
        (["task=regression", "task_options.loss=l1"], "invalid task_options.loss: use 'mse', 'mae' or 'huber'"),
        (["task=regression"], "task regression trains model.name timeseries in this version, not gpt"),
        (["model.name=timeseries"], "model.name timeseries forecasts numeric series, trained as task regression"),
    ],
)
def test_a_task_and_its_options_must_fit(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_encoders_head_follows_its_task() -> None:
    assert load_config(None, ["task=masked_lm", "model.name=encoder"]).model.head == "tokens"
    assert load_config(None, ["task=classification", "model.name=encoder"]).model.head == "labels"


@pytest.mark.parametrize("command", [["train", "--dry-run"], ["train"], ["plan"]])
@pytest.mark.parametrize("model", ["gpt", "encdec"])
def test_a_task_the_model_cannot_do_is_refused_in_one_line(
    command: list[str], model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = ["task=masked_lm", f"model.name={model}", f"run_dir={tmp_path / 'run'}"]
    code = cli.main([*command, *(f"--set={s}" for s in settings)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "masked_lm" in err
    assert not (tmp_path / "run").exists()  # nothing started
