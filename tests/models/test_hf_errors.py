"""Bad Hugging Face inputs: one line, exit 2, before any worker exists (the CLI's main, in process)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import tiny
from hf_models import bpe_json, make_model

from meshrun.cli import main

LLAMA = "{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, vocab_size: 256}"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("gpt2", tmp_path_factory.mktemp("hf") / "gpt2")


def error_of(args: list[str], capsys: pytest.CaptureFixture) -> str:
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    return err


def dry_run(data_dir: Path, tmp_path: Path, **model: object) -> list[str]:
    return ["train", "--dry-run", *tiny(data_dir, tmp_path / "run", **model)]


@pytest.mark.parametrize(
    "model,message",
    [
        ({"model.hf": "/nonexistent/model"}, "model.hf /nonexistent/model is not a directory"),
        ({"model.hf": "meta-llama/Llama-3.2-1B"}, "meshrun downloads nothing"),
        (
            {"model.hf_config": "{model_type: bert, hidden_size: 32}"},
            "model_type 'bert' is not supported; supported: gpt2, llama, mistral, olmo2, phi3, qwen2, qwen3",
        ),
        (
            {"model.hf_config": LLAMA, "parallel.pp": 4, "train.global_batch": 8},
            "need at least as many blocks, but the Hugging Face config's num_hidden_layers is 2",
        ),
        (
            {"model.hf_config": LLAMA, "model.init": "pretrained"},
            "model.init is pretrained but model.hf_config has no weights",
        ),
        (
            {"model.hf_config": LLAMA.replace("}", ", max_position_embeddings: 8}")},
            "exceeds the model's max_position_embeddings",
        ),
        (
            {"model.hf_config": LLAMA.replace("llama", "mistral").replace("}", ", sliding_window: 8}")},
            "model.seq_len 16 exceeds the model's sliding_window (8)",
        ),
        (
            {
                "model.hf_config": LLAMA.replace("llama", "phi3").replace(
                    "}", ", sliding_window: 8, pad_token_id: 0, bos_token_id: 1, eos_token_id: 2}"
                )
            },
            "model.seq_len 16 exceeds the model's sliding_window (8)",
        ),
    ],
    ids=["missing", "hub-id", "model-type", "stages", "no-weights", "context", "window-mistral", "window-phi3"],
)
def test_bad_model_is_one_line(model: dict, message: str, data_dir: Path, tmp_path: Path, capsys) -> None:
    assert message in error_of(dry_run(data_dir, tmp_path, **model), capsys)
    assert not (tmp_path / "run").exists()


def test_weights_that_disagree_with_config(gpt2_dir: Path, data_dir: Path, tmp_path: Path, capsys) -> None:
    edited = shutil.copytree(gpt2_dir, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    err = error_of(dry_run(data_dir, tmp_path, **{"model.hf": edited}), capsys)
    assert "transformer.wte.weight in model.safetensors has shape [256, 32], but config.json makes it [256, 64]" in err


def test_vocab_smaller_than_byte_data(data_dir: Path, tmp_path: Path, capsys) -> None:
    small = LLAMA.replace("vocab_size: 256", "vocab_size: 128")
    err = error_of(["train", *tiny(data_dir, tmp_path / "run", **{"model.hf_config": small})], capsys)
    assert "vocabulary of 256 tokens but the model has 128 (vocab_size in model.hf_config)" in err


@pytest.mark.parametrize("form", ["tokenizer.json", "vocab.json"])
def test_data_tokenized_with_another_tokenizer_than_the_models(
    form: str, data_dir: Path, tmp_path: Path, capsys
) -> None:
    """A model folder with its tokenizer (a tokenizer.json, or GPT-2 style vocab.json + merges.txt)
    and data prepared with a different tokenizer: refused; the same data prepared with the model's
    own tokenizer (or byte-level data) is accepted."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig

    from meshrun.data.prepare import prepare

    texts = [f"def f{i}(self, x):\n    return x * {i}\n" for i in range(200)]
    model_dir = tmp_path / "model"
    AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512
    ).save_pretrained(model_dir)  # config only: random init
    if form == "tokenizer.json":
        (model_dir / form).write_text(bpe_json(texts, 300))
    else:  # read through transformers' GPT2TokenizerFast, as prepare-data reads such a folder
        Tokenizer.from_str(bpe_json(texts, 300)).model.save(str(model_dir))
        config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "corpus").mkdir()
    for i in range(8):
        (tmp_path / "corpus" / f"doc{i}.py").write_text("".join(texts[i * 25 : (i + 1) * 25]))
    other = tmp_path / "other.json"
    other.write_text(bpe_json(texts[::-1] + ["class C:\n    pass\n"] * 50, 290))
    for name, tokenizer in (("theirs", other), ("ours", model_dir)):
        prepare(
            [str(tmp_path / "corpus")],
            tmp_path / name,
            tokenizer=str(tokenizer),
            val_fraction=0.25,
            workers=1,
            progress=False,
        )
    args = lambda data: dry_run(data, tmp_path, **{"model.hf": model_dir, "data.dir": data})  # noqa: E731
    err = error_of(args(tmp_path / "theirs"), capsys)
    assert f"the data was tokenized with {other}, not with the model's {model_dir / form}" in err
    for accepted in (tmp_path / "ours", data_dir):
        assert main(args(accepted)) == 0, capsys.readouterr().err
        capsys.readouterr()
    # with weights in the folder the model reads ids as its tokenizer's: byte and pairs ids are refused
    from transformers import AutoModelForCausalLM

    from meshrun.data.pairs import prepare_pairs

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(model_dir)
    pairs = tmp_path / "pairs"
    prepare_pairs([(t, t.upper()) for t in texts], pairs, val_fraction=0.25, tokenizer=str(model_dir))
    capsys.readouterr()  # transformers' progress bar
    assert "holds byte ids, not the tokens of the pretrained model's" in error_of(args(data_dir), capsys)
    assert "holds pairs data, whose ids (the tokenizer's + 3" in error_of(args(pairs), capsys)
    assert main(args(tmp_path / "ours")) == 0, capsys.readouterr().err
    assert main([*args(data_dir), "--set=model.init=random"]) == 0, capsys.readouterr().err


def test_a_model_tokenizer_mapped_to_the_folders_code_is_refused(tmp_path: Path) -> None:
    """sample decodes with model.hf's tokenizer: a tokenizer_config.json auto_map never imports the folder's code."""
    from transformers import AutoConfig

    from meshrun.config import ModelConfig
    from meshrun.errors import ConfigError
    from meshrun.models.hf_export import load_tokenizer

    model_dir, marker = tmp_path / "model", tmp_path / "code-ran"
    AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4).save_pretrained(model_dir)
    (model_dir / "tokenizer.json").write_text(bpe_json(["def f(x):\n    return x\n"] * 20, 280))
    config = {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ConfigError, match=r"model\.hf .*tokenizer_config\.json .*auto_map"):
        load_tokenizer(ModelConfig(hf=str(model_dir)))
    assert not marker.exists()
