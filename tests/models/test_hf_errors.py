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
            {"model.hf_config": "{model_type: t5, d_model: 32}"},
            "model_type 't5' is not supported; supported: bert, gpt2, llama, mistral, mixtral, olmo2, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe",
        ),
        (
            {"model.hf_config": "{model_type: bert, hidden_size: 32}"},
            "model_type bert is an encoder: meshrun trains it as task classification with model.num_labels",
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
    ids=[
        "missing",
        "hub-id",
        "model-type",
        "encoder-as-lm",
        "stages",
        "no-weights",
        "context",
        "window-mistral",
        "window-phi3",
    ],
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

    from meshrun.config.model_sections import HFSection
    from meshrun.errors import ConfigError
    from meshrun.models.hf_export import load_hf_tokenizer

    model_dir, marker = tmp_path / "model", tmp_path / "code-ran"
    AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4).save_pretrained(model_dir)
    (model_dir / "tokenizer.json").write_text(bpe_json(["def f(x):\n    return x\n"] * 20, 280))
    config = {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ConfigError, match=r"model\.hf .*tokenizer_config\.json .*auto_map"):
        load_hf_tokenizer(HFSection(hf=str(model_dir)))
    assert not marker.exists()


def config_folder(tmp_path: Path, family: str = "llama", **changes: object) -> Path:
    """A model folder holding only config.json: hf_models' tiny config with `changes` written as JSON."""
    from hf_models import CONFIGS

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**CONFIGS[family], **changes}))
    return folder


@pytest.mark.parametrize(
    "family,key,value,message",
    [
        ("llama", "num_hidden_layers", 0, "num_hidden_layers is 0; it must be at least 1"),
        ("llama", "num_hidden_layers", -2, "num_hidden_layers is -2; it must be at least 1"),
        ("llama", "num_hidden_layers", 2.5, "num_hidden_layers is 2.5; it must be a whole number"),
        ("llama", "num_hidden_layers", 1_000_000_000, "num_hidden_layers is 1000000000, more blocks than meshrun"),
        ("llama", "hidden_size", 0, "hidden_size is 0; it must be at least 1"),
        ("llama", "hidden_size", -32, "hidden_size is -32; it must be at least 1"),
        ("llama", "intermediate_size", -5, "intermediate_size is -5; it must be at least 1"),
        ("llama", "num_attention_heads", 0, "num_attention_heads is 0; it must be at least 1"),
        ("llama", "num_key_value_heads", -1, "num_key_value_heads is -1; it must be at least 1"),
        ("llama", "max_position_embeddings", -1, "max_position_embeddings is -1; it must be at least 1"),
        ("llama", "num_key_value_heads", 3, "num_key_value_heads (3) must divide num_attention_heads (4)"),
        ("llama", "vocab_size", 1e11, "vocab_size is 100000000000.0; it must be a whole number"),
        ("llama", "vocab_size", True, "vocab_size is true; it must be a whole number"),
        ("llama", "vocab_size", 100_000_000_000, "would need ~"),
        ("gpt2", "n_layer", 0, "n_layer is 0; it must be at least 1"),
        ("gpt2", "n_embd", 10**9, "more than any device could hold (4 TiB)"),
    ],
    ids=lambda v: str(v)[:12],
)
def test_bad_sizes_in_config_json_are_one_line_in_the_models_terms(
    family: str, key: str, value: object, message: str, data_dir: Path, tmp_path: Path, capsys
) -> None:
    """Sized by arithmetic before anything is built: a zero, negative, fractional, boolean or
    absurd size is named as config.json names it (never as `model.name gpt`), at once."""
    folder = config_folder(tmp_path, family, **{key: value})
    err = error_of(dry_run(data_dir, tmp_path, **{"model.hf": folder}), capsys)
    assert f"model.hf {folder}: " in err and message in err and "model.name" not in err, err
    assert not (tmp_path / "run").exists()


def test_bad_inline_size_names_the_inline_config(data_dir: Path, tmp_path: Path, capsys) -> None:
    bad = LLAMA.replace("num_hidden_layers: 2", "num_hidden_layers: 0")
    err = error_of(dry_run(data_dir, tmp_path, **{"model.hf_config": bad}), capsys)
    assert "model.hf_config: num_hidden_layers is 0; it must be at least 1" in err


def test_index_entries_outside_the_model_folder_are_refused(gpt2_dir: Path, data_dir: Path, tmp_path: Path, capsys):
    """A sharded checkpoint's index naming ../../../../etc/passwd (or an absolute path) is never opened."""
    for entry in ("../../../../etc/passwd", "/etc/passwd"):
        edited = shutil.copytree(gpt2_dir, tmp_path / f"edited{len(entry)}")
        index = edited / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": {"transformer.wte.weight": entry}}))
        err = error_of(dry_run(data_dir, tmp_path, **{"model.hf": edited}), capsys)
        assert f"{index}: entry {entry!r} leads outside {edited}" in err


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.json", "config.json", "model.safetensors"])
def test_model_files_linked_outside_the_folder_are_refused(name: str, data_dir: Path, tmp_path: Path, capsys):
    """A link out of the model folder: its file would be read (or copied by export --hf) from elsewhere."""
    folder = config_folder(tmp_path)
    outside = tmp_path / "outside"
    outside.write_text((folder / "config.json").read_text())  # readable, and a valid config: only the link is wrong
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(outside)
    err = error_of(dry_run(data_dir, tmp_path, **{"model.hf": folder}), capsys)
    assert f"{folder}: entry {name!r} leads outside {folder} (to {outside})" in err


def test_tokenizer_config_naming_a_file_outside_is_refused(data_dir: Path, tmp_path: Path, capsys) -> None:
    folder = config_folder(tmp_path)
    entry = "../outside/tokenizer.4.0.json"  # transformers opens the newest listed file its version allows
    (folder / "tokenizer_config.json").write_text(json.dumps({"fast_tokenizer_files": [entry]}))
    err = error_of(dry_run(data_dir, tmp_path, **{"model.hf": folder}), capsys)
    assert f"{folder / 'tokenizer_config.json'}: entry {entry!r} leads outside" in err


def test_a_hub_cache_snapshot_is_read_through_its_links(gpt2_dir: Path, data_dir: Path, tmp_path: Path, capsys):
    """huggingface_hub's cache: snapshots/REV/FILE are links into the repo's blobs/ (outside the
    snapshot folder, inside the repo's): accepted, weights and all."""
    repo = tmp_path / "hub" / "models--org--gpt2"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(gpt2_dir.iterdir())):
        shutil.copy(file, repo / "blobs" / f"blob{i}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{i}")
    assert main(dry_run(data_dir, tmp_path, **{"model.hf": snapshot})) == 0, capsys.readouterr().err


def test_export_never_copies_a_data_tokenizer_linked_outside(tmp_path: Path) -> None:
    """export --hf copies the data card's tokenizer.json: a link out of that folder is refused."""
    from meshrun.errors import ConfigError
    from meshrun.models.hf_export import save_data_tokenizer

    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    (tmp_path / "secret.json").write_text("{}")
    (data / "tokenizer.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(ConfigError, match=r"entry 'tokenizer\.json' leads outside"):
        save_data_tokenizer(data, out, max_length=16)
    assert not (out / "tokenizer.json").exists()


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "tokenizer_config.json"])
def test_a_huge_json_file_in_a_model_folder_is_refused_unread(name: str, data_dir: Path, tmp_path: Path, capsys):
    folder = config_folder(tmp_path)
    with (folder / name).open("wb") as f:
        f.truncate(65 * 2**20)  # sparse: 65 MiB of zeros that take no disk, and would be parsed as JSON
    err = error_of(dry_run(data_dir, tmp_path, **{"model.hf": folder}), capsys)
    assert f"{folder / name} is over 64 MiB" in err


def test_dry_run_shows_the_hf_models_own_shape_and_weights(
    gpt2_dir: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--dry-run printed the built-in GPT's defaults (name: gpt, dim 128) for a Hugging Face model:
    now its own shape, its parameter count and where its weights come from."""
    from transformers import AutoModelForCausalLM

    assert main(dry_run(data_dir, tmp_path, **{"model.hf": gpt2_dir, "model.seq_len": 16})) == 0
    out = capsys.readouterr().out
    reference = AutoModelForCausalLM.from_pretrained(gpt2_dir)
    config = reference.config
    shape = f"{config.n_layer} blocks, dim {config.n_embd}, {config.n_head} heads, vocab {config.vocab_size}"
    assert f"gpt2 from {gpt2_dir}: {shape}, seq_len 16" in out
    assert f"{sum(p.numel() for p in reference.parameters()):,} parameters; weights loaded from {gpt2_dir} (" in out
    model_section = out.split("\nmodel:\n", 1)[1].split("\n\n", 1)[0].split("\ndata:", 1)[0]
    assert "name: gpt" not in model_section and "dim: 128" not in model_section
    assert main(dry_run(data_dir, tmp_path, **{"model.hf_config": LLAMA, "train.seed": 5})) == 0
    out = capsys.readouterr().out
    assert "llama from model.hf_config: 2 blocks, dim 32, 4 heads, vocab 256" in out and "random init (seed 5)" in out
