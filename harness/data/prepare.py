"""Tokenize text, JSONL, parquet or Arrow into token files lowp (and Megatron, nanoGPT) read.

    python -m harness.data.prepare --tokenizer PATH_OR_NAME --input FILES... --out PREFIX
        [--format megatron|nanogpt|both] [--json-key text] [--text-docs file|paragraph|line]
        [--append-eod [--eod-token TOKEN]] [--val-fraction 0.05] [--batch-docs 512]

`--tokenizer` is a `tokenizer.json` file, a directory holding one (a Hugging Face model directory),
a `.tiktoken` file, a sentencepiece `.model`, a hub name (needs network), or `bpe:N`: a byte-level
BPE of N ids trained on the input and saved as PREFIX.tokenizer.json; harness.data.tokenizer.
Documents: one per row of a parquet file or Arrow file (what Hugging Face `datasets` writes; its
`--json-key` column), one per line of a `.jsonl`/`.json` file (its `--json-key` field, Megatron's
preprocess_data.py default `text`), one per text file (or per paragraph/line). A directory stands
for its parquet, arrow and jsonl files in sorted order (a `save_to_disk` dataset, a folder of
parquet shards), or for its text files when it has none of those. Undecodable bytes, a missing or
non-text column or field, and an input with no documents stop with one line naming the file
(harness.data.documents reads them).

Outputs (each beside a `.json` manifest: tokenizer, vocabulary, counts, fingerprint):
- `megatron`: PREFIX.bin + PREFIX.idx, byte for byte what Megatron's IndexedDatasetBuilder writes
  for one sequence per document (uint16 tokens when the vocabulary has < 65500 ids, else int32, as
  its DType.optimal_dtype picks); `data=megatron data.path=PREFIX`.
- `nanogpt`: PREFIX/train.bin and PREFIX/val.bin, flat uint16 (uint32 for larger vocabularies), the
  last --val-fraction of the documents in val.bin; `data=memmap data.path=PREFIX`.

The manifest's `vocab_size` is the tokenizer's: lowp's readers take it as the data's vocabulary, so a
model whose embedding is smaller stops with a one-line error before training. The fingerprint is
sha256 over the tokenizer's serialization and the token bytes written: the same tokenizer on the
same text gives the same fingerprint anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from harness.data import tokenizer as tokenizer_mod
from harness.data.documents import PrepareError, documents
from harness.data.tokenizer import Tokenizer

MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}  # megatron.core DType codes
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
MANIFEST_VERSION = 1


def load_tokenizer(spec: str) -> Tokenizer:
    """tokenizer.json, a model directory, a .tiktoken file, a sentencepiece .model or a hub name."""
    try:
        return tokenizer_mod.load_tokenizer(spec, "--tokenizer")
    except tokenizer_mod.TokenizerError as exc:
        raise PrepareError(str(exc)) from None


def eod_id(tokenizer, token: str | None) -> int:
    """The id of the end-of-document token: --eod-token, else the first known EOS name it has."""
    names = (token,) if token else EOD_CANDIDATES
    for name in names:
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return tid
    if token:
        raise PrepareError(f"--eod-token={token}: not in the tokenizer's vocabulary; name one it has")
    raise PrepareError(
        f"--append-eod: the tokenizer has none of {', '.join(EOD_CANDIDATES)}; name it with --eod-token"
    )


def token_dtype(vocab_size: int, fmt: str) -> np.dtype:
    """Megatron's DType.optimal_dtype (uint16 below 65500 ids, else int32); nanoGPT: uint16/uint32."""
    if vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32 if fmt == "megatron" else np.uint32)


class Progress:
    """One status line on stderr at most every `every` seconds, and a final one."""

    def __init__(self, every: float = 2.0, stream=None):
        self.every, self.stream = every, stream or sys.stderr
        self.t0 = self.last = time.perf_counter()

    def update(self, docs: int, tokens: int, nbytes: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.every:
            return
        self.last, dt = now, max(now - self.t0, 1e-9)
        end = "\n" if final else "\r"
        self.stream.write(
            f"prepare: {docs:,} docs  {tokens:,} tokens  {nbytes / 2**20:,.2f} MiB text  "
            f"{tokens / dt:,.0f} tok/s{end}"
        )
        self.stream.flush()


def tokenize(tokenizer, docs: Iterator[str], eod: int | None, batch_docs: int, progress: Progress):
    """Yield one int64 token array per document (EOD appended), tokenizing batches of documents
    at once (the libraries encode a batch on their own thread pools)."""
    n_docs = n_tokens = n_bytes = 0
    batch: list[str] = []

    def flush():
        nonlocal n_docs, n_tokens
        for ids in tokenizer.encode_batch(batch):
            ids = np.asarray(ids, dtype=np.int64)
            if eod is not None:
                ids = np.append(ids, eod)
            n_docs, n_tokens = n_docs + 1, n_tokens + len(ids)
            yield ids
        batch.clear()
        progress.update(n_docs, n_tokens, n_bytes)

    for doc in docs:
        batch.append(doc)
        n_bytes += len(doc.encode("utf-8"))
        if len(batch) >= batch_docs:
            yield from flush()
    if batch:
        yield from flush()
    progress.update(n_docs, n_tokens, n_bytes, final=True)


def write_megatron_index(path: str, dtype: np.dtype, lengths: np.ndarray) -> None:
    """PREFIX.idx as Megatron's _IndexWriter writes it: magic, version 1, dtype code, sequence and
    document counts, int32 lengths, int64 byte pointers, int64 document indices [0, 1, ..., S]."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_index = np.arange(len(lengths) + 1, dtype=np.int64)  # one sequence per document
    with open(path, "wb") as fh:
        fh.write(MEGATRON_HEADER)
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", MEGATRON_CODES[dtype]))
        fh.write(struct.pack("<Q", len(lengths)))
        fh.write(struct.pack("<Q", len(doc_index)))
        fh.write(lengths.tobytes(order="C"))
        fh.write(pointers.tobytes(order="C"))
        fh.write(doc_index.tobytes(order="C"))


class _TokenFile:
    """A flat token file written under a temporary name, hashed as it grows, renamed when whole."""

    def __init__(self, path: str, dtype: np.dtype):
        self.path, self.dtype, self.tokens = path, dtype, 0
        self.tmp = path + ".tmp"
        self.fh = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish/abort
        self.sha = hashlib.sha256()

    def write(self, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype).tobytes(order="C")
        self.fh.write(data)
        self.sha.update(data)
        self.tokens += len(ids)

    def finish(self) -> str:
        self.fh.close()
        os.replace(self.tmp, self.path)
        return self.sha.hexdigest()

    def abort(self) -> None:
        self.fh.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def fingerprint(tokenizer: bytes, file_digests: list[str]) -> str:
    """sha256 over the tokenizer's serialization and the written files' digests."""
    h = hashlib.sha256(tokenizer)
    for d in file_digests:
        h.update(d.encode())
    return h.hexdigest()


def prepare(
    tokenizer_spec: str,
    inputs: list[str],
    out: str,
    fmt: str = "megatron",
    json_key: str = "text",
    text_docs: str = "file",
    append_eod: bool = False,
    eod_token: str | None = None,
    val_fraction: float = 0.05,
    batch_docs: int = 512,
    progress: Progress | None = None,
) -> dict:
    """Tokenize `inputs` into the `fmt` files at `out`; returns the manifest (also written as JSON)."""
    _check_args(inputs, fmt, text_docs, val_fraction, batch_docs)
    try:
        bpe = tokenizer_mod.bpe_size(tokenizer_spec)
    except tokenizer_mod.TokenizerError as exc:
        raise PrepareError(str(exc)) from None
    if bpe is not None:  # trained on the input itself, saved beside the output, named in the manifest
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        tokenizer_spec = out.rstrip("/") + ".tokenizer.json"
        tokenizer_mod.train_bpe(documents(inputs, json_key, text_docs), bpe, tokenizer_spec)
    tok = load_tokenizer(tokenizer_spec)
    vocab = tok.vocab_size
    eod = eod_id(tok, eod_token) if append_eod else None
    # nanoGPT's val split is the last documents: tokenize first, split on the document lengths after
    lengths: list[int] = []
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp_all = _TokenFile(out + ".tokens", np.dtype(np.int64 if vocab >= 2**31 else np.int32))
    docs = documents(inputs, json_key, text_docs)
    try:
        for ids in tokenize(tok, docs, eod, batch_docs, progress or Progress()):
            if len(ids):
                tmp_all.write(ids)
                lengths.append(len(ids))
        tmp_all.fh.close()
    except BaseException:
        tmp_all.abort()
        raise
    try:
        if not lengths:
            raise PrepareError(f"--input {' '.join(inputs)}: no non-empty documents; check --json-key")
        stream = np.memmap(tmp_all.tmp, dtype=tmp_all.dtype, mode="r")
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "tokenizer": _absolute(tokenizer_spec),
            "tokenizer_kind": tok.kind,
            "vocab_size": vocab,
            "eod_id": eod,
            "documents": len(lengths),
            "tokens": int(sum(lengths)),
            "inputs": [os.path.abspath(p) for p in inputs],
            "json_key": json_key,
            "text_docs": text_docs,
        }
        outputs = {}
        if fmt in ("megatron", "both"):
            outputs["megatron"] = _write_megatron(out, stream, np.asarray(lengths), vocab, tok, manifest)
        if fmt in ("nanogpt", "both"):
            outputs["nanogpt"] = _write_nanogpt(out, stream, lengths, vocab, val_fraction, tok, manifest)
        del stream
    finally:
        if os.path.exists(tmp_all.tmp):
            os.remove(tmp_all.tmp)
    return outputs


def _absolute(spec: str) -> str:
    """A tokenizer path made absolute (the manifest outlives the working directory); a hub name as is."""
    path = os.path.expanduser(spec)
    return os.path.abspath(path) if os.path.exists(path) else spec


def _check_args(inputs, fmt, text_docs, val_fraction, batch_docs) -> None:
    if not inputs:
        raise PrepareError("--input: no files given; pass parquet, arrow, .jsonl or text files")
    if fmt not in ("megatron", "nanogpt", "both"):
        raise PrepareError(f"--format={fmt}: unknown; use megatron, nanogpt or both")
    if text_docs not in ("file", "paragraph", "line"):
        raise PrepareError(f"--text-docs={text_docs}: unknown; use file, paragraph or line")
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction={val_fraction}: must be in [0, 1); e.g. 0.05")
    if batch_docs < 1:
        raise PrepareError(f"--batch-docs={batch_docs}: must be >= 1")


def _copy_range(stream, lo: int, hi: int, dst: _TokenFile, chunk: int = 1 << 22) -> None:
    for a in range(lo, hi, chunk):
        dst.write(np.asarray(stream[a : min(a + chunk, hi)]))


def _write_megatron(out, stream, lengths, vocab, tok, manifest) -> dict:
    dtype = token_dtype(vocab, "megatron")
    bin_file = _TokenFile(out + ".bin", dtype)
    try:
        _copy_range(stream, 0, int(lengths.sum()), bin_file)
        digest = bin_file.finish()
    except BaseException:
        bin_file.abort()
        raise
    write_megatron_index(out + ".idx", dtype, lengths)
    man = {
        **manifest,
        "format": "megatron",
        "token_dtype": dtype.name,
        "files": [os.path.basename(out) + ext for ext in (".bin", ".idx")],
    }
    man["fingerprint"] = fingerprint(tok.serialized, [digest])
    _write_json(out + ".json", man)
    return man


def _write_nanogpt(out, stream, lengths, vocab, val_fraction, tok, manifest) -> dict:
    dtype = token_dtype(vocab, "nanogpt")
    n_val = max(1, round(len(lengths) * val_fraction)) if val_fraction > 0 else 0
    if n_val >= len(lengths):
        raise PrepareError(
            f"--val-fraction={val_fraction}: {len(lengths)} documents leave none for train.bin; "
            "give more documents or --val-fraction=0"
        )
    cut = int(sum(lengths[: len(lengths) - n_val]))
    os.makedirs(out, exist_ok=True)
    digests, files = [], []
    for name, lo, hi in (("train.bin", 0, cut), ("val.bin", cut, int(sum(lengths)))):
        if hi == lo:
            continue
        f = _TokenFile(os.path.join(out, name), dtype)
        try:
            _copy_range(stream, lo, hi, f)
            digests.append(f.finish())
        except BaseException:
            f.abort()
            raise
        files.append(name)
    man = {**manifest, "format": "nanogpt", "token_dtype": dtype.name, "files": files}
    man.update(val_documents=n_val, train_tokens=cut, val_tokens=int(sum(lengths)) - cut)
    man["fingerprint"] = fingerprint(tok.serialized, digests)
    _write_json(os.path.join(out, "meta.json"), man)
    return man


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.data.prepare", description=__doc__.split("\n")[0])
    p.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer.json, a model directory, .tiktoken, .model, a hub name, or bpe:N (trained here)",
    )
    p.add_argument(
        "--input",
        required=True,
        nargs="+",
        help="parquet, arrow, .jsonl or text files, or directories of them",
    )
    p.add_argument("--out", required=True, help="output prefix (megatron) / directory (nanogpt)")
    p.add_argument("--format", default="megatron", help="megatron, nanogpt or both")
    p.add_argument(
        "--json-key", default="text", help="JSONL field / parquet or arrow column holding the text"
    )
    p.add_argument("--text-docs", default="file", help="text files: one document per file, paragraph or line")
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    p.add_argument("--eod-token", default=None, help="the EOD token's text (default: a known EOS name)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="nanogpt: documents held out in val.bin")
    p.add_argument("--batch-docs", type=int, default=512, help="documents per encode_batch call")
    a = p.parse_args(argv)
    try:
        outputs = prepare(
            a.tokenizer,
            a.input,
            a.out,
            fmt=a.format,
            json_key=a.json_key,
            text_docs=a.text_docs,
            append_eod=a.append_eod,
            eod_token=a.eod_token,
            val_fraction=a.val_fraction,
            batch_docs=a.batch_docs,
        )
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for kind, man in outputs.items():
        use = f"data=megatron data.path={a.out}" if kind == "megatron" else f"data=memmap data.path={a.out}"
        print(
            f"{kind}: {man['documents']} documents, {man['tokens']} tokens ({man['token_dtype']}), "
            f"vocab {man['vocab_size']}, fingerprint {man['fingerprint'][:16]}  ->  {use} "
            f"model.vocab_size>={man['vocab_size']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
