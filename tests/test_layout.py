"""Rules across config sections are validators on the schema: a Config built any way (YAML and
`--set`, code, a checkpoint's config.json) is checked, with the same one line naming the keys."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from meshrun.config.schema import Config, load_config, validate
from meshrun.errors import ConfigError

BATCH = "train.global_batch (8) must be a multiple of train.micro_batch x parallel.dp (2 x 3 = 6)"


def test_a_config_built_in_code_is_checked() -> None:
    with pytest.raises(ValidationError, match=BATCH.replace("(", r"\(").replace(")", r"\)")):
        Config(parallel={"dp": 3})
    with pytest.raises(ValidationError, match=r"launch.nnodes \(3\) must divide"):
        Config(parallel={"dp": 2}, launch={"nnodes": 3, "rdzv_endpoint": "h:1"})


@pytest.mark.parametrize(
    "data,message",
    [
        ({"parallel": {"dp": 3}}, BATCH),
        ({"parallel": {"dp": 2}, "profile": {"ranks": [0, 2]}}, "profile.ranks [2] do not exist: ranks are 0 to 1"),
        (
            {"parallel": {"dp": 2}, "launch": {"nnodes": 2, "nproc_per_node": 2, "rdzv_endpoint": "h:1"}},
            "launch.nnodes x launch.nproc_per_node (2 x 2) must equal parallel.dp x parallel.pp (2 x 1 = 2)",
        ),
    ],
)
def test_a_config_from_json_is_checked_with_one_line_naming_the_keys(data: dict, message: str) -> None:
    """What a checkpoint's or run's config.json goes through (export, sample, resume checks)."""
    with pytest.raises(ConfigError) as error:
        validate(json.loads(json.dumps(data)))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_yaml_and_overrides_get_the_same_line() -> None:
    with pytest.raises(ConfigError, match="^" + BATCH.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, ["parallel.dp=3", "train.global_batch=8", "train.micro_batch=2"])


def test_saved_degrees_read_every_mesh_axis_from_a_checkpoints_config(tmp_path) -> None:
    """A checkpoint's degrees name every axis Layout.mesh_degrees does (a resume keeps its RNG state
    only when they match); an axis its config lacks had degree 1, a config without pp is unreadable."""
    import json

    from meshrun.checkpoint.paths import CONFIG
    from meshrun.checkpoint.resume import saved_degrees
    from meshrun.parallel.layout import Layout

    (tmp_path / CONFIG).write_text(json.dumps({"parallel": {"pp": 2, "dp": 4}}))
    assert saved_degrees(tmp_path) == {"pp": 2, "dp": 4, "cp": 1, "tp": 1}
    assert saved_degrees(tmp_path).keys() == Layout().mesh_degrees.keys()
    (tmp_path / CONFIG).write_text(json.dumps({"parallel": {"dp": 4, "tp": 2}}))
    assert saved_degrees(tmp_path) is None
