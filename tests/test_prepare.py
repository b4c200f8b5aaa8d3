"""harness.data.prepare: a BPE trained here on local text, its tokens in Megatron's and nanoGPT's
files, read back by lowp's readers, trained on, and the vocabulary checked against the model's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from harness.config.schema import DataConfig
from harness.data import build_data
from harness.data.prepare import main as prepare_main
from harness.data.prepare import prepare
from tests.helpers import REPO, compose_cfg, run_cli
from tests.test_data import write_megatron

tokenizers = pytest.importorskip("tokenizers")

VOCAB = 384
CORPUS = sorted(Path(os.path.dirname(json.__file__)).glob("*.py"))  # the stdlib's json package


def train_bpe(path: Path, vocab: int = VOCAB) -> Path:
    """A byte-level BPE with an <|endoftext|> token, trained on local files (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in CORPUS], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    tok = train_bpe(d / "tokenizer.json")
    texts = [p.read_text() for p in CORPUS]
    with open(d / "docs.jsonl", "w") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t, "meta": 1}) + "\n")
    return d, tok, texts


def encode(tok_path: Path, texts: list[str]) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    return [np.array(tok.encode(t, add_special_tokens=False).ids) for t in texts]


def test_megatron_files_are_what_megatron_writes_and_lowp_reads(corpus, tmp_path):
    d, tok, texts = corpus
    out = prepare(str(tok), [str(d / "docs.jsonl")], str(tmp_path / "ds"), append_eod=True)["megatron"]
    eod = out["eod_id"]
    docs = [np.append(ids, eod) for ids in encode(tok, texts)]
    write_megatron(str(tmp_path / "ref"), [[doc] for doc in docs], np.uint16)  # Megatron's writer, replayed
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ds{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    assert out["vocab_size"] == VOCAB and out["token_dtype"] == "uint16" and out["documents"] == len(texts)

    data = build_data(DataConfig(name="megatron", path=str(tmp_path / "ds")), vocab_size=512, seq_length=32)
    assert np.array_equal(np.concatenate([data.train, data.eval]), np.concatenate(docs))
    facts = data.describe()
    assert facts["vocab_size"] == VOCAB and facts["prepared_fingerprint"] == out["fingerprint"]
    assert facts["documents"] == len(texts)


def test_nanogpt_split_dtype_and_fingerprint(corpus, tmp_path):
    d, tok, texts = corpus
    txt = [tmp_path / f"doc{i}.txt" for i in range(len(texts))]
    for p, t in zip(txt, texts):
        p.write_text(t)
    args = [str(tok), [str(p) for p in txt]]
    a = prepare(*args, str(tmp_path / "a"), fmt="both", val_fraction=0.2)
    b = prepare(*args, str(tmp_path / "b"), fmt="nanogpt", val_fraction=0.2)["nanogpt"]
    man = a["nanogpt"]
    docs = encode(tok, texts)
    n_val = round(len(docs) * 0.2)
    train = np.fromfile(tmp_path / "a" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "a" / "val.bin", dtype=np.uint16)
    assert np.array_equal(train, np.concatenate(docs[: len(docs) - n_val]))
    assert np.array_equal(val, np.concatenate(docs[len(docs) - n_val :]))
    assert man["val_documents"] == n_val and man["eod_id"] is None
    # same tokenizer, same text: same fingerprint wherever it was written; megatron's bytes differ
    assert b["fingerprint"] == man["fingerprint"] != a["megatron"]["fingerprint"]

    data = build_data(DataConfig(name="memmap", path=str(tmp_path / "a")), vocab_size=VOCAB, seq_length=32)
    assert data.eval_tokens == len(val) and data.describe()["tokenizer"] == str(tok)
    with pytest.raises(ValueError, match=r"^data.token_dtype=uint32: .* says the tokens are uint16; "):
        build_data(
            DataConfig(name="memmap", path=str(tmp_path / "a"), token_dtype="uint32"),
            vocab_size=VOCAB,
            seq_length=32,
        )

    other = train_bpe(tmp_path / "other.json", vocab=320)
    c = prepare(str(other), [str(p) for p in txt], str(tmp_path / "c"), fmt="nanogpt", val_fraction=0.2)
    assert c["nanogpt"]["fingerprint"] != man["fingerprint"]


def test_text_document_modes(corpus, tmp_path):
    d, tok, _ = corpus
    (tmp_path / "t.txt").write_text("alpha beta\n\ngamma\n\n\ndelta epsilon\nzeta\n")
    counts = {
        mode: prepare(str(tok), [str(tmp_path / "t.txt")], str(tmp_path / mode), text_docs=mode)["megatron"][
            "documents"
        ]
        for mode in ("file", "paragraph", "line")
    }
    assert counts == {"file": 1, "paragraph": 3, "line": 4}


def test_training_runs_on_the_prepared_data_and_checks_the_vocabulary(corpus, tmp_path):
    from harness.train import run
    from harness.validation.rules import ConfigError

    d, tok, _ = corpus
    prepare(str(tok), [str(d / "docs.jsonl")], str(tmp_path / "ds"), append_eod=True)
    base = ["model=gpt_tiny", "data=megatron", f"data.path={tmp_path / 'ds'}", "logger=none", "steps=4"]
    base += ["log_interval=2", "eval_tokens=512", "micro_batch_size=2", "global_batch_size=2"]
    summary = run(compose_cfg(*base, f"model.vocab_size={VOCAB}"), tmp_path / "run")
    assert summary.status == "completed" and summary.final_eval_loss < np.log(VOCAB) + 0.5
    run_json = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run_json["provenance"]["data"]["tokenizer"] == str(tok)

    with pytest.raises(ConfigError) as err:  # gpt_tiny's 256 ids cannot embed a 384-token vocabulary
        run(compose_cfg(*base), tmp_path / "small")
    msg = str(err.value)
    assert msg.startswith("model.vocab_size=256: smaller than the vocabulary of the data's tokenizer (384")
    assert "set model.vocab_size>=384" in msg and "\n" not in msg


def test_cli_progress_errors_and_nothing_lost(corpus, tmp_path, capsys):
    d, tok, _ = corpus
    out = str(tmp_path / "ds")
    assert prepare_main(["--tokenizer", str(tok), "--input", str(d / "docs.jsonl"), "--out", out]) == 0
    std = capsys.readouterr()
    assert f"prepare: {len(CORPUS)} docs" in std.err  # the final progress line
    assert f"data=megatron data.path={out}" in std.out and f"model.vocab_size>={VOCAB}" in std.out
    before = {ext: (tmp_path / f"ds{ext}").read_bytes() for ext in (".bin", ".idx", ".json")}

    bad = tmp_path / "bad.jsonl"
    bad.write_text((d / "docs.jsonl").read_text() + '{"body": "x"}\n')
    cases = [
        (["--input", str(bad)], f"--input {bad}: line {len(CORPUS) + 1} has no 'text' field; set --json-key"),
        (["--input", str(tmp_path / "nope.txt")], "--input"),
        (["--input", str(bad), "--format", "hdf5"], "--format=hdf5"),
        (["--input", str(bad), "--append-eod", "--eod-token", "<eos>"], "--eod-token=<eos>"),
    ]
    for extra, start in cases:
        assert prepare_main(["--tokenizer", str(tok), "--out", out, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"error: {start}"), err
    assert (
        prepare_main(["--tokenizer", str(tmp_path / "missing.json"), "--input", str(bad), "--out", out]) == 2
    )
    assert capsys.readouterr().err.startswith(f"error: --tokenizer={tmp_path / 'missing.json'}: no such file")
    # a failed run leaves the files an earlier one wrote, and no temporaries
    assert {ext: (tmp_path / f"ds{ext}").read_bytes() for ext in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "ds.bin", "ds.idx", "ds.json"]


@pytest.mark.slow  # `python -m harness.data.prepare` itself; main(argv) is tested in-process above
def test_module_entry_point(corpus, tmp_path):
    d, tok, _ = corpus
    res = run_cli(
        ["-m", "harness.data.prepare", "--tokenizer", str(tok), "--input", str(d / "docs.jsonl")]
        + ["--out", str(tmp_path / "ds"), "--format", "nanogpt", "--val-fraction", "0.5"],
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    assert f"prepare: {len(CORPUS)} docs" in res.stderr
    assert (tmp_path / "ds" / "val.bin").exists()
