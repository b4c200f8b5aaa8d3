"""Token data sources: `build_data(cfg.data, vocab_size=, seq_length=)` -> TokenData.

    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_length=cfg.model.seq_length)
    for inputs, targets in data.train_batches(cfg.micro_batch_size, seed=cfg.seed, start=k): ...
    held_out = data.eval_batches(cfg.eval_tokens, cfg.micro_batch_size)   # same every call
    run_json["data"] = data.describe()
    data_fingerprint(cfg.data, vocab_size=..., seq_length=...)   # what identifies it: content, not paths

Sources: synthetic (uniform tokens), markov (seeded Markov chain, known loss floor), stdlib_bytes
(the interpreter's stdlib as bytes), memmap (nanoGPT .bin files), megatron (indexed .bin/.idx),
blend (Megatron's weighted `w1 p1 w2 p2` blend of indexed datasets, in BlendedDataset's order),
stdlib_text (the stdlib's sources under a BPE lowp trains), hf_dataset (parquet, arrow, jsonl or a
`datasets` directory, tokenized once into a cache), custom (a user's class through `_target_`).
"""

from __future__ import annotations

import dataclasses

from harness.config.schema import DataConfig
from harness.data import blend, custom, files, markov, stdlib_bytes, synthetic, text
from harness.data.base import Batch, StreamData, TokenData, config_error

__all__ = ["Batch", "StreamData", "TokenData", "build_data", "check_data", "data_fingerprint", "SOURCES"]

SOURCES = {
    "synthetic": synthetic.build,
    "markov": markov.build,
    "stdlib_bytes": stdlib_bytes.build,
    "stdlib_text": text.build_stdlib_text,
    "memmap": files.build_memmap,
    "megatron": files.build_megatron,
    "blend": blend.build,
    "hf_dataset": text.build_hf_dataset,
    "custom": custom.build,
}
FILE_SOURCES = ("memmap", "megatron", "blend")
"""Sources that read token files: fingerprinted by the files' bytes, wherever the files are."""


def build_data(cfg: DataConfig, *, vocab_size: int, seq_length: int) -> TokenData:
    """The source named by cfg.name, for a model with this vocabulary and sequence length."""
    if cfg.name not in SOURCES:
        raise config_error(f"data.name={cfg.name}", "unknown data source", f"use one of {', '.join(SOURCES)}")
    if cfg.vocab_size is not None and cfg.vocab_size < 1:
        raise config_error(f"data.vocab_size={cfg.vocab_size}", "must be >= 1", "set it >= 1 or null")
    if seq_length < 1:
        raise config_error(f"model.seq_length={seq_length}", "must be >= 1", "set it >= 1")
    fix = f"set data.vocab_size<={vocab_size} or use a model with vocab_size>="
    if cfg.vocab_size is not None and cfg.vocab_size > vocab_size:  # fail before generating anything
        raise config_error(
            f"data.vocab_size={cfg.vocab_size}",
            f"does not fit model.vocab_size={vocab_size}",
            fix + str(cfg.vocab_size),
        )
    source_vocab = cfg.vocab_size if cfg.vocab_size is not None else vocab_size
    data = SOURCES[cfg.name](cfg, source_vocab, seq_length)
    if data.vocab_size > vocab_size:
        if "tokenizer" in data.facts:  # the tokenizer's vocabulary: only a larger embedding fits it
            raise config_error(
                f"model.vocab_size={vocab_size}",
                f"smaller than the vocabulary of the data's tokenizer ({data.vocab_size}, "
                f"{data.facts['tokenizer']})",
                f"set model.vocab_size>={data.vocab_size} (Megatron pads it to a multiple of 128)",
            )
        raise config_error(
            f"data.vocab_size={data.vocab_size} ({data.facts.get('vocab_source', cfg.name)})",
            f"does not fit model.vocab_size={vocab_size}",
            fix + str(data.vocab_size),
        )
    return data


def check_data(
    cfg: DataConfig, *, vocab_size: int, seq_length: int, micro_batch_size: int, eval_tokens: int
) -> None:
    """What a run would hit in its first step and first eval, found before any job starts: the
    source builds (paths, dtypes, token counts, vocabulary), one train batch and the eval set exist.
    Raises the source's one-line ValueError."""
    data = build_data(cfg, vocab_size=vocab_size, seq_length=seq_length)
    next(data.train_batches(micro_batch_size, seed=0))
    data.eval_batches(eval_tokens, micro_batch_size)


def data_fingerprint(cfg: DataConfig, *, vocab_size: int, seq_length: int) -> str:
    """The fingerprint `build_data` gives (TokenData.fingerprint), for the resume check before a run
    writes anything. A file source's fingerprint hashes its files, not the token ids in them, so its
    vocabulary is taken as declared instead of scanned (a scan reads every token of a large corpus)."""
    if cfg.name in FILE_SOURCES and cfg.vocab_size is None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    return build_data(cfg, vocab_size=vocab_size, seq_length=seq_length).fingerprint
