"""A servable export: a tiny Llama trained on real text (stdlib_text's BPE) exported in every format
with its tokenizer and generation config, loaded by transformers and generating; token ids,
context length and the Mistral family carried from an imported config; INT4 groups that serving
kernels do not take warned about."""

from __future__ import annotations

import json

import pytest
import torch

from harness.interop.export import check_serving_group, export, main

transformers = pytest.importorskip("transformers")

LOADERS = {"hf": None, "hf-int4": "compressed_tensors", "hf-fp8": "accelerate"}


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """The README's path: a folder of parquet text -> a BPE trained on it -> a tiny Llama."""
    from harness.train import run
    from tests.helpers import compose_cfg
    from tests.test_data_prepare_sources import write_parquet
    from tests.test_prepare import CORPUS

    d = tmp_path_factory.mktemp("servable")
    (d / "parquet").mkdir()
    for i, path in enumerate(CORPUS):  # one shard per file of the stdlib's json package, a row per paragraph
        write_parquet(d / "parquet" / f"part-{i:03d}.parquet", path.read_text().split("\n\n"))
    over = ["model=llama3_tiny", "model.vocab_size=512", "data=hf_dataset", f"data.path={d / 'parquet'}"]
    over += ["data.tokenizer=bpe:512", f"data.cache_dir={d / 'cache'}", "logger=none", "steps=3"]
    over += ["log_interval=1", "eval_tokens=256"]
    over += ["micro_batch_size=2", "global_batch_size=2", "backend=emulated"]
    assert run(compose_cfg(*over), d / "run").status == "completed"
    return d


@pytest.mark.parametrize("fmt", list(LOADERS))
def test_each_export_generates_with_its_tokenizer(text_run, fmt):
    if LOADERS[fmt]:
        pytest.importorskip(LOADERS[fmt])
    out = text_run / fmt
    res = export(str(text_run / "run"), fmt, str(out), group_size=32)
    assert res["tokenizer"] and res["warnings"] == []
    tok = transformers.AutoTokenizer.from_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert config["eos_token_id"] == eot == tok.eos_token_id and config["bos_token_id"] is None
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eot
    kw = (
        {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)} if fmt == "hf-fp8" else {}
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **kw).eval()
    ids = tok("def main():\n    return", return_tensors="pt").input_ids
    assert ids.shape[1] > 1 and int(ids.max()) < 512
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert gen.shape == (1, ids.shape[1] + 4)
    assert tok.decode(gen[0, : ids.shape[1]]) == "def main():\n    return"  # the BPE round trips


def test_int4_groups_serving_kernels_reject_are_warned(text_run, capsys):
    assert check_serving_group(128) is None and check_serving_group(-1) is None
    args = [
        str(text_run / "run"),
        "--format",
        "hf-int4",
        "--group-size",
        "16",
        "--out",
        str(text_run / "g16"),
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: --format=hf-int4 with group size 16: transformers loads it, but vLLM's")
    assert "accept group sizes -1, 32, 64, 128 only" in err


def test_an_imported_mistral_keeps_its_family_ids_context_and_tokenizer(tmp_path):
    from harness.train import run
    from tests.helpers import compose_cfg
    from tests.test_hf_weights import SHAPE
    from tests.test_prepare import train_bpe

    src = tmp_path / "mistral"
    config = transformers.MistralConfig(
        **SHAPE,
        bos_token_id=5,
        eos_token_id=6,
        pad_token_id=7,
        max_position_embeddings=32768,
        sliding_window=None,
    )
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).to(torch.bfloat16).save_pretrained(src)
    transformers.GenerationConfig(
        bos_token_id=5, eos_token_id=6, temperature=0.7, do_sample=True
    ).save_pretrained(src)
    transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(train_bpe(tmp_path / "tok.json", 320))
    ).save_pretrained(src)
    over = ["model=hf", f"model.hf_config={src}", f"init_from={src}", "model.seq_length=32", "data=synthetic"]
    over += ["data.vocab_size=320", "logger=none", "steps=2", "log_interval=1", "eval_tokens=64"]
    over += ["micro_batch_size=2", "global_batch_size=2", "backend=emulated"]
    assert run(compose_cfg(*over), tmp_path / "run").status == "completed"
    res = export(str(tmp_path / "run"), "hf", str(tmp_path / "out"))
    assert res["architecture"] == "MistralForCausalLM" and res["tokenizer"]
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "mistral" and written["max_position_embeddings"] == 32768
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (5, 6, 7)
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["temperature"] == 0.7 and gen["eos_token_id"] == 6
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "MistralForCausalLM"


@pytest.mark.parametrize("kind", ["tiktoken", "sentencepiece"])
def test_tiktoken_and_sentencepiece_runs_export_their_tokenizers_with_the_same_ids(kind, tmp_path):
    from harness.data.prepare import prepare
    from harness.data.tokenizer import load_tokenizer
    from harness.train import run
    from tests.helpers import compose_cfg
    from tests.test_data_prepare_sources import TEXTS, optional, write_tiktoken

    lib = optional(kind)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 40))
    if kind == "tiktoken":
        spec = write_tiktoken(tmp_path / "small.tiktoken")
    else:
        (tmp_path / "train.txt").write_text("\n".join(TEXTS) * 20)
        lib.SentencePieceTrainer.train(
            input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "spm"), vocab_size=64,
            model_type="bpe", minloglevel=2, num_threads=1,
        )  # fmt: skip
        spec = tmp_path / "spm.model"
    prepare(str(spec), [str(tmp_path / "docs.jsonl")], str(tmp_path / "ds"), append_eod=True)
    over = ["model=llama3_tiny", "model.vocab_size=320", "data=megatron", f"data.path={tmp_path / 'ds'}"]
    over += ["logger=none", "steps=1", "eval_tokens=128", "micro_batch_size=2", "global_batch_size=2"]
    assert run(compose_cfg(*over), tmp_path / "run").status == "completed"
    res = export(str(tmp_path / "run"), "hf", str(tmp_path / "out"))
    assert res["tokenizer"] and not res["warnings"], res
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ours = load_tokenizer(str(spec))
    for text in TEXTS + ["the thing in there", "  two  spaces\tand a tab", "unseen zqx"]:
        assert tok.encode(text, add_special_tokens=False) == ours.encode_batch([text])[0], text
    eos = json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"]
    assert tok.eos_token_id == eos == (260 if kind == "tiktoken" else ours.token_to_id("</s>"))
