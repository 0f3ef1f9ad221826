"""parallel/context.py's all-to-alls under real torchrun (2 ranks, gloo, fp32): the step-1 loss and
gradients with attention split over cp 2 equal the whole model on one rank, on plain text and on
packed documents that cross the chunk boundary, for the built-in GPT and the Hugging Face Llama,
Qwen2, Qwen3, Mistral and OLMo 2 decoders (Llama also trains at cp2 in tests/models/test_hf.py); broken
variants differ: positions counted from 0 on each rank (learned positions, and rotary ones in each
Hugging Face family), the second all-to-all returning positions to the wrong rank (GPT). One
launch (cp_attention_worker.py) for every row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import meshrun_env


@pytest.fixture(scope="module")
def differences(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """row -> [|loss - reference|, max |grad - reference|]."""
    tmp = tmp_path_factory.mktemp("cp-attention")
    worker = Path(__file__).with_name("cp_attention_worker.py")
    argv = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*argv, str(worker), str(tmp / "found.json")],
        cwd=tmp,
        env=meshrun_env(tmp),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp / "found.json").read_text())


MODELS = ["", "llama-", "qwen2-", "qwen3-", "mistral-", "olmo2-"]  # the built-in GPT, then the HF families


@pytest.mark.parametrize("data", ["plain", "packed"])
@pytest.mark.parametrize("model", MODELS, ids=["gpt", *(m.rstrip("-") for m in MODELS[1:])])
def test_split_attention_equals_the_whole_model(model: str, data: str, differences) -> None:
    loss, grads = differences[f"{model}{data}-cp2"]
    assert loss < 1e-5 and grads < 1e-5


@pytest.mark.parametrize("data", ["plain", "packed"])
@pytest.mark.parametrize(
    ("model", "broken"),
    [("", "local-positions"), ("", "wrong-rank"), *((m, "local-positions") for m in MODELS[1:])],
    ids=["gpt-local-positions", "gpt-wrong-rank", *(f"{m.rstrip('-')}-local-positions" for m in MODELS[1:])],
)
def test_broken_variants_differ_at_step_one(model: str, broken: str, data: str, differences) -> None:
    loss, grads = differences[f"{model}{data}-{broken}"]
    assert loss > 1e-4 and grads > 1e-4
