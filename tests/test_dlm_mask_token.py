"""A masked-diffusion run of a Hugging Face model with objective.mask_token=null takes its mask token from
the model directory's tokenizer (harness/interop/hf_tokenizer.py): the tokenizer's mask token (BERT's
[MASK], LLaDA's <|mdm_mask|>), else its first reserved special token (Llama 3's
<|reserved_special_token_0|>), else the first id past its vocabulary (Qwen2.5's padding rows); an id
the data holds is skipped, and with nothing left the run is refused in one line naming
objective.mask_token. Tiny tokenizers are built in-process with `tokenizers` and saved beside a
hand-written Llama config.json; each run goes through the entry point, in process."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import train as T
from tests.helpers import run_main

tokenizers = pytest.importorskip("tokenizers")

VOCAB = 320  # the model's embedding rows
WORDS = 300  # the tokenizer's ordinary tokens, ids 0..299
LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"] + [
    f"<|reserved_special_token_{i}|>" for i in range(18)
]
RUN = ["backend=emulated", "hardware=cpu", "logger=none", "steps=1", "eval_interval=0", "log_interval=1"]
RUN += ["micro_batch_size=2", "global_batch_size=2", "model.seq_length=32", "checkpoint_interval=-1"]


def save_tokenizer(directory, specials: list[str], config: dict | None = None):
    """A WordLevel tokenizer of WORDS ordinary tokens and `specials` (ids from WORDS up) as
    tokenizer.json, and `config` as tokenizer_config.json."""
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"w{i}": i for i in range(WORDS)}, unk_token="w0")
    )
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in specials])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))


def hf_model(tmp_path, specials: list[str], config: dict | None = None):
    """A Hugging Face model directory: the Llama config.json and the tokenizer."""
    directory = tmp_path / "hf"
    save_tokenizer(directory, specials, config)
    (directory / "config.json").write_text(json.dumps(LLAMA))
    return directory


def token_files(tmp_path, ids: np.ndarray):
    """nanoGPT token files (train.bin, val.bin) holding `ids`, declared as the model's vocabulary (what
    `prepare` writes for a tokenizer that fills the embedding)."""
    directory = tmp_path / "tokens"
    directory.mkdir()
    for name in ("train.bin", "val.bin"):
        ids.astype(np.uint16).tofile(directory / name)
    return ["data=memmap", f"data.path={directory}", f"data.vocab_size={VOCAB}"]


def train(capsys, tmp_path, hf, data, *extra: str, run: str = "run") -> tuple[int, str]:
    over = [*RUN, "model=hf", f"model.hf_config={hf}", "objective=masked_diffusion", *data, *extra]
    return run_main(capsys, T.main, "harness.train", *over, f"hydra.run.dir={tmp_path / run}")


def text_ids(n: int = 4096) -> np.ndarray:
    """Ordinary tokens only, as tokenized text: ids 0..WORDS-1."""
    return np.random.default_rng(0).integers(0, WORDS, n)


def recorded(tmp_path, run: str = "run") -> dict:
    return json.loads((tmp_path / run / "run.json").read_text())["provenance"]["objective"]


def test_llama3_like_tokenizer_gives_its_first_reserved_token_and_resume_keeps_it(capsys, tmp_path):
    hf = hf_model(tmp_path, LLAMA3_SPECIALS)  # 300 words + 20 specials = 320 ids: no room past it
    data = token_files(tmp_path, text_ids())
    code, err = train(capsys, tmp_path, hf, data, "checkpoint_interval=0")
    assert code == 0, err
    got = recorded(tmp_path)
    assert got["mask_token"] == WORDS + 2  # <|reserved_special_token_0|>, after begin/end of text
    assert "reserved special token '<|reserved_special_token_0|>'" in got["mask_token_source"]
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.suffix == ".json"}

    save_tokenizer(hf, ["<|mask|>"])  # the files changed since: its mask token is 300
    code, err = train(capsys, tmp_path, hf, data, "checkpoint_interval=0")  # the same config again
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and line.startswith("error: objective.mask_token: the checkpoint was trained with "), err
    assert "mask token 302, this run resolves 300" in line and line.endswith("objective.mask_token=302")
    after = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.suffix == ".json"}
    assert after == before  # the refused resume left the run's summary and run.json as they were


def test_bert_like_tokenizer_gives_its_mask_token_and_an_override_wins(capsys, tmp_path):
    specials = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[unused0]"]
    hf = hf_model(tmp_path, specials, {"mask_token": {"content": "[MASK]", "special": True}})
    data = token_files(tmp_path, text_ids())
    assert train(capsys, tmp_path, hf, data)[0] == 0
    got = recorded(tmp_path)
    assert got["mask_token"] == WORDS + 3 and "mask token '[MASK]'" in got["mask_token_source"]
    # the data's ids declared as 0..309: 317 is one it never produces
    code, err = train(
        capsys, tmp_path, hf, data, "data.vocab_size=310", "objective.mask_token=317", run="set"
    )
    assert code == 0, err
    assert recorded(tmp_path, "set") == {"mask_token": 317, "mask_token_source": "objective.mask_token"}


@pytest.mark.parametrize("case", ["nothing_reserved", "reserved_in_data"])
def test_refused_in_one_line_when_no_id_fits(capsys, tmp_path, case):
    ids = text_ids()
    if case == "nothing_reserved":  # 20 special tokens with a job each, filling the embedding
        hf = hf_model(tmp_path, [f"<|tool_{i}|>" for i in range(VOCAB - WORDS)])
    else:  # the data holds <|reserved_special_token_0|>
        hf = hf_model(tmp_path, LLAMA3_SPECIALS)
        ids[100] = WORDS + 2
    code, err = train(capsys, tmp_path, hf, token_files(tmp_path, ids))
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2, err
    assert line.startswith("error: objective.mask_token=null: no id fits the mask token")
    assert "320, the first id past the tokenizer's vocabulary of 320 ids" in line
    assert "set objective.mask_token to an id below 320 that the data never produces" in line
    if case == "reserved_in_data":
        assert "302, the tokenizer's first reserved special token '<|reserved_special_token_0|>'" in line
        assert "is in the data" in line
    assert not (tmp_path / "run").exists()  # a refusal writes nothing


def test_offers_of_llada_and_qwen_like_tokenizers(tmp_path):
    """LLaDA-like: a special token named like a mask, no mask_token declared; Qwen2.5-like: special
    tokens with a job only (end of text, chat, vision pads), so the first id past the vocabulary."""
    from harness.interop.hf_tokenizer import mask_token_offers

    save_tokenizer(tmp_path / "llada", ["<|endoftext|>", "<|mdm_mask|>"])
    (token, source), *_ = mask_token_offers(tmp_path / "llada")
    assert token == WORDS + 1 and "'<|mdm_mask|>'" in source
    qwen = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_pad|>", "<|video_pad|>"]
    save_tokenizer(tmp_path / "qwen", qwen, {"added_tokens_decoder": {}, "pad_token": "<|endoftext|>"})
    assert [t for t, _ in mask_token_offers(tmp_path / "qwen")] == [WORDS + len(qwen)]
    assert mask_token_offers(tmp_path / "none") == []
    # a sentencepiece model's directory: tokenizer_config.json alone does not say how large the vocabulary is
    sp = tmp_path / "sentencepiece"
    sp.mkdir()
    decoder = {"0": {"content": "<unk>", "special": True}, "1": {"content": "<s>", "special": True}}
    (sp / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    assert mask_token_offers(sp) == []


def test_megatron_command_prints_the_tokenizers_mask_token(capsys, tmp_path):
    from harness import megatron as MG

    hf = hf_model(tmp_path, LLAMA3_SPECIALS)
    over = ["objective=masked_diffusion", "model=hf", f"model.hf_config={hf}", "data.vocab_size=300"]
    assert MG.main([*over, "recipe=bf16"]) == 0
    assert f"--mask-token {WORDS + 2}" in capsys.readouterr().out
