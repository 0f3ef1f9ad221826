"""nanoGPT and Megatron-LM token files, written here from their documented layouts (not by
meshrun), train exactly like the same tokens in meshrun's shards; broken files, a vocabulary
larger than the model's and bad mixtures are refused before any worker starts."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WORDS, losses, meshrun_env, tiny
from tokenizers import Tokenizer

from meshrun import cli
from meshrun.cli import train as job
from meshrun.cli.use_checkpoint import load_full_model
from meshrun.data.pairs import prepare_pairs
from meshrun.data.prepare import prepare
from meshrun.launcher import torchrun as torchrun_launch

VOCAB = 300


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated text prepared with a BPE of 300 tokens trained on it (uint16 shards)."""
    rng, corpus = random.Random(1), tmp_path_factory.mktemp("bpe-corpus")
    for i in range(16):
        (corpus / f"doc{i:02d}.txt").write_text(
            "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(40))
        )
    out = tmp_path_factory.mktemp("bpe") / "ds"
    prepare([str(corpus)], out, train_tokenizer=f"bpe:{VOCAB}", val_fraction=0.2, workers=1, progress=False)
    return out


def raw_split(folder: Path, split: str) -> np.ndarray:
    """A split's tokens read straight from the shard files meta.json lists."""
    meta = json.loads((folder / "meta.json").read_text())
    shards = meta["splits"][split]["shards"]
    return np.concatenate([np.fromfile(folder / s["file"], dtype=meta["dtype"]) for s in shards])


def write_nanogpt(folder: Path, train: np.ndarray, val: np.ndarray, dtype: type = np.uint16) -> Path:
    """nanoGPT's prepare.py: `np.array(ids, dtype=np.uint16).tofile('train.bin')` (forks for large
    vocabularies: uint32)."""
    folder.mkdir()
    np.array(train, dtype=dtype).tofile(folder / "train.bin")
    np.array(val, dtype=dtype).tofile(folder / "val.bin")
    return folder


def write_megatron(prefix: Path, documents: list[np.ndarray], **damage: list[int]) -> Path:
    """Megatron-LM's MMIDIDX layout (indexed_dataset.py): header, version <Q 1, dtype code <B
    (8 = uint16), <Q sequence count, <Q document count, int32 lengths, int64 byte pointers,
    int64 document indices (0, then the sequence count after each document). `damage` replaces
    the index's `lengths`, `pointers` or `doc_index` with other values."""
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 2]).astype(np.int64)
    doc_index = np.arange(len(documents) + 1, dtype=np.int64)
    lengths, pointers, doc_index = (
        np.array(damage.get(name, values), dtype=values.dtype)
        for name, values in (("lengths", lengths), ("pointers", pointers), ("doc_index", doc_index))
    )
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_index.tobytes())
    np.concatenate(documents).astype(np.uint16).tofile(prefix.with_suffix(".bin"))
    return prefix


def chunks(tokens: np.ndarray, size: int) -> list[np.ndarray]:
    return [tokens[i : i + size] for i in range(0, len(tokens), size)]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in meshrun_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    """A worker starting fails the test at once: every refusal here comes before spawning."""

    def tripwire(*args: object, **kwargs: object) -> int:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(job, "run_worker", tripwire)
    monkeypatch.setattr(torchrun_launch.subprocess, "Popen", tripwire)


def first_loss(data: Path, run: Path, **overrides: object) -> float:
    """One training step of `meshrun train` (one process: in this one, which is quick)."""
    args = tiny(data, run, **{"train.steps": 1, "model.vocab_size": VOCAB, "model.num_layers": 2, **overrides})
    assert cli.main(["train", *args]) == 0
    return losses(run)[0]


def test_nanogpt_and_megatron_files_train_like_meshrun_shards(bpe_data: Path, tmp_path: Path, clean_env: None) -> None:
    train, val = raw_split(bpe_data, "train"), raw_split(bpe_data, "val")
    assert train.max() >= 256  # really uint16 data
    nanogpt = write_nanogpt(tmp_path / "nanogpt", train, val)
    train_docs, val_docs = chunks(train, 97), chunks(val, 97)
    megatron = write_megatron(tmp_path / "corpus_text_document", train_docs + val_docs)
    share = len(val_docs) / (len(train_docs) + len(val_docs))  # Megatron validates on its last documents
    reference = first_loss(bpe_data, tmp_path / "meshrun")
    assert first_loss(nanogpt, tmp_path / "nano", **{"data.format": "nanogpt"}) == reference
    wide = write_nanogpt(tmp_path / "nanogpt32", train, val, np.uint32)
    assert first_loss(wide, tmp_path / "nano32", **{"data.format": "nanogpt-uint32"}) == reference
    assert (
        first_loss(megatron, tmp_path / "mega", **{"data.format": "megatron", "data.val_fraction": share}) == reference
    )
    shifted = write_nanogpt(tmp_path / "shifted", train[1:], val)  # other tokens: another loss
    assert first_loss(shifted, tmp_path / "other", **{"data.format": "nanogpt"}) != reference


def _damaged_shard(bpe_data: Path, tmp: Path) -> Path:
    copy = tmp / "damaged"
    copy.mkdir()
    for path in bpe_data.iterdir():
        (copy / path.name).write_bytes(path.read_bytes()[:-2] if path.name == "train-00000.bin" else path.read_bytes())
    return copy


def _nanogpt_files(tmp: Path, train: bytes, val: bytes | None) -> Path:
    folder = tmp / "nano"
    folder.mkdir()
    (folder / "train.bin").write_bytes(train)
    if val is not None:
        (folder / "val.bin").write_bytes(val)
    return folder


def _megatron_bad(tmp: Path, idx: bytes) -> Path:
    (tmp / "m.bin").write_bytes(b"\0" * 64)
    (tmp / "m.idx").write_bytes(idx)
    return tmp / "m"


def _copy(folder: Path, tmp: Path, edit_meta=lambda meta: None) -> Path:
    """A copy of a prepared dataset in tmp/inside/, its meta.json changed by `edit_meta`."""
    copy = tmp / "inside" / folder.name
    shutil.copytree(folder, copy)
    meta = json.loads((copy / "meta.json").read_text())
    edit_meta(meta)
    (copy / "meta.json").write_text(json.dumps(meta))
    return copy


def _naming_passwd(folder: Path, tmp: Path) -> Path:
    """The issue's dataset: a meta.json whose first shard is ../../../../etc/passwd (its size in tokens)."""

    def edit(meta: dict) -> None:
        up = "../" * (len((tmp / "inside" / folder.name).resolve().parts) - 1)
        shard = meta["splits"]["train"]["shards"][0]
        shard.update(file=f"{up}etc/passwd", tokens=Path("/etc/passwd").stat().st_size)
        shard.pop("max_id", None)

    return _copy(folder, tmp, edit)


def _linked_out(folder: Path, tmp: Path, name: str) -> Path:
    """A copy whose file `name` is a link to the same bytes outside the folder."""
    copy = _copy(folder, tmp)
    (copy / name).rename(tmp / name)
    (copy / name).symlink_to(tmp / name)
    return copy


MEGATRON_DOCS = [np.arange(200) % 256, np.arange(50)]
GOOD_HEADER = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 4, 5)
NANOGPT, MEGATRON = {"data.format": "nanogpt"}, {"data.format": "megatron"}
REFUSALS = {  # name: (overrides from (byte data, bpe data, tmp), fragments of the one error line)
    "vocab-larger-than-model": (
        lambda d, b, t: {"data.dir": b},
        ("vocabulary of 300 tokens", "model.vocab_size", "at least 300"),
    ),
    "nanogpt-odd-bytes": (
        lambda d, b, t: {**NANOGPT, "data.dir": _nanogpt_files(t, b"\0" * 99, b"\0" * 100)},
        ("train.bin is 99 bytes, not a whole number of uint16 tokens", "data.format"),
    ),
    "nanogpt-missing-val": (
        lambda d, b, t: {**NANOGPT, "data.dir": _nanogpt_files(t, b"\0" * 100, None)},
        ("has no val.bin", "nanoGPT data folder"),
    ),
    "nanogpt-id-beyond-the-model": (  # GPT-2-tokenized files for a 256-token model: the last id is 50256
        lambda d, b, t: {
            **NANOGPT,
            "data.dir": write_nanogpt(t / "nano", np.r_[np.arange(300) % 256, 50256], np.arange(100)),
        },
        ("train.bin holds token id 50256 but the model has 256 tokens", "model.vocab_size", "at least 50257"),
    ),
    "nanogpt-uint32-read-as-uint16": (
        lambda d, b, t: {
            **NANOGPT,
            "data.dir": write_nanogpt(t / "n32", np.arange(300) % 256, np.arange(100), np.uint32),
        },
        ("train.bin looks like uint32 token ids", "set data.format=nanogpt-uint32"),
    ),
    "megatron-id-beyond-the-model": (
        lambda d, b, t: {
            **MEGATRON,
            "data.dir": write_megatron(t / "m", [np.arange(200) % 256, np.r_[np.arange(50), 40000]]),
        },
        ("holds token id 40000 but the model has 256 tokens", "at least 40001"),
    ),
    "megatron-no-header": (
        lambda d, b, t: {**MEGATRON, "data.dir": _megatron_bad(t, b"GARBAGE" * 8)},
        ("m.idx is not a Megatron index (no MMIDIDX header)",),
    ),
    "megatron-truncated-index": (
        lambda d, b, t: {**MEGATRON, "data.dir": _megatron_bad(t, GOOD_HEADER + b"\0" * 8)},
        ("m.idx does not parse as a Megatron index", "4 sequences"),
    ),
    "megatron-missing-files": (
        lambda d, b, t: {**MEGATRON, "data.dir": t / "nothing"},
        ("no nothing.bin", "Megatron PREFIX"),
    ),
    "shard-damaged": (
        lambda d, b, t: {"data.dir": _damaged_shard(b, t), "model.vocab_size": VOCAB},
        ("train-00000.bin is", "meta.json says", "prepare it again"),
    ),
    "shard-named-outside-the-folder": (
        lambda d, b, t: {"data.dir": _naming_passwd(d, t)},
        ("meta.json: entry '../", "etc/passwd' ", "outside", "(to /etc/passwd)"),
    ),
    "shard-linked-outside-the-folder": (
        lambda d, b, t: {"data.dir": _linked_out(d, t, "train-00000.bin")},
        ("meta.json: entry 'train-00000.bin'", "outside"),
    ),
    "tokenizer-linked-outside-the-folder": (
        lambda d, b, t: {"data.dir": _linked_out(b, t, "tokenizer.json"), "model.vocab_size": VOCAB},
        ("meta.json: entry 'tokenizer.json'", "outside"),
    ),
    "mixture-source-naming-outside": (
        lambda d, b, t: {
            "data.dir": None,
            "data.mixture": f"[{{dir: {d}, weight: 1}}, {{dir: {_naming_passwd(d, t)}, weight: 1}}]",
        },
        ("etc/passwd'", "outside"),
    ),
    "pairs-file-linked-outside": (
        lambda d, b, t: {"data.dir": _linked_out(_pairs(t), t, "train.source.bin"), "model.vocab_size": VOCAB},
        ("meta.json: entry 'train.source.bin'", "outside"),
    ),
    "megatron-document-index-out-of-range": (
        lambda d, b, t: {**MEGATRON, "data.dir": write_megatron(t / "m", MEGATRON_DOCS, doc_index=[0, 1, 7])},
        ("m.idx: document index out of range",),
    ),
    "megatron-length-out-of-range": (
        lambda d, b, t: {**MEGATRON, "data.dir": write_megatron(t / "m", MEGATRON_DOCS, lengths=[200, -50])},
        ("m.idx: sequence lengths out of range (sequence 1 has length -50)",),
    ),
    "megatron-pointer-beyond-the-bin": (
        lambda d, b, t: {**MEGATRON, "data.dir": write_megatron(t / "m", MEGATRON_DOCS, pointers=[0, 4000])},
        ("m.idx: sequence pointers out of range (sequence 1 starts at byte 4000",),
    ),
    "megatron-bin-longer-than-its-index": (
        lambda d, b, t: {**MEGATRON, "data.dir": _grown(write_megatron(t / "m", MEGATRON_DOCS))},
        ("m.bin is 504 bytes but m.idx says 250 uint16 tokens", "the pair does not match"),
    ),
    "mixture-weight-zero": (
        lambda d, b, t: {"data.dir": None, "data.mixture": f"[{{dir: {d}, weight: 0}}]"},
        ("invalid data.mixture[0].weight", "greater than 0"),
    ),
    "mixture-and-dir": (
        lambda d, b, t: {"data.mixture": f"[{{dir: {d}, weight: 1}}]"},
        ("set data.dir or data.mixture, not both",),
    ),
    "mixture-different-tokenizers": (
        lambda d, b, t: {
            "data.dir": None,
            "model.vocab_size": VOCAB,
            "data.mixture": f"[{{dir: {d}, weight: 1}}, {{dir: {b}, weight: 1}}]",
        },
        ("data.mixture sources were tokenized differently", "bpe:300", "byte"),
    ),
    "mixture-of-pairs": (
        lambda d, b, t: {
            "data.dir": None,
            "data.mixture": f"[{{dir: {d}, weight: 1}}, {{dir: {_pairs(t)}, weight: 1}}]",
        },
        ("holds source/target pairs", "not as a data.mixture source", "without --pairs"),
    ),
}


def _pairs(tmp: Path) -> Path:
    prepare_pairs([(f"a{i}", f"b{i}") for i in range(8)], tmp / "pairs", val_fraction=0.25)
    return tmp / "pairs"


def _grown(prefix: Path) -> Path:
    with open(prefix.with_suffix(".bin"), "ab") as f:
        f.write(b"\0\0\0\0")
    return prefix


@pytest.mark.parametrize("name", list(REFUSALS))
def test_bad_data_is_refused_before_spawning(
    name: str, data_dir: Path, bpe_data: Path, tmp_path: Path, no_workers: None, capsys: pytest.CaptureFixture[str]
) -> None:
    make, fragments = REFUSALS[name]
    assert_refused(make(data_dir, bpe_data, tmp_path), fragments, data_dir, tmp_path, capsys)


def assert_refused(
    overrides: dict, fragments: tuple[str, ...], data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meshrun train` with these overrides exits 2 with one line holding every fragment, and writes no run."""
    args = [a for a in tiny(data_dir, tmp_path / "run", **overrides) if not a.endswith("=None")]
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("meshrun: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "run").exists()


def greedy(run: Path, tokenizer_file: Path, prompt: str, steps: int) -> str:
    """Greedy sampling written here: the model's first VOCAB logits (the tokenizer's ids), the
    last prompt token chosen again among the tokens that start with its text (token healing)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    model = load_full_model(run)[0]
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    tail, ids = tokenizer.decode(ids[-1:]), ids[:-1]
    healing = torch.tensor([not tokenizer.decode([i]).startswith(tail) for i in range(VOCAB)])
    with torch.no_grad():
        for step in range(steps):
            logits = model(torch.tensor([ids[-16:]]))[0, -1, :VOCAB]
            ids.append(int(logits.masked_fill(healing, float("-inf")).argmax() if step == 0 else logits.argmax()))
    return tokenizer.decode(ids)


def test_sample_decodes_with_the_datasets_tokenizer(
    bpe_data: Path, tmp_path: Path, clean_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meshrun sample` on a BPE-trained model: the prompt encoded and the continuation decoded
    with the tokenizer.json beside the data (checked against a greedy loop written here), and
    still once the data folder is gone (the checkpoint keeps a copy: it decoded bytes, silently)."""
    run, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(bpe_data, data)
    first_loss(data, run, **{"train.steps": 2})
    shutil.rmtree(data)
    capsys.readouterr()
    assert cli.main(["sample", str(run), "--prompt", "the model", "--tokens", "12", "--temperature", "0"]) == 0
    printed, warned = capsys.readouterr()
    printed = printed.rstrip("\n")
    assert "warning" not in warned
    assert printed == greedy(run, bpe_data / "tokenizer.json", "the model", 12) and printed.startswith("the model")
    assert cli.main(["sample", str(run), "--prompt", "the", "--beam", "3"]) == 2  # beams are the encoder-decoder's
    assert "--beam is for encoder-decoder models" in capsys.readouterr().err
    same = ["sample", str(run), "--prompt", "the model", "--tokens", "12", "--temperature", "0"]
    assert cli.main([*same, "--tokenizer", str(bpe_data / "tokenizer.json")]) == 0  # the very same tokenizer
    assert capsys.readouterr().out.rstrip("\n") == printed
    other = Tokenizer.from_file(str(bpe_data / "tokenizer.json"))
    other.add_tokens(["zebra"])
    other.save(str(tmp_path / "other.json"))
    assert cli.main([*same, "--tokenizer", str(tmp_path / "other.json")]) == 2
    assert "trained on data tokenized with bpe:300, and --tokenizer" in capsys.readouterr().err


def test_sample_decodes_data_read_in_place_with_the_named_tokenizer(
    bpe_data: Path, tmp_path: Path, clean_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """nanoGPT files carry no tokenizer: `sample` warns and decodes bytes, and `--tokenizer`
    decodes them right, drawing only the tokenizer's ids from a model padded past them."""
    nanogpt = write_nanogpt(tmp_path / "nanogpt", raw_split(bpe_data, "train"), raw_split(bpe_data, "val"))
    run = tmp_path / "run"
    first_loss(nanogpt, run, **{"train.steps": 2, "data.format": "nanogpt", "model.vocab_size": VOCAB + 20})
    capsys.readouterr()
    command = ["sample", str(run), "--prompt", "the model", "--tokens", "12", "--temperature", "0"]
    assert cli.main(command) == 0
    assert "decoding the 256 byte ids" in capsys.readouterr().err
    assert cli.main([*command, "--tokenizer", str(bpe_data / "tokenizer.json")]) == 0
    printed, warned = capsys.readouterr()
    assert not warned and printed.rstrip("\n") == greedy(run, bpe_data / "tokenizer.json", "the model", 12)
    assert cli.main([*command, "--tokenizer", str(tmp_path / "missing.json")]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_a_run_is_not_continued_on_data_of_another_tokenizer(
    bpe_data: Path, data_dir: Path, tmp_path: Path, clean_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run trained on BPE ids, resumed on byte data with the same model settings: refused (its
    ids would mean other words), and nothing in the run directory changes."""
    run = tmp_path / "run"
    first_loss(bpe_data, run, **{"train.steps": 1})
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir())
    capsys.readouterr()
    args = tiny(data_dir, run, **{"model.vocab_size": VOCAB, "model.num_layers": 2, "train.steps": 2})
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "trained on data tokenized with bpe:300, but this data was tokenized with byte" in err, err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir()) == before
