"""The README's first commands (and docs/getting-started/first-run.md's), end to end: `meshrun train` with the packaged default config
(dp2 x pp2, 1F1B, precision auto, a BPE trained at first use), preparing the embedded corpus on first use, then
`meshrun sample` and `meshrun export`; and the check that tells a Python-looking sample from noise."""

from __future__ import annotations

import json
import keyword
import random
import re
import string
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from conftest import final_weights, read_metrics, run_meshrun
from safetensors.torch import load_file

EXPECTED_PRECISION = "bf16" if {"avx512_bf16", "amx_bf16"} & set(Path("/proc/cpuinfo").read_text().split()) else "fp32"
KEYWORDS = set(keyword.kwlist) | {"self"}


def python_structure_problems(text: str) -> list[str]:
    """What keeps `text` from looking like Python source (empty: it does). Checks layout
    (several lines, indentation in steps of 4 spaces), vocabulary (distinct keywords, `self`)
    and that it is text at all."""
    problems = []
    if sum(ch in string.printable for ch in text) < 0.97 * len(text):
        problems.append("not printable text")
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 4:
        problems.append(f"{len(lines)} non-empty lines")
    indents = [len(line) - len(line.lstrip(" ")) for line in lines if line.startswith(" ")]
    if len(indents) < 3 or sum(width % 4 == 0 for width in indents) < 0.8 * len(indents):
        problems.append(f"indentation not in steps of 4 spaces: {indents}")
    words = re.findall(r"[A-Za-z_]+", text)
    found = KEYWORDS & set(words)
    if len(found) < 4 or "self" not in found:
        problems.append(f"Python keywords found: {sorted(found)}")
    if words and sum(len(w) > 20 for w in words) > 0.05 * len(words):
        problems.append("run-on words")
    return problems


def _stdlib_snippet() -> str:
    source = (Path(sysconfig.get_paths()["stdlib"]) / "fractions.py").read_text()
    start = source.index("    def limit_denominator")
    return source[start : start + 600]


@pytest.mark.parametrize(
    "make,looks_like_python",
    [
        (lambda: _stdlib_snippet(), True),  # real Python passes
        (lambda: "".join(random.Random(0).sample(_stdlib_snippet(), 600)), False),  # its characters, shuffled
        (lambda: "".join(random.Random(1).choices(string.printable, k=600)), False),  # printable noise
        (lambda: random.Random(2).randbytes(600).decode("utf-8", errors="replace"), False),  # byte noise
        (lambda: "def self if for in return\n" * 3, False),  # keywords without indentation
    ],
)
def test_the_python_check_tells_python_from_noise(make, looks_like_python: bool) -> None:
    assert (python_structure_problems(make()) == []) == looks_like_python


def test_default_job_runs_end_to_end_and_samples_python(tmp_path: Path) -> None:
    """The README's commands exactly (docs/getting-started/first-run.md), on a machine that has never run meshrun: `meshrun train`
    (prepares the embedded corpus, trains 180 steps), then `meshrun sample runs/default --prompt
    "def "`, whose text must look like Python; then `meshrun export`. The wall time is printed
    (first-run.md states it; no timed assertion: machines differ)."""
    started = time.monotonic()
    result = run_meshrun(["train"], tmp_path=tmp_path, timeout=900)
    print(f"default job: {time.monotonic() - started:.0f} s wall")
    assert "preparing bpe:2048 data" in result.stderr  # nothing to download, nothing prepared by hand
    assert f"precision auto -> {EXPECTED_PRECISION}" in result.stderr
    for field in ("steps: 180", "final_loss", "final_val_loss", "tokens_per_s", "tflops", "peak_memory_gb", "run_dir"):
        assert field in result.stderr
    run = tmp_path / "runs" / "default"
    config = json.loads((run / "config.json").read_text())
    assert (config["parallel"]["dp"], config["parallel"]["pp"], config["precision"]) == (2, 2, EXPECTED_PRECISION)
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "loss" in r] == list(range(20, 181, 20))
    assert [r["step"] for r in rows if "val_loss" in r] == [90, 180]
    assert all(0 < r["bubble"] < 1 for r in rows if "bubble" in r)
    for picture in ("loss.png", "pipeline_timeline.png"):
        assert (run / picture).read_bytes().startswith(b"\x89PNG")
    assert list((run / "wandb").glob("offline-run-*"))
    sample = run_meshrun(["sample", "runs/default", "--prompt", "def "], tmp_path=tmp_path).stdout
    print(sample)
    assert sample.startswith("def ") and python_structure_problems(sample) == []
    run_meshrun(["export", "runs/default", "--out", "model.safetensors"], tmp_path=tmp_path)
    exported = load_file(tmp_path / "model.safetensors")
    trained = final_weights(run)
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
