"""Optional packages (transformers, peft, tensorboard) missing, as on a base install or a small image:
the config key that needs one is named with the pip command, exit 2, before any worker.

The package is hidden for real: a sitecustomize on PYTHONPATH puts an import hook first on
sys.meta_path that raises ModuleNotFoundError for the hidden names, so `import transformers`
and `importlib.util.find_spec("transformers")` both fail in the real `python -m meshrun`.
Hiding torch as well proves the answer comes before torch is imported.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, meshrun_env
from test_config import HF_LLAMA

from meshrun.versions import EXTRA_OF

HIDER = '''
import os, sys

HIDDEN = set(os.environ["MESHRUN_TEST_HIDE"].split(","))


class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hide())
'''


def _meshrun_without(hidden: str, argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "hide").mkdir(exist_ok=True)
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDER)
    env = meshrun_env(tmp_path, PYTHONPATH=str(tmp_path / "hide"), MESHRUN_TEST_HIDE=hidden)
    return subprocess.run(
        [sys.executable, "-m", "meshrun", *argv],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    "hidden,argv,expect",
    [
        (
            "transformers,torch",
            ["train", "--dry-run", f"--set=model.hf_config={json.dumps(HF_LLAMA)}"],
            'model.hf_config needs the transformers package, which is not installed: pip install "meshrun[hf]"',
        ),
        (
            "tensorboard,torch",
            ["train", "--dry-run", "--set=tracker.backends=[jsonl, tensorboard]"],
            (
                "tracker.backends: tensorboard needs the tensorboard package, which is not installed: "
                'pip install "meshrun[tensorboard]"'
            ),
        ),
        (
            "peft,torch",
            ["train", "--dry-run", f"--set=model.hf_config={json.dumps(HF_LLAMA)}", "--set=model.lora.r=8"],
            'model.lora needs the peft package, which is not installed: pip install "meshrun[lora]"',
        ),
        (
            "transformers",
            ["plan", f"--set=model.hf_config={json.dumps(HF_LLAMA)}"],
            'model.hf_config needs the transformers package, which is not installed: pip install "meshrun[hf]"',
        ),
    ],
    ids=["train-hf-no-transformers", "train-no-tensorboard", "train-lora-no-peft", "plan-hf-no-transformers"],
)
def test_missing_optional_package_is_named_with_its_install_command(
    hidden: str, argv: list[str], expect: str, tmp_path: Path
) -> None:
    done = _meshrun_without(hidden, [*argv, f"--set=run_dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"meshrun: error: {expect}"]
    assert not (tmp_path / "run").exists()


def test_the_hider_hides(tmp_path: Path) -> None:
    """The hook makes the package absent the way a base install does (else the rows prove nothing)."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDER)
    probe = "import importlib.util as u\ntry:\n    u.find_spec('tensorboard')\nexcept ImportError:\n    print('hidden')"
    env = meshrun_env(tmp_path, PYTHONPATH=str(tmp_path / "hide"), MESHRUN_TEST_HIDE="tensorboard")
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "hidden"


def test_a_sentencepiece_tokenizer_folder_needs_sentencepiece(tmp_path: Path) -> None:
    """A model folder whose only tokenizer is tokenizer.model is converted with sentencepiece
    (not an extra of meshrun's: its own pip command) when the job prepares data with it."""
    tokenizer = tmp_path / "spm"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.model").write_bytes(b"\x0a\x05hello")
    (tmp_path / "corpus.txt").write_text("some text " * 100)
    argv = ["train", "--dry-run", f"--set=data.dir={tmp_path / 'data'}", f"--set=data.sources=[{tmp_path}/corpus.txt]"]
    done = _meshrun_without(
        "sentencepiece,torch",
        [*argv, f"--set=data.tokenizer={tokenizer}", f"--set=run_dir={tmp_path / 'run'}"],
        tmp_path,
    )
    assert done.returncode == 2, done.stderr
    expect = f"data.tokenizer {tokenizer} (tokenizer.model) needs the sentencepiece package, which is not installed"
    assert done.stderr.splitlines() == [f"meshrun: error: {expect}: pip install sentencepiece"]


def test_a_users_extras_are_what_meshrun_names_and_dev_holds_the_rest() -> None:
    """The extras meshrun's messages name exist and hold only what a run needs; the tools of the
    tests, lint and types live in `dev` (with both user extras and `docs`: the tests use them), so a user's
    install (`pip install -e .` or `.[hf]`) is not the 2 GB developer's one."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRA_OF.values()) | {"dev", "docs"} == set(extras)
    for extra in EXTRA_OF.values():
        assert [re.split(r"[<>=\[]", d)[0] for d in extras[extra]] == [p for p, e in EXTRA_OF.items() if e == extra]
    assert "meshrun[hf,lora,tensorboard,docs]" in extras["dev"]
    assert {"pytest", "ruff", "pyright[nodejs]"} <= {re.split(r"[<>=]", d)[0] for d in extras["dev"]}
