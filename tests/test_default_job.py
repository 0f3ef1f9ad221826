"""The README's first command, end to end: `meshrun train` with the packaged default config
(dp2 x pp2, 1F1B, bf16, recompute), preparing the embedded corpus on first use."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import final_weights, read_metrics, run_meshrun


def test_default_job_runs_end_to_end_and_samples(tmp_path: Path) -> None:
    short = ["--set=train.steps=4", "--set=train.log_interval=2", "--set=train.eval_interval=4"]
    result = run_meshrun(["train", *short], tmp_path=tmp_path)
    assert "preparing byte-level data" in result.stderr  # nothing to download, nothing prepared by hand
    for field in ("steps: 4", "final_loss", "final_val_loss", "tokens_per_s", "tflops", "peak_memory_gb", "run_dir"):
        assert field in result.stderr
    run = tmp_path / "runs" / "default"
    config = json.loads((run / "config.json").read_text())
    assert (config["parallel"]["dp"], config["parallel"]["pp"], config["precision"]) == (2, 2, "bf16")
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "loss" in r] == [2, 4] and any("val_loss" in r for r in rows)
    assert all(0 < r["bubble"] < 1 for r in rows if "bubble" in r)
    for picture in ("loss.png", "pipeline_timeline.png"):
        assert (run / picture).read_bytes().startswith(b"\x89PNG")
    assert list((run / "wandb").glob("offline-run-*"))
    sample = run_meshrun(["sample", "runs/default", "--prompt", "import ", "--tokens", "20"], tmp_path=tmp_path)
    assert sample.stdout.startswith("import ")
    run_meshrun(["export", "runs/default", "--out", "model.safetensors"], tmp_path=tmp_path)
    exported = load_file(tmp_path / "model.safetensors")
    trained = final_weights(run)
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
