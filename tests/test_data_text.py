"""Sources that tokenize on first use (hf_dataset, stdlib_text) and data=custom's `_target_` hook:
cached, fingerprinted by content, trained on and resumed in process, refused in one line."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch

from harness.config.schema import DataConfig
from harness.data import build_data, data_fingerprint
from harness.data.base import StreamData, fingerprint
from tests.test_data_prepare_sources import TEXTS, write_arrow_stream, write_parquet

tokenizers = pytest.importorskip("tokenizers")
SEQ = 16


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tests.test_prepare import train_bpe

    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def saved_dataset(d, texts):
    """A directory laid out as `datasets.Dataset.save_to_disk` lays it out."""
    d.mkdir()
    write_arrow_stream(d / "data-00000-of-00001.arrow", texts)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (d / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return d


def test_hf_dataset_is_tokenized_once_and_fingerprinted_by_content(bpe, tmp_path, capsys):
    texts = [t for t in TEXTS if t] * 30
    src = saved_dataset(tmp_path / "ds", texts)
    cfg = DataConfig(name="hf_dataset", path=str(src), tokenizer=str(bpe), cache_dir=str(tmp_path / "cache"))
    data = build_data(cfg, vocab_size=512, seq_length=SEQ)
    assert "prepare:" in capsys.readouterr().err  # tokenized now ...
    again = build_data(cfg, vocab_size=512, seq_length=SEQ)
    assert "prepare:" not in capsys.readouterr().err  # ... and read from the cache after
    assert again.fingerprint == data.fingerprint and data.vocab_size == 384 and data.name == "hf_dataset"
    x, y = next(iter(data.train_batches(2, seed=0)))
    assert x.shape == (2, SEQ) and torch.equal(x[:, 1:], y[:, :-1])
    moved = shutil.copytree(src, tmp_path / "elsewhere")  # content, not location
    assert data_fingerprint(
        DataConfig(**{**cfg.__dict__, "path": str(moved)}), vocab_size=512, seq_length=SEQ
    ) == (data.fingerprint)
    parquet = tmp_path / "shards"
    parquet.mkdir()
    write_parquet(parquet / "part-0.parquet", texts[:50])
    write_parquet(parquet / "part-1.parquet", texts[50:])
    from_parquet = build_data(
        DataConfig(**{**cfg.__dict__, "path": str(parquet)}), vocab_size=512, seq_length=SEQ
    )
    np.testing.assert_array_equal(from_parquet.train, data.train)  # the same rows, the same tokens


def test_hf_dataset_errors_are_one_line(bpe, tmp_path):
    write_parquet(tmp_path / "body.parquet", TEXTS, column="body")
    cache = str(tmp_path / "cache")
    body, tok = str(tmp_path / "body.parquet"), str(bpe)

    def hf(**kw):
        return DataConfig(name="hf_dataset", cache_dir=cache, **kw)

    cases = [
        (hf(path=body, tokenizer=tok), "no 'text' column (it has body, id); set data.text_key"),
        (hf(path=body), "data.tokenizer=null: hf_dataset tokenizes its text"),
        (hf(path=f"{body},{tmp_path / 'nope'}", tokenizer=tok), "no such file or directory"),
        (hf(path=body, tokenizer=str(tmp_path / "t.json")), "data.tokenizer="),
    ]
    if importlib.util.find_spec("datasets") is None:  # a hub name needs the library (and a network)
        cases.append(
            (
                DataConfig(name="hf_dataset", path="org/corpus", tokenizer=str(bpe)),
                "`datasets` is not installed",
            )
        )
    for cfg, needle in cases:
        with pytest.raises(ValueError) as err:
            build_data(cfg, vocab_size=512, seq_length=SEQ)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not list((tmp_path / "cache").glob(".tmp-*"))  # a failed tokenization leaves nothing


def test_stdlib_text_trains_and_resumes(tmp_path):
    from harness.train import run
    from tests.helpers import compose_cfg

    cache = tmp_path / "cache"
    base = ["model=llama3_tiny", "model.vocab_size=512", "data=stdlib_text", "data.num_tokens=200000"]
    base += [f"data.cache_dir={cache}", "logger=none", "log_interval=2", "eval_tokens=512"]
    base += [
        "micro_batch_size=2",
        "global_batch_size=2",
        "checkpoint_interval=2",
        "checkpoint_keep=3",
        "steps=4",
    ]
    cfg = compose_cfg(*base)
    straight = run(cfg, tmp_path / "run")
    described = json.loads((tmp_path / "run" / "run.json").read_text())["provenance"]["data"]
    assert described["vocab_size"] == 512 and described["tokenizer"].startswith(str(cache))
    assert described["eval_tokens"] == round((described["train_tokens"] + described["eval_tokens"]) * 0.05)
    for ckpt in sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[1:]:
        shutil.rmtree(ckpt)
    (tmp_path / "run" / "summary.json").unlink()
    resumed = run(cfg, tmp_path / "run")
    assert (
        resumed.final_train_loss == straight.final_train_loss
        and resumed.final_eval_loss == straight.final_eval_loss
    )
    with pytest.raises(ValueError, match=r"^model.vocab_size=256: stdlib_text's BPE needs at least 512 ids"):
        build_data(DataConfig(name="stdlib_text", cache_dir=str(cache)), vocab_size=256, seq_length=SEQ)


class Reversed(StreamData):
    """An example user source: a text file's bytes, reversed (what docs/data.md shows)."""

    def __init__(self, vocab_size: int, seq_length: int, path: str, eval_fraction: float = 0.1):
        raw = np.frombuffer(open(path, "rb").read()[::-1], dtype=np.uint8)
        cut = round(len(raw) * (1 - eval_fraction))
        super().__init__(
            "reversed",
            256,
            seq_length,
            raw[:cut],
            raw[cut:],
            fingerprint({"n": len(raw)}, raw),
            "data.params.path",
        )


def not_a_source(vocab_size: int, seq_length: int):
    return [1, 2, 3]


def test_custom_target_is_built_validated_and_fingerprinted(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("".join(TEXTS) * 20)
    cfg = DataConfig(name="custom", _target_="tests.test_data_text.Reversed", params={"path": str(text)})
    data = build_data(cfg, vocab_size=256, seq_length=SEQ)
    assert data.describe()["target"] == "tests.test_data_text.Reversed" and data.vocab_size == 256
    assert data.fingerprint != data.facts["source_fingerprint"]  # the target and params are hashed in
    other = DataConfig(**{**cfg.__dict__, "params": {"path": str(text), "eval_fraction": 0.2}})
    assert build_data(other, vocab_size=256, seq_length=SEQ).fingerprint != data.fingerprint
    cases = [
        ("tests.nope.Source", {}, "data._target_=tests.nope.Source: cannot import tests.nope"),
        ("tests.test_data_text.Nope", {}, "has no Nope"),
        ("tests.test_data_text.Reversed", {"pth": "x"}, "rejected its arguments"),
        ("tests.test_data_text.not_a_source", {}, "returned list, not a TokenData"),
        (
            "tests.test_data_text.Reversed",
            {"path": str(text), "eval_fraction": 0.001},
            "the eval split has only",
        ),
    ]
    for target, params, needle in cases:
        with pytest.raises(ValueError) as err:
            build_data(
                DataConfig(name="custom", _target_=target, params=params), vocab_size=256, seq_length=SEQ
            )
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_custom_target_from_the_command_line(tmp_path, capsys):
    from harness.train import main
    from tests.helpers import run_main

    text = tmp_path / "t.txt"
    text.write_text("".join(TEXTS) * 40)
    args = ["model=gpt_tiny", "data=custom", "data._target_=tests.test_data_text.Reversed"]
    args += [f"+data.params.path={text}", "logger=none", "steps=2", "log_interval=1", "eval_tokens=128"]
    args += ["micro_batch_size=2", "global_batch_size=2", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_main(capsys, main, "harness.train", *args)
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    code, err = run_main(capsys, main, "harness.train", *args[:2], "data._target_=tests.nope.X", *args[3:-1])
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "error: data._target_=tests.nope.X: cannot import"
    )


def test_a_real_datasets_directory(bpe, tmp_path):
    """What `datasets.Dataset.save_to_disk` writes (Arrow stream shards, state.json), read without
    `datasets` at run time, row for row as `datasets.load_from_disk` reads it."""
    from tests.test_data_prepare_sources import optional

    datasets = optional("datasets")
    rows = [t for t in TEXTS if t] * 40
    ds = datasets.Dataset.from_dict({"text": rows, "n": list(range(len(rows)))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    cfg = DataConfig(
        name="hf_dataset", path=str(tmp_path / "saved"), tokenizer=str(bpe), cache_dir=str(tmp_path / "c")
    )
    data = build_data(cfg, vocab_size=512, seq_length=SEQ)
    from harness.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(bpe))
    eot = tok.token_to_id("<|endoftext|>")
    loaded = datasets.load_from_disk(str(tmp_path / "saved"))["text"]
    want = np.concatenate([np.asarray(ids + [eot]) for ids in tok.encode_batch(list(loaded))])
    np.testing.assert_array_equal(np.concatenate([data.train, data.eval]), want)


def test_hf_dataset_resumes_exactly_and_refuses_changed_rows(bpe, tmp_path):
    from harness.config.errors import ConfigError
    from harness.train import run
    from tests.helpers import compose_cfg

    rows = [t for t in TEXTS if t] * 60
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "part-0.parquet", rows)
    over = ["model=llama3_tiny", "model.vocab_size=384", "data=hf_dataset", f"data.path={tmp_path / 'pq'}"]
    over += [f"data.tokenizer={bpe}", f"data.cache_dir={tmp_path / 'cache'}", "logger=none", "steps=4"]
    over += ["eval_tokens=128", "micro_batch_size=2", "global_batch_size=2", "checkpoint_interval=2"]
    cfg = compose_cfg(*over, "checkpoint_keep=2")
    straight = run(cfg, tmp_path / "run")
    shutil.rmtree(sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1])
    (tmp_path / "run" / "summary.json").unlink()
    resumed = run(cfg, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["attempts"][-1]["resumed_from_step"] == 2
    assert resumed.final_train_loss == straight.final_train_loss
    write_parquet(tmp_path / "pq" / "part-0.parquet", rows[:-1] + ["a changed last row"])
    (tmp_path / "run" / "summary.json").unlink()
    shutil.rmtree(sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1])
    with pytest.raises(ConfigError, match="holds a checkpoint trained on other data: data.name=hf_dataset"):
        run(cfg, tmp_path / "run")
