"""`meshrun train --dry-run`: resolved config, process layout and batch maths; starts nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_meshrun, tiny

from meshrun import cli


def _split(stdout: str) -> tuple[dict, str]:
    """Dry-run output = the resolved config as YAML, then the layout and batch sections."""
    config_text, sep, plan = stdout.partition("\nlayout:\n")
    assert sep, f"no layout section in:\n{stdout}"
    return yaml.safe_load(config_text), plan


def test_dry_run_prints_config_layout_and_batch_maths(data_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = tiny(
        data_dir,
        run_dir,
        **{
            "parallel.dp": 2,
            "parallel.pp": 2,
            "train.global_batch": 16,
            "train.micro_batch": 2,
            "model.seq_len": 32,
            "train.lr": 4.2e-4,
            "recompute": "every:2",
            "tracker.name": 2024,
        },
    )
    result = run_meshrun(["train", *args, "--dry-run"], tmp_path=tmp_path, timeout=60)
    resolved, plan = _split(result.stdout)

    # the resolved config carries every section, with the --set overrides applied
    assert {"model", "data", "parallel", "train", "precision", "recompute", "tracker", "run_dir"} <= set(resolved)
    assert resolved["train"]["lr"] == 4.2e-4
    assert resolved["recompute"] == "every:2"
    assert (resolved["parallel"]["dp"], resolved["parallel"]["pp"]) == (2, 2)
    assert resolved["model"]["seq_len"] == 32
    assert resolved["tracker"]["name"] == "2024"  # a number given to a name field stays a name
    assert resolved["run_dir"] == str(run_dir)
    assert resolved["train"]["warmup_steps"] == 1 and resolved["train"]["weight_decay"] == 0.1  # defaults filled in

    # layout: rank = pp_rank * dp + dp_rank
    assert "world size 4 = dp 2 (ddp) x tp 1 x pp 2 (1f1b); rank = pp_rank * dp + dp_rank" in plan
    assert "pipeline rank 0: ranks [0, 1]" in plan
    assert "pipeline rank 1: ranks [2, 3]" in plan

    # batch maths: 16 = 2 x 2 x 4, and 16 samples x 32 tokens per step
    assert "global batch 16 samples = micro batch 2 x dp 2 x accumulation steps 4" in plan
    assert "tokens per step 512" in plan

    assert not run_dir.exists(), "--dry-run created the run dir"
    assert "starting" not in result.stderr


def test_dry_run_grid_of_tp_and_an_interleaved_pipeline(data_dir: Path, tmp_path: Path) -> None:
    """tp2 x pp2 interleaved: the schedule, the stages each pipeline rank holds (loop style) and
    their blocks, each stage split over a tp pair; at dp 1 nothing wraps for data parallelism."""
    layout = {"parallel.tp": 2, "parallel.pp": 2, "parallel.schedule": "interleaved-1f1b"}
    result = run_meshrun(["train", *tiny(data_dir, tmp_path / "run", **layout), "--dry-run"], tmp_path=tmp_path)
    _, plan = _split(result.stdout)
    assert plan.splitlines()[:4] == [
        "  world size 4 = dp 1 x tp 2 x pp 2 (interleaved-1f1b, 2 stages per rank); rank = (pp_rank * dp + dp_rank) * tp + tp_rank",
        "  schedule interleaved-1f1b: 4 stages, 2 a pipeline rank, each split over its 2 tp ranks",
        "  pipeline rank 0: ranks [0, 1], stages [0, 2], blocks [0] + [2]",
        "  pipeline rank 1: ranks [2, 3], stages [1, 3], blocks [1] + [3]",
    ]
    assert "data parallel:\n  none (dp 1)\n" in plan  # no FSDP2 at dp 1


def test_dry_run_default_config_from_any_directory(tmp_path: Path) -> None:
    """No CONFIG: the packaged default (same as configs/default.yaml); no data is prepared."""
    result = run_meshrun(["train", "--dry-run", "--set", "train.steps=7"], tmp_path=tmp_path, timeout=60)
    resolved, plan = _split(result.stdout)
    default = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    for section in ("model", "parallel"):
        assert default[section].items() <= resolved[section].items()
    assert resolved["precision"] == default["precision"]
    assert resolved["train"]["steps"] == 7
    dp, pp = default["parallel"]["dp"], default["parallel"]["pp"]
    assert f"world size {dp * pp} = dp {dp} (ddp) x tp 1 x pp {pp} (1f1b)" in plan
    b = default["train"]
    accumulation = b["global_batch"] // (b["micro_batch"] * dp)
    assert f"micro batch {b['micro_batch']} x dp {dp} x accumulation steps {accumulation}" in plan
    assert f"tokens per step {b['global_batch'] * default['model']['seq_len']}" in plan
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "cache" / "meshrun").exists(), "--dry-run prepared data"


def test_dry_run_accepts_both_set_spellings_and_the_last_one_wins(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("train:\n  lr: 0.01\n  steps: 3\nrun_dir: from-yaml\n")
    result = run_meshrun(
        [
            "train",
            str(config),
            "--set",
            "train.lr=0.02",
            "--set=train.lr=0.03",
            "--set",
            "run_dir=from-set",
            "--dry-run",
        ],
        tmp_path=tmp_path,
        timeout=60,
    )
    resolved, _ = _split(result.stdout)
    assert resolved["train"]["lr"] == 0.03
    assert resolved["train"]["steps"] == 3  # from the file
    assert resolved["run_dir"] == "from-set"
    assert not (tmp_path / "from-set").exists() and not (tmp_path / "from-yaml").exists()


def test_a_run_says_where_its_weights_come_from_and_what_comes_next(data_dir: Path, tmp_path: Path) -> None:
    """One process, two steps: the console names the init, the next commands with the run's path,
    and `export` names the step and the file; `sample` ends its output with a newline."""
    run_dir = tmp_path / "run"
    trained = run_meshrun(
        ["train", *tiny(data_dir, run_dir, **{"train.steps": 2, "train.seed": 7})], tmp_path=tmp_path, timeout=120
    )
    assert "[meshrun] random init (seed 7)" in trained.stderr.splitlines()
    nexts = [line for line in trained.stderr.splitlines() if line.startswith("[meshrun] next: ")]
    assert len(nexts) == 1 and f"meshrun sample {run_dir}" in nexts[0] and f"meshrun report {run_dir}" in nexts[0]
    out = tmp_path / "model.pt"
    exported = run_meshrun(["export", str(run_dir), "--out", str(out)], tmp_path=tmp_path, timeout=120)
    assert exported.stdout.startswith("exported step 2 (") and exported.stdout.rstrip().endswith(str(out))
    sampled = run_meshrun(["sample", str(run_dir), "--tokens", "5"], tmp_path=tmp_path, timeout=120)
    assert sampled.stdout.endswith("\n") and not sampled.stdout.endswith("\n\n")


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"meshrun {version('meshrun')}\n"


@pytest.mark.parametrize(
    ("overrides", "fits", "misfits"),
    [
        ({}, ["sample RUN --prompt 'def '", "export RUN --out RUN/model.safetensors"], ["--hf"]),
        ({"data.sources": ["x.txt"]}, ["--prompt 'TEXT TO CONTINUE'"], ["def "]),
        ({"model.name": "encdec", "data.pairs": True}, ["--prompt get_terminal_size"], ["def "]),
        ({"model.hf_config": {"model_type": "llama", "hidden_size": 32}}, ["export RUN --hf RUN/hf"], ["--out"]),
    ],
    ids=["embedded-code", "own-text", "encdec-example", "hf"],
)
def test_the_next_commands_fit_the_run(overrides: dict, fits: list[str], misfits: list[str]) -> None:
    """A run's `next:` line: a prompt like its training text (a source to translate for pairs and an
    encoder-decoder, not `def `), and the export a Hugging Face model is loaded back from."""
    from meshrun.config.schema import load_config
    from meshrun.files.console import next_steps
    from meshrun.generation.sample import sample_prompt
    from meshrun.models.hf_config import is_hf

    sets = {"run_dir": "RUN", **({"data.dir": "x"} if "data.sources" in overrides else {}), **overrides}
    cfg = load_config(
        None, [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip()}" for key, value in sets.items()]
    )
    line = next_steps(cfg.run_dir, offline_wandb=False, prompt=sample_prompt(cfg), hf=is_hf(cfg.model))
    assert all(f"meshrun {text}" in line or text in line for text in fits), line
    assert not any(text in line for text in misfits), line


def test_the_next_command_of_a_chat_run_samples_with_chat(tmp_path: Path) -> None:
    """A run fine-tuned on conversations is sampled with --chat (what it learned to answer), not --prompt."""
    from meshrun.config.schema import load_config
    from meshrun.files.console import next_steps
    from meshrun.generation.sample import sample_prompt

    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "meta.json").write_text('{"format": "documents", "kind": "chat"}')
    cfg = load_config(None, [f"data.dir={tmp_path / 'chats'}", "run_dir=RUN"])
    line = next_steps(cfg.run_dir, offline_wandb=False, prompt=sample_prompt(cfg), hf=False)
    assert "meshrun sample RUN --chat MESSAGE" in line and "--prompt" not in line, line
