"""prepare-data --chat / --prompt-completion: token ids and loss masks against transformers' own
`apply_chat_template(..., return_assistant_tokens_mask=True)`, the length policies, and bad input
(one line, exit 2, nothing left behind). The tokenizer folder is built here (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from chat_data import CHATML, UNMARKED, conversations, write_chat_tokenizer

from meshrun.cli import main
from meshrun.data.documents import open_documents
from meshrun.data.storage import SPLITS, open_split, read_meta


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder's tokenizer: a byte-level BPE with ChatML's special tokens, its
    tokenizer_config.json holding a template with {% generation %} marks."""
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat-model"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prepare(tmp_path: Path, source: Path, tokenizer: Path, *flags: str, out: str = "out") -> tuple[int, str]:
    args = ["prepare-data", "--source", str(source), "--tokenizer", str(tokenizer), "--out", str(tmp_path / out)]
    code = main([*args, *flags])
    return code, out


def stored(folder: Path) -> dict[tuple[int, ...], np.ndarray]:
    """Every stored document's ids -> its loss mask, both splits."""
    found = {}
    for split in SPLITS:
        docs = open_documents(folder, split)
        for k in range(docs.num_documents):
            ids, mask = docs.document(k)
            found[tuple(ids.tolist())] = mask
    return found


def one_line_error(capsys: pytest.CaptureFixture, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    return err


def test_chat_mask_equals_transformers_assistant_mask(chat_folder: Path, tmp_path: Path, capsys) -> None:
    """Stored ids and masks equal apply_chat_template's input_ids and assistant_masks on
    multi-turn conversations with a system prompt, both where the template marks the assistant
    turns ({% generation %}) and where meshrun finds them by rendered prefixes (unmarked)."""
    from transformers import AutoTokenizer

    convs = conversations()
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in convs])
    (tmp_path / "unmarked.jinja").write_text(UNMARKED)
    assert prepare(tmp_path, source, chat_folder, "--chat", "--max-len", "512", out="marked")[0] == 0
    assert "wrote 12 documents from 12 conversations" in capsys.readouterr().out
    flags = ("--chat", "--max-len", "512", "--chat-template", str(tmp_path / "unmarked.jinja"))
    assert prepare(tmp_path, source, chat_folder, *flags, out="prefixes")[0] == 0
    tok = AutoTokenizer.from_pretrained(str(chat_folder))
    expected = {}
    for conv in convs:
        out = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        expected[tuple(out["input_ids"])] = np.array(out["assistant_masks"], dtype=bool)
        assert 0 < sum(out["assistant_masks"]) < len(out["input_ids"])
    for name, how in (("marked", "generation marks"), ("prefixes", "rendered prefixes")):
        found = stored(tmp_path / name)
        assert found.keys() == expected.keys()
        for ids, mask in expected.items():
            assert np.array_equal(found[ids], mask), (name, tok.decode(list(ids)))
        meta = read_meta(tmp_path / name)
        assert meta is not None and meta["chat_template"]["assistant_tokens"] == how
        assert (tmp_path / name / "chat_template.jinja").read_text() == (CHATML if name == "marked" else UNMARKED)
        assert meta["trained_tokens"] == sum(int(m.sum()) for m in expected.values())


def test_prompt_completion_trains_the_completion_and_eos(chat_folder: Path, tmp_path: Path, capsys) -> None:
    from transformers import AutoTokenizer

    rows = [{"q": f"Question {i}: what is {i} plus 1?\nAnswer:", "a": f" {i + 1}."} for i in range(10)]
    source = write_jsonl(tmp_path / "pc.jsonl", rows)
    flags = ("--prompt-completion", "--prompt-field", "q", "--completion-field", "a", "--max-len", "64")
    assert prepare(tmp_path, source, chat_folder, *flags)[0] == 0
    assert "from 10 prompt/completion records" in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(str(chat_folder))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    found = stored(tmp_path / "out")
    for row in rows:
        prompt_ids = tok(row["q"])["input_ids"]
        ids = tok(row["q"] + row["a"])["input_ids"] + [eos]
        assert ids[: len(prompt_ids)] == prompt_ids
        assert found[tuple(ids)].tolist() == [False] * len(prompt_ids) + [True] * (len(ids) - len(prompt_ids))


def test_train_on_all_and_skipped_conversations(chat_folder: Path, tmp_path: Path, capsys) -> None:
    """--train-on all trains every token; by default a conversation with no assistant turn is
    skipped and counted (it has nothing to train), kept under --train-on all."""
    convs = [*conversations(6), [{"role": "user", "content": "Hello?"}]]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in convs])
    assert prepare(tmp_path, source, chat_folder, "--chat", "--max-len", "512")[0] == 0
    assert "wrote 6 documents from 7 conversations" in (out := capsys.readouterr().out)
    assert "skipped 1 with no trained token" in out
    assert prepare(tmp_path, source, chat_folder, "--chat", "--max-len", "512", "--train-on", "all", out="all")[0] == 0
    assert "wrote 7 documents" in capsys.readouterr().out
    assert all(mask.all() for mask in stored(tmp_path / "all").values())


def test_long_documents_truncated_split_or_refused(chat_folder: Path, tmp_path: Path, capsys) -> None:
    convs = conversations()
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in convs])
    full = stored_lengths = None
    assert prepare(tmp_path, source, chat_folder, "--chat", "--max-len", "512", out="full")[0] == 0
    full = stored(tmp_path / "full")
    stored_lengths = sorted(len(ids) for ids in full)
    limit = stored_lengths[len(stored_lengths) // 2]
    longer = sum(n > limit for n in stored_lengths)
    capsys.readouterr()
    assert prepare(tmp_path, source, chat_folder, "--chat", "--max-len", str(limit), out="cut")[0] == 0
    assert f"truncated {longer} to {limit} tokens" in capsys.readouterr().out
    cut = stored(tmp_path / "cut")
    assert max(map(len, cut)) <= limit
    for ids, mask in full.items():  # each stored document is a whole one or a whole one's beginning
        short = ids[:limit]
        assert short in cut and np.array_equal(cut[short], mask[:limit])
    assert prepare(tmp_path, source, chat_folder, "--chat", "--max-len", str(limit), "--long", "split", out="s")[0] == 0
    pieces = stored(tmp_path / "s")
    assert sum(map(len, pieces)) == sum(stored_lengths) and max(map(len, pieces)) <= limit
    code, _ = prepare(tmp_path, source, chat_folder, "--chat", "--max-len", str(limit), "--long", "refuse", out="r")
    err = one_line_error(capsys, code)
    assert f"tokens, longer than --max-len {limit}" in err and "chats.jsonl:" in err
    assert not (tmp_path / "r").exists() and not (tmp_path / ".r.partial").exists()


def test_documents_are_not_read_as_a_token_stream(chat_folder: Path, tmp_path: Path) -> None:
    from meshrun.errors import ConfigError

    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in conversations()])
    assert prepare(tmp_path, source, chat_folder, "--chat", "--max-len", "512")[0] == 0
    with pytest.raises(ConfigError, match=r"which train only as data\.dir"):
        open_split(tmp_path / "out", "train")


def test_parquet_and_datasets_folders(chat_folder: Path, tmp_path: Path) -> None:
    """A messages column of {role, content} lists reads the same from parquet and save_to_disk."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"chat": c} for c in conversations()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    results = []
    for name, path in (("jsonl", source), ("parquet", tmp_path / "chats.parquet"), ("hf", tmp_path / "hf")):
        flags = ("--chat", "--messages-field", "chat", "--max-len", "512")
        assert prepare(tmp_path, path, chat_folder, *flags, out=f"from-{name}")[0] == 0
        results.append({ids: mask.tolist() for ids, mask in stored(tmp_path / f"from-{name}").items()})
    assert results[0] == results[1] == results[2] and len(results[0]) == 12


RAISES = "{{ raise_exception('only user and assistant turns') if messages[0]['role'] == 'system' }}" + CHATML


@pytest.mark.parametrize(
    ("case", "flags", "fragments"),
    [
        ("unknown role", ["--chat"], ("chats.jsonl:1: message 0 has role 'human'", "map the roles")),
        ("no template", ["--chat"], ("has no chat template", "--chat-template FILE")),
        ("raising template", ["--chat"], ("chats.jsonl:2: the chat template", "only user and assistant turns")),
        ("unparsable template", ["--chat"], ("does not parse (line 1",)),
        ("no field", ["--chat", "--messages-field", "turns"], ("chats.jsonl:1 has no field 'turns'",)),
        ("no max-len", ["--chat", "--max-len", None], ("--chat needs --max-len",)),
        ("bytes", ["--prompt-completion", "--tokenizer", "byte"], ("needs --tokenizer MODEL_FOLDER",)),
        ("template without chat", ["--prompt-completion", "--chat-template", "t.jinja"], ("applies to --chat only",)),
    ],
)
def test_bad_input_is_one_line_exit_2(
    case: str, flags: list, fragments: tuple[str, ...], chat_folder: Path, tmp_path: Path, capsys
) -> None:
    """Nothing is left behind: no --out, no staging folder."""
    convs = conversations(4)
    if case == "unknown role":
        convs[0] = [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]
    folder = chat_folder
    if case in ("no template", "raising template", "unparsable template"):
        folder = tmp_path / "model"
        folder.mkdir()
        (folder / "tokenizer.json").write_bytes((chat_folder / "tokenizer.json").read_bytes())
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
        template = {"raising template": RAISES, "unparsable template": "{% for m in messages %}"}.get(case)
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in convs])
    args = ["--source", str(source), "--tokenizer", str(folder), "--out", str(tmp_path / "out"), "--max-len", "64"]
    if None in flags:
        args = args[:-2]
        flags = [f for f in flags if f not in ("--max-len", None)]
    (tmp_path / "t.jinja").write_text(CHATML)
    err = one_line_error(capsys, main(["prepare-data", *args, *flags]))
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
