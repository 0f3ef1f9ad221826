"""prepare-data inputs and tokenizers, checked token for token against `tokenizers` itself;
refused inputs; an interrupted preparation rerun to the same files."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import WORDS, finish_meshrun, kill_tree, meshrun_env, start_meshrun
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshrun import cli
from meshrun.data.prepare import prepare
from meshrun.data.sources import expand_glob, expand_sources

EOS = "<|endoftext|>"


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of varied length, some non-ASCII, one with newlines inside."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) for _ in range(count)]
    docs[3] = "héllo wörld ✓ — 日本語 " + docs[3]
    docs[5] = "first line\n\nsecond line\n" + docs[5]
    return docs


DOCS = make_documents(30)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE made with `tokenizers` directly (not by meshrun)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS, "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(make_documents(200, seed=9), trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def write_source(kind: str, folder: Path, docs: list[str], field: str = "text") -> Path:
    """The documents as one input of the given kind."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "text":
        for i, doc in enumerate(docs):
            (folder / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
        return folder
    if kind in ("jsonl", "jsonl.gz"):
        lines = "".join(
            json.dumps({field: doc, "id": i}) + "\n" + ("\n" if i == 2 else "") for i, doc in enumerate(docs)
        )
        path = folder / f"docs.{kind}"
        path.write_bytes(gzip.compress(lines.encode()) if kind.endswith(".gz") else lines.encode())
        return path
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "docs.parquet"
        pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=7)
        return path
    import datasets

    path = folder / "hf"
    datasets.Dataset.from_dict({field: docs, "id": list(range(len(docs)))}).save_to_disk(
        str(path), max_shard_size="2KB"
    )
    return path


def stored_documents(out: Path, split: str) -> list[list[int]]:
    """A split's documents as meta.json, the shards and the document index lay them out."""
    meta = json.loads((out / "meta.json").read_text())
    info = meta["splits"][split]
    tokens = np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in info["shards"]]).tolist()
    starts = np.fromfile(out / info["documents_file"], dtype="<u8").tolist()
    return [tokens[a:b] for a, b in zip(starts, [*starts[1:], len(tokens)])]


def assert_documents_in_order(out: Path, expected: list[list[int]]) -> None:
    """Every expected document is stored whole in exactly one split, each split in input order."""
    train, val = stored_documents(out, "train"), stored_documents(out, "val")
    assert train and val
    t = v = 0
    for doc in expected:
        if t < len(train) and train[t] == doc:
            t += 1
        elif v < len(val) and val[v] == doc:
            v += 1
        else:
            pytest.fail(f"document {t + v} is not stored as the tokenizer encodes it")
    assert (t, v) == (len(train), len(val))


def hf_expected(tokenizer: Tokenizer, docs: list[str], eos: str) -> list[list[int]]:
    return [[*e.ids, tokenizer.token_to_id(eos)] for e in tokenizer.encode_batch(docs, add_special_tokens=False)]


KINDS = ["text", "jsonl", "jsonl.gz", "parquet", "hf"]


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_equal_the_tokenizers_own_encoding(kind: str, tokenizer_file: Path, tmp_path: Path) -> None:
    source = write_source(kind, tmp_path / "src", DOCS, field="body")
    out = tmp_path / "out"
    meta = prepare(
        [str(source)],
        out,
        tokenizer=str(tokenizer_file),
        field="body",
        val_fraction=0.2,
        workers=2 if kind == "hf" else 1,
        shard_tokens=300,
        progress=False,
    )
    assert_documents_in_order(out, hf_expected(Tokenizer.from_file(str(tokenizer_file)), DOCS, EOS))
    assert meta["vocab_size"] == 320 and meta["dtype"] == "uint16" and meta["documents"] == len(DOCS)
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert len(meta["splits"]["train"]["shards"]) > 1  # sharded: each shard ends at a document
    assert all(f["sha256"] and f["bytes"] > 0 for f in meta["files"])


def write_ids(kind: str, folder: Path, rows: list, field: str = "input_ids") -> Path:
    """Token-id rows (lists of ints, or None) as one input of the given kind."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path = folder / "ids.jsonl"
        path.write_text("".join(json.dumps({field: row}) + "\n" for row in rows))
    elif kind.startswith("parquet"):
        path = folder / "ids.parquet"
        width = len(rows[0]) if kind == "parquet-fixed" else -1
        pq.write_table(pa.table({field: pa.array(rows, type=pa.list_(pa.int32(), width))}), path, row_group_size=7)
    else:
        import datasets

        path = folder / "hf"
        datasets.Dataset.from_dict({field: rows}).save_to_disk(str(path), max_shard_size="2KB")
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "parquet-fixed", "hf"])
def test_token_id_columns_are_stored_as_given(kind: str, tokenizer_file: Path, tmp_path: Path) -> None:
    """A pre-tokenized column (`input_ids`): each row stored as it is, with the tokenizer's EOS
    appended unless the row ends with it: the documents tokenizing the same text here gives."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id(EOS)
    expected = hf_expected(tokenizer, DOCS, EOS)
    rows: list = [doc if i % 4 == 0 else doc[:-1] for i, doc in enumerate(expected)]  # some end with EOS already
    if kind == "parquet-fixed":  # packed rows of 16 ids
        flat = [t for doc in expected for t in doc[:-1]]
        rows = [flat[i : i + 16] for i in range(0, len(flat) - 15, 16)]
        expected = [[*row, eos] for row in rows]
    if kind.startswith("parquet"):
        rows.insert(2, None)  # a missing row is no document, as a missing text is none
    out = tmp_path / "out"
    meta = prepare(
        [str(write_ids(kind, tmp_path / "src", rows))],
        out,
        tokenizer=str(tokenizer_file),
        field="input_ids",
        val_fraction=0.2,
        workers=2 if kind == "hf" else 1,
        progress=False,
    )
    assert_documents_in_order(out, expected)
    assert meta["documents"] == len(expected) and meta["vocab_size"] == 320
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "args,rows,fragment",
    [
        (["--tokenizer", "TOK"], [[5, 6, 7], [8, 400]], "holds token id 400, not an id of --tokenizer"),
        (["--tokenizer", "TOK"], [[5, -1, 7]], "holds token id -1, not an id of --tokenizer"),
        ([], [[5, 6, 7]], "'input_ids' holds token ids; pass the --tokenizer"),
        (["--tokenizer", "TOK"], [[5, 2**64]], f"holds token id {2**64}, beyond any vocabulary"),
        (["--train-tokenizer", "bpe:300"], [[5, 6, 7]], "--train-tokenizer trains on text; pass the --tokenizer"),
    ],
)
def test_token_ids_that_cannot_be_the_tokenizers_are_refused(
    args: list[str], rows: list, fragment: str, tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source = write_ids("jsonl", tmp_path / "src", rows * 20)
    args = [str(tokenizer_file) if a == "TOK" else a for a in args]
    command = ["prepare-data", "--source", str(source), "--field", "input_ids", "--out", str(tmp_path / "out")]
    assert cli.main([*command, "--workers", "1", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and fragment in err[0] and str(source) in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no staging folder left


def test_model_folder_tokenizer_uses_its_configured_eos(tokenizer_file: Path, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    model_dir = tmp_path / "model"
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(tokenizer_file)), eos_token="</s>"
    ).save_pretrained(model_dir)
    source = write_source("jsonl", tmp_path / "src", DOCS)
    prepare([str(source)], tmp_path / "out", tokenizer=str(model_dir), val_fraction=0.2, workers=1, progress=False)
    assert_documents_in_order(tmp_path / "out", hf_expected(Tokenizer.from_file(str(tokenizer_file)), DOCS, "</s>"))


def test_a_model_folder_that_maps_its_tokenizer_to_its_own_code_is_refused(tmp_path: Path) -> None:
    """transformers asked "Do you wish to run the custom code? [y/N]": a `yes |` imported the folder's Python."""
    model_dir, marker = tmp_path / "model", tmp_path / "code-ran"
    model_dir.mkdir()
    auto_map = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map, "tokenizer_class": "Evil"}))
    (model_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    source = write_source("text", tmp_path / "src", DOCS[:3])
    args = ["prepare-data", "--source", str(source), "--out", "out", "--tokenizer", str(model_dir)]
    done = subprocess.run(
        [sys.executable, "-m", "meshrun", *args],
        cwd=tmp_path,
        env=meshrun_env(tmp_path),
        input="y\n" * 4,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert not marker.exists(), "the folder's code ran"
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "tokenizer_config.json" in done.stderr and "auto_map" in done.stderr and "[y/N]" not in done.stdout


def test_trained_bpe_is_saved_beside_the_data_and_used(tmp_path: Path) -> None:
    source = write_source("text", tmp_path / "src", DOCS)
    out = tmp_path / "out"
    meta = prepare([str(source)], out, train_tokenizer="bpe:300", val_fraction=0.2, workers=1, progress=False)
    trained = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert (
        trained.get_vocab_size() == meta["vocab_size"] == 300 and json.loads(trained.to_str())["model"]["type"] == "BPE"
    )
    assert_documents_in_order(out, hf_expected(trained, DOCS, EOS))
    assert trained.decode(stored_documents(out, "train")[0][:-1]) in DOCS  # decodes back to a whole document


def test_byte_tokenizer_on_records(tmp_path: Path) -> None:
    source = write_source("parquet", tmp_path / "src", DOCS)
    meta = prepare([str(source)], tmp_path / "out", val_fraction=0.2, workers=1, progress=False)
    assert meta["dtype"] == "uint8" and meta["vocab_size"] == 256
    assert_documents_in_order(tmp_path / "out", [list(d.encode() + b"\n\n") for d in DOCS])


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _int_parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": list(range(100))}), path)
    return path


def _dataset_dict(folder: Path, splits: list[str]) -> Path:
    import datasets

    parts = {name: datasets.Dataset.from_dict({"text": make_documents(40, seed=k)}) for k, name in enumerate(splits)}
    datasets.DatasetDict(parts).save_to_disk(str(folder / "dd"))
    return folder / "dd"


def _dataset_naming(folder: Path, card: str, entry: str) -> Path:
    """A save_to_disk folder whose `card` (state.json / dataset_dict.json) names `entry` instead of its own file."""
    import datasets

    train = datasets.Dataset.from_dict({"text": make_documents(40)})
    (datasets.DatasetDict({"train": train}) if card == "dataset_dict.json" else train).save_to_disk(str(folder / "ds"))
    listed = json.loads((folder / "ds" / card).read_text())
    if card == "state.json":
        listed["_data_files"][0]["filename"] = entry
    else:
        listed["splits"] = [entry]
    (folder / "ds" / card).write_text(json.dumps(listed))
    return folder / "ds"


REFUSED = {  # name: (write the source into folder -> path, fragments of the error)
    "dataset-file-outside-its-folder": (
        lambda f: _dataset_naming(f, "state.json", "../../../../etc/passwd"),
        ("state.json: entry '../../../../etc/passwd'", "outside"),
    ),
    "dataset-split-outside-its-folder": (
        lambda f: _dataset_naming(f, "dataset_dict.json", "../.."),
        ("dataset_dict.json: entry '../..'", "outside"),
    ),
    "no-documents": (lambda f: _write(f / "empty.jsonl", ""), ("holds no documents", "--field")),
    "too-small": (lambda f: _write(f / "a.txt", "hi"), ("only 4 tokens, too few to train", "add more text")),
    "bad-json": (lambda f: _write(f / "b.jsonl", '{"text": "ok"}\n{oops\n'), ("b.jsonl:2 is not valid JSON",)),
    "jsonl-not-utf8": (
        lambda f: (f / "u.jsonl").write_bytes(b'{"text": "ok"}\n' * 5 + b'{"text": "caf\xe9"}\n') and f / "u.jsonl",
        ("u.jsonl:6 is not UTF-8 text (byte 0xe9 at column 14)", "convert the file to UTF-8"),
    ),
    "missing-field": (
        lambda f: _write(f / "c.jsonl", '{"body": "x"}\n'),
        ("c.jsonl:1 has no text field 'text'", "--field NAME"),
    ),
    "missing-column": (
        lambda f: write_source("parquet", f, DOCS, field="body"),
        ("has no column 'text'", "columns: id, body"),
    ),
    "column-not-text": (
        lambda f: _int_parquet(f / "ints.parquet"),
        ("column 'text' holds int64, not text", "--field NAME"),
    ),
    "dataset-dict-without-train": (
        lambda f: _dataset_dict(f, ["validation", "test"]),
        ("DatasetDict without a 'train' split (splits: validation, test)", "split's folder"),
    ),
    "binary-file": (
        lambda f: (f / "shard.bin").write_bytes(bytes(range(256)) * 40) and f / "shard.bin",
        ("--source", "shard.bin is not text (a NUL byte in its first 8 KB)"),
    ),
    "not-gzip": (lambda f: _write(f / "d.jsonl.gz", "plain text"), ("cannot read source", "d.jsonl.gz")),
    "not-parquet": (lambda f: _write(f / "e.parquet", "plain text"), ("cannot read source", "e.parquet")),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_sources_are_refused_in_one_line(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make, fragments = REFUSED[name]
    (tmp_path / "src").mkdir()
    source = make(tmp_path / "src")
    capsys.readouterr()  # what writing the source printed (datasets' progress bars)
    out = tmp_path / "out"
    assert cli.main(["prepare-data", "--source", str(source), "--out", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("meshrun: error: "), err
    for fragment in fragments:
        assert fragment in err[0], err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no staging folder left


def test_a_text_tokenizer_refuses_text_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--train-tokenizer on Latin-1 text stored every non-UTF-8 byte as U+FFFD, silently: refused,
    naming the file and how many bytes; the byte tokenizer keeps every byte, so it still takes it."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(" ".join(WORDS).encode() * 20 + "café déjà vu naïve".encode("latin-1"))
    argv = ["prepare-data", "--source", str(latin1), "--workers", "1"]
    assert cli.main([*argv, "--out", str(tmp_path / "bpe"), "--train-tokenizer", "bpe:300"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"{latin1} is not UTF-8 text: 4 bytes cannot be decoded" in err[0], err
    assert not (tmp_path / "bpe").exists()
    assert cli.main([*argv, "--out", str(tmp_path / "bytes")]) == 0
    docs = stored_documents(tmp_path / "bytes", "train") + stored_documents(tmp_path / "bytes", "val")
    assert "café déjà vu naïve".encode("latin-1") in b"".join(bytes(doc) for doc in docs)


@pytest.mark.timeout(60)
def test_a_glob_through_a_link_loop_reads_each_file_once(tmp_path: Path) -> None:
    """glob's `**` follows links to folders: through a loop it named one file 41 times, read 41
    times, and two links back up made 2**40 paths (a hang). Now links are not entered by `**`."""
    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "a" / "x.txt").write_text("some text")
    (corpus / "top.txt").write_text("more text")
    (corpus / "a" / "back").symlink_to("..")
    (corpus / "a" / "back-again").symlink_to("..")
    assert expand_sources([f"{corpus}/**/*.txt"]) == [corpus / "a" / "x.txt", corpus / "top.txt"]
    assert expand_sources([str(corpus), f"{corpus}/**/*.txt"]) == [corpus / "a" / "x.txt", corpus / "top.txt"]
    assert expand_sources([f"{corpus}/**"]) == [corpus / "a" / "x.txt", corpus / "top.txt"]  # links: deduplicated


def test_a_double_star_glob_matches_as_glob_does(tmp_path: Path) -> None:
    """Without links, `**` patterns name exactly what glob.glob names (hidden names included only
    where the pattern spells the dot)."""
    import glob

    for name in ("top.txt", "a/x.txt", "a/b/y.txt", "a/.q.txt", ".h/z.txt", ".h/k/v.txt", "c/w.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    for pattern in ("**/*.txt", "**", "**/b/*.txt", "**/.*.txt", ".h/**/*.txt", "**/*", "*/**/*.txt", "**/x.txt"):
        want = sorted(Path(p) for p in glob.glob(f"{tmp_path}/{pattern}", recursive=True))
        assert sorted(Path(p) for p in expand_glob(f"{tmp_path}/{pattern}")) == want, pattern


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_interrupted_preparation_reruns_to_the_same_files(tokenizer_file: Path, tmp_path: Path) -> None:
    """SIGKILL a real `meshrun prepare-data` once it has written shards, rerun it: the result is
    exactly an uninterrupted preparation, and nothing training would accept existed meanwhile."""
    lines = "".join(json.dumps({"text": d}) + "\n" for d in make_documents(400, seed=4))
    for i in range(15):  # 2 MB in 15 files: ~100 shards of 10,000 tokens
        (tmp_path / "corpus").mkdir(exist_ok=True)
        (tmp_path / "corpus" / f"part{i:02d}.jsonl").write_text(lines)
    args = [
        "prepare-data",
        "--source",
        str(tmp_path / "corpus"),
        "--tokenizer",
        str(tokenizer_file),
        "--workers",
        "1",
        "--shard-tokens",
        "10000",
    ]
    out, staging = tmp_path / "out", tmp_path / ".out.partial"
    proc = start_meshrun([*args, "--out", str(out)], tmp_path=tmp_path, env=meshrun_env(tmp_path))
    deadline = time.monotonic() + 120
    while not (staging / "train-00002.bin").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    kill_tree(proc.pid)
    finish_meshrun(proc, timeout=30, check=False)
    assert proc.returncode == -signal.SIGKILL, "prepare-data finished before it could be interrupted"
    assert staging.is_dir() and not out.exists()
    assert not (staging / "meta.json").exists()
    finish_meshrun(start_meshrun([*args, "--out", str(out)], tmp_path=tmp_path), timeout=300)
    assert not staging.exists()
    reference = tmp_path / "reference"  # the same preparation, uninterrupted (in this process: quicker)
    prepare(
        [str(tmp_path / "corpus")],
        reference,
        tokenizer=str(tokenizer_file),
        workers=1,
        shard_tokens=10_000,
        progress=False,
    )
    assert _files(out) == _files(reference)
    assert len(json.loads((out / "meta.json").read_text())["splits"]["train"]["shards"]) > 50
    assert os.access(out / "meta.json", os.R_OK)


def test_special_token_text_inside_a_document_is_not_a_boundary(tokenizer_file: Path, tmp_path: Path) -> None:
    """A document that mentions "<|endoftext|>" keeps it as text: one EOS per document, at its end."""
    docs = [*DOCS[:6], f"GPT-2 separates documents with {EOS} between them", *DOCS[6:12]]
    source = write_source("jsonl", tmp_path / "src", docs)
    prepare([str(source)], tmp_path / "out", tokenizer=str(tokenizer_file), val_fraction=0.2, workers=1, progress=False)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id(EOS)
    stored = stored_documents(tmp_path / "out", "train") + stored_documents(tmp_path / "out", "val")
    assert len(stored) == len(docs) and all(doc.count(eos) == 1 and doc[-1] == eos for doc in stored)
    assert any(tokenizer.decode(doc[:-1]) == docs[6] for doc in stored)  # the mention decodes back as text


def test_vocabulary_with_holes_is_sized_by_its_largest_id(tmp_path: Path) -> None:
    """201 entries with ids up to 301: the shards must hold id 301 (uint16), not wrap it in uint8."""
    vocab = {f"w{i}": i for i in range(199)} | {"big": 300, EOS: 301}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOS])
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = [" ".join(["w1", "big", "w2"] * (i + 1)) for i in range(20)]
    source = write_source("text", tmp_path / "src", docs)
    meta = prepare(
        [str(source)],
        tmp_path / "out",
        tokenizer=str(tmp_path / "tokenizer.json"),
        val_fraction=0.2,
        workers=1,
        progress=False,
    )
    assert meta["vocab_size"] == 302 and meta["dtype"] == "uint16"
    stored = stored_documents(tmp_path / "out", "train") + stored_documents(tmp_path / "out", "val")
    assert sorted(stored) == sorted([[1, 300, 2] * (i + 1) + [301] for i in range(20)])


def test_a_dataset_dicts_own_held_out_splits_are_not_trained_on(tokenizer_file: Path, tmp_path: Path) -> None:
    """Of a save_to_disk DatasetDict only `train` is read: its test split's documents appear nowhere."""
    _dataset_dict(tmp_path, ["train", "test"])
    prepare(
        [str(tmp_path / "dd")],
        tmp_path / "out",
        tokenizer=str(tokenizer_file),
        val_fraction=0.2,
        workers=1,
        progress=False,
    )
    assert_documents_in_order(
        tmp_path / "out", hf_expected(Tokenizer.from_file(str(tokenizer_file)), make_documents(40, seed=0), EOS)
    )


def test_adding_sources_never_moves_a_val_document_into_train(tmp_path: Path) -> None:
    """v2 = v1's folder plus a sibling folder (which widens the corpus root): every v1 val
    document is still in val, and every v1 train document still in train."""
    write_source("text", tmp_path / "corpus" / "a", make_documents(60, seed=1))
    write_source("text", tmp_path / "corpus" / "b", make_documents(20, seed=2))
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    prepare([str(tmp_path / "corpus" / "a")], v1, val_fraction=0.2, workers=1, progress=False)
    prepare([str(tmp_path / "corpus" / p) for p in "ab"], v2, val_fraction=0.2, workers=1, progress=False)
    for split in ("train", "val"):
        before, after = stored_documents(v1, split), stored_documents(v2, split)
        assert before and all(doc in after for doc in before), split


def test_a_folder_source_skips_hidden_and_binary_files(tmp_path: Path) -> None:
    """A project folder: its text is read, its .git objects and an old dataset's token shards are
    not (counted in the one line prepare-data prints)."""
    from meshrun.data.prepare import describe_dataset

    docs = make_documents(20, seed=3)
    write_source("text", tmp_path / "proj" / "docs", docs)
    (tmp_path / "proj" / ".git" / "objects").mkdir(parents=True)
    (tmp_path / "proj" / ".git" / "objects" / "ab12").write_bytes(b"x\x9c" + bytes(100))
    (tmp_path / "proj" / ".gitignore").write_text("*.bin\n")
    (tmp_path / "proj" / "train-00000.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    meta = prepare([str(tmp_path / "proj")], tmp_path / "out", val_fraction=0.2, workers=1, progress=False)
    assert meta["documents"] == len(docs) and meta["skipped_files"] == 3
    assert describe_dataset(meta).endswith("; skipped 3 hidden or binary files")
    assert_documents_in_order(tmp_path / "out", [list(d.encode() + b"\n\n") for d in docs])
