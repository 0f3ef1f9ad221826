"""`meshrun sample` on a Hugging Face model with a tokenizer: decoded with the training data's
tokenizer while the data folder exists, and with the model folder's own tokenizer without it."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import meshrun_in_process, tiny, train_job
from hf_models import bpe_json
from tokenizers import Tokenizer

from meshrun.data.prepare import prepare


def test_sample_decodes_with_the_data_or_the_model_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoConfig, PreTrainedTokenizerFast

    texts = [f"def f{i}(self, x):\n    return x * {i}\n" for i in range(200)]
    model_dir = tmp_path / "model"
    AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320
    ).save_pretrained(model_dir)  # config only: random init
    tokenizer = Tokenizer.from_str(bpe_json(texts, 300))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(model_dir)
    (tmp_path / "corpus").mkdir()
    for i in range(8):
        (tmp_path / "corpus" / f"doc{i}.py").write_text("".join(texts[i * 25 : (i + 1) * 25]))
    data = tmp_path / "data"
    prepare([str(tmp_path / "corpus")], data, tokenizer=str(model_dir), val_fraction=0.25, workers=1, progress=False)
    run = tmp_path / "run"
    train_job(tiny(data, run, **{"model.hf": model_dir, "train.steps": 2}), tmp_path=tmp_path)
    greedy = ["sample", str(run), "--prompt", "def f1(self", "--tokens", "12", "--temperature", "0"]
    with_data = meshrun_in_process(greedy, tmp_path=tmp_path).stdout.rstrip("\n")
    shutil.rmtree(data)  # no data folder: the model folder's tokenizer decodes
    with_model = meshrun_in_process(greedy, tmp_path=tmp_path).stdout.rstrip("\n")
    assert with_data.startswith("def f1(self") and len(with_data) > len("def f1(self")
    assert with_model == with_data  # the same tokenizer, reached two ways, decodes the same greedy ids


def test_export_hf_carries_the_data_tokenizer(tmp_path: Path) -> None:
    """A config-only model folder (no tokenizer) trained on BPE data: `export --hf` writes the data's
    tokenizer, so AutoTokenizer in the exported folder encodes as the data was encoded."""
    from transformers import AutoConfig, AutoTokenizer

    texts = [f"def f{i}(self, x):\n    return x * {i}\n" for i in range(200)]
    model_dir, tokenizer_json = tmp_path / "model", tmp_path / "bpe.json"
    AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320
    ).save_pretrained(model_dir)
    tokenizer_json.write_text(bpe_json(texts, 300))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "doc.py").write_text("".join(texts))
    data = tmp_path / "data"
    prepare(
        [str(tmp_path / "corpus")], data, tokenizer=str(tokenizer_json), val_fraction=0.25, workers=1, progress=False
    )
    run, out = tmp_path / "run", tmp_path / "exported"
    train_job(tiny(data, run, **{"model.hf": model_dir, "train.steps": 1}), tmp_path=tmp_path)
    shutil.rmtree(data)  # the checkpoint's own copy of the data's tokenizer is what gets exported
    (tmp_path / "exported.tmp").mkdir()  # the user's own folder, named like a temporary one
    (tmp_path / "exported.tmp" / "notes.txt").write_text("keep me")
    meshrun_in_process(["export", run, "--hf", out], tmp_path=tmp_path)
    assert (tmp_path / "exported.tmp" / "notes.txt").read_text() == "keep me"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".exported")]  # its temporary went
    exported = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert (out / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()  # the data's check accepts it
    text = "def f7(self, y):<|endoftext|>\n    return y * 7\n"
    as_trained = Tokenizer.from_file(str(tokenizer_json))
    as_trained.encode_special_tokens = True  # prepare-data: special-token text in a document is text
    assert exported.encode(text, add_special_tokens=False) == as_trained.encode(text).ids
    assert exported.eos_token == "<|endoftext|>" and exported.model_max_length == 16
