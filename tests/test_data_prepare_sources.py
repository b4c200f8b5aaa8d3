"""harness.data.prepare on the formats datasets ship in (parquet, Arrow as `datasets` writes it,
JSONL, a folder of shards) and with tiktoken and sentencepiece tokenizers; one-line errors for
undecodable, empty and mismatched input."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc  # noqa: F401 - pa.ipc
import pyarrow.parquet as pq
import pytest

from harness.config.schema import DataConfig
from harness.data import build_data
from harness.data.prepare import main as prepare_main
from harness.data.prepare import prepare
from harness.data.tokenizer import CL100K_PATTERN, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Low precision training keeps a master copy of every weight.",
    "",  # an empty row: skipped, as Megatron skips it
    "The quick brown fox jumps over the lazy dog. " * 3,
]


def optional(module: str):
    """The module, or a skip outside CI (CI installs the `dev` extra, which holds it)."""
    if os.environ.get("CI"):
        return __import__(module)
    return pytest.importorskip(module)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tests.test_prepare import train_bpe

    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def write_parquet(path, texts, column="text"):
    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), path, row_group_size=2)
    return path


def write_arrow_stream(path, texts):
    """An Arrow IPC stream, the format of the `.arrow` files `datasets.save_to_disk` writes."""
    table = pa.table({"text": texts})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    return path


def tokens_of(prefix: str) -> np.ndarray:
    man = json.loads(Path(prefix + ".json").read_text())
    return np.fromfile(prefix + ".bin", dtype=man["token_dtype"])


def test_parquet_arrow_jsonl_and_a_folder_give_the_same_tokens(bpe, tmp_path):
    docs = [t for t in TEXTS if t]
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "a.parquet", TEXTS[:2])
    write_parquet(src / "b.parquet", TEXTS[2:])
    write_arrow_stream(tmp_path / "data-00000-of-00001.arrow", TEXTS)
    with open(tmp_path / "docs.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    outs = {}
    for name, inputs in {
        "folder": [str(src)],
        "arrow": [str(tmp_path / "data-00000-of-00001.arrow")],
        "jsonl": [str(tmp_path / "docs.jsonl")],
    }.items():
        man = prepare(str(bpe), inputs, str(tmp_path / name))["megatron"]
        assert man["documents"] == len(docs), name
        outs[name] = tokens_of(str(tmp_path / name))
    tok = load_tokenizer(str(bpe))
    want = np.concatenate([np.asarray(ids) for ids in tok.encode_batch(docs)])
    for name, got in outs.items():
        np.testing.assert_array_equal(got, want, err_msg=name)
    data = build_data(
        DataConfig(name="megatron", path=str(tmp_path / "folder")), vocab_size=512, seq_length=8
    )
    assert data.facts["tokenizer"] == str(bpe)


def test_bad_inputs_stop_with_one_line(bpe, tmp_path, capsys):
    parquet = write_parquet(tmp_path / "shard.parquet", TEXTS)
    disguised = tmp_path / "shard.txt"  # parquet under a text name: found by its magic bytes
    disguised.write_bytes(parquet.read_bytes())
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    numbers = write_parquet(tmp_path / "numbers.parquet", TEXTS, column="body")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    empty = write_parquet(tmp_path / "empty.parquet", ["", ""])
    listy = tmp_path / "listy.jsonl"
    listy.write_text(json.dumps({"text": ["a", "b"]}) + "\n")
    (tmp_path / "nothing").mkdir()
    cases = [
        ([str(latin1)], f"--input {latin1}: not UTF-8 (byte 0xe9 at offset 3)"),
        ([str(bad_jsonl)], f"--input {bad_jsonl}: not UTF-8 on line 2 (byte 0xff at offset 10)"),
        ([str(numbers)], f"--input {numbers}: no 'text' column (it has body, id); set --json-key"),
        (
            [str(tmp_path / "ints.parquet")],
            "--input {}: column 'text' holds int64, not text".format(tmp_path / "ints.parquet"),
        ),
        ([str(empty)], f"--input {empty}: holds no non-empty documents"),
        ([str(listy)], f"--input {listy}: line 1: 'text' holds list, not text"),
        ([str(tmp_path / "nothing")], f"--input {tmp_path / 'nothing'}: the directory holds no"),
    ]
    out = str(tmp_path / "out")
    for inputs, start in cases:
        assert prepare_main(["--tokenizer", str(bpe), "--out", out, "--input", *inputs]) == 2, start
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"error: {start}"), err
    # the disguised parquet is read as parquet, not refused as undecodable text
    assert prepare_main(["--tokenizer", str(bpe), "--out", out, "--input", str(disguised)]) == 0
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp") or p.endswith(".tokens")]


def write_tiktoken(path, merges=(b"th", b"he", b"the", b"in")):
    """A small tiktoken encoding: the 256 bytes, then a few merges, as `.tiktoken` lines."""
    ranks = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return path


def test_tiktoken_file(tmp_path):
    tiktoken = optional("tiktoken")
    path = write_tiktoken(tmp_path / "small.tiktoken")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    man = prepare(str(path), [str(tmp_path / "docs.jsonl")], str(tmp_path / "ds"), append_eod=True)[
        "megatron"
    ]
    assert man["vocab_size"] == 261 and man["eod_id"] == 260 and man["tokenizer_kind"] == "tiktoken"
    enc = tiktoken.Encoding(
        "small",
        pat_str=CL100K_PATTERN,
        mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(path)),
        special_tokens={"<|endoftext|>": 260},
    )
    want = np.concatenate([enc.encode_ordinary(t) + [260] for t in TEXTS if t])
    np.testing.assert_array_equal(tokens_of(str(tmp_path / "ds")), want)
    assert enc.encode_ordinary("the")[0] == 258  # the merges apply
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not base64!! x\n")
    with pytest.raises(ValueError, match=r"^--tokenizer=.*bad.tiktoken: not a .tiktoken file"):
        load_tokenizer(str(bad))


def test_sentencepiece_model(tmp_path):
    spm = optional("sentencepiece")
    text = tmp_path / "train.txt"
    text.write_text("\n".join(TEXTS[:2] + TEXTS[3:]) * 20)
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(tmp_path / "spm"),
        vocab_size=64,
        model_type="bpe",
        minloglevel=2,
        num_threads=1,
    )
    model = tmp_path / "spm.model"
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    man = prepare(str(model), [str(tmp_path / "docs.jsonl")], str(tmp_path / "ds"), append_eod=True)[
        "megatron"
    ]
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert (
        man["vocab_size"] == 64 and man["eod_id"] == sp.eos_id() and man["tokenizer_kind"] == "sentencepiece"
    )
    want = np.concatenate([sp.encode(t) + [sp.eos_id()] for t in TEXTS if t])
    np.testing.assert_array_equal(tokens_of(str(tmp_path / "ds")), want)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00\x01 not a model")
    with pytest.raises(ValueError, match=r"^--tokenizer=.*garbage.model: not a sentencepiece model"):
        load_tokenizer(str(garbage))


def test_bpe_trained_on_the_input(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "a.parquet", [t for t in TEXTS if t] * 50)
    man = prepare("bpe:520", [str(src)], str(tmp_path / "ds"), append_eod=True)["megatron"]
    assert man["tokenizer"] == str(tmp_path / "ds.tokenizer.json") and man["tokenizer_kind"] == "tokenizers"
    tok = load_tokenizer(man["tokenizer"])
    assert (
        man["vocab_size"] == tok.vocab_size <= 520 and man["eod_id"] == tok.token_to_id("<|endoftext|>") == 0
    )
    assert prepare_main(["--tokenizer", "bpe:100", "--input", str(src), "--out", str(tmp_path / "x")]) == 2


def test_a_folder_reads_its_tables_not_its_readme(bpe, tmp_path):
    src = tmp_path / "snapshot"
    (src / "data").mkdir(parents=True)
    write_parquet(src / "data" / "train-00000-of-00001.parquet", TEXTS)
    (src / "README.md").write_text("---\nlicense: mit\n---\n# a dataset card\n")
    man = prepare(str(bpe), [str(src)], str(tmp_path / "ds"))["megatron"]
    assert man["documents"] == len([t for t in TEXTS if t])
