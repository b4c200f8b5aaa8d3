"""Token files on disk: nanoGPT-style flat `.bin` files and Megatron-LM indexed datasets.

Both are memory-mapped, so a run touches only the windows it samples. Large files are
fingerprinted by size plus sha256 of their first and last MiB (a full hash of a 20 GB corpus
would cost minutes at every start); `fingerprint_method` in describe() says which was used.
Without `data.vocab_size` the vocabulary is max token id + 1, found by one chunked scan.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np

from harness.config.schema import DataConfig
from harness.data.base import StreamData, check_eval_fraction, config_error, fingerprint, split_stream

MIB = 1 << 20
SCAN_CHUNK = 1 << 24  # tokens per chunk of the vocabulary scan
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}

MEGATRON_HEADER = b"MMIDIDX\x00\x00"
# megatron/core/datasets/indexed_dataset.py DType codes (floats are not token ids).
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def file_fingerprint(path: str) -> tuple[str, str]:
    """(sha256 hex, method): the whole file up to 2 MiB, else size + first and last MiB."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= 2 * MIB:
            h.update(fh.read())
            return h.hexdigest(), "sha256(file)"
        h.update(str(size).encode())
        h.update(fh.read(MIB))
        fh.seek(size - MIB)
        h.update(fh.read(MIB))
    return h.hexdigest(), "sha256(size, first MiB, last MiB)"


def require_readable(path: str, option: str) -> None:
    """A file that exists but this user may not read is the user's to fix, like a missing one."""
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise config_error(
            option, f"{path} is not readable by this user (permission denied)", "make it readable or copy it"
        ) from None


def open_tokens(path: str, dtype: type, option: str) -> np.ndarray:
    """A read-only 1-D memmap of a flat token file, with one-line errors for the usual mistakes."""
    if not os.path.isfile(path):
        raise config_error(f"{option}={path}", "no such file", f"point {option} at an existing token file")
    require_readable(path, f"{option}={path}")
    size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
    if size == 0:
        raise config_error(f"{option}={path}", "the file is empty", "point it at a tokenized .bin file")
    if size % itemsize:
        raise config_error(
            f"{option}={path}",
            f"{size} bytes is not a whole number of {np.dtype(dtype).name} tokens",
            "check data.token_dtype (uint16 for vocabularies < 65536, else uint32)",
        )
    return np.memmap(path, dtype=dtype, mode="r")


def scan_vocab(arrays: list[np.ndarray], option: str) -> int:
    """max token id + 1 over all arrays, in chunks (bounded memory on a memmap)."""
    hi = -1
    for arr in arrays:
        for lo in range(0, len(arr), SCAN_CHUNK):
            chunk = arr[lo : lo + SCAN_CHUNK]
            if chunk.min() < 0:
                raise config_error(option, f"holds a negative token id {int(chunk.min())}", "re-tokenize it")
            hi = max(hi, int(chunk.max()))
    return hi + 1


def read_manifest(path: str) -> dict | None:
    """The JSON manifest harness.data.prepare writes beside its outputs (PREFIX.json for a Megatron
    prefix, meta.json in a nanoGPT directory), or None: files from elsewhere have none."""
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        try:
            man = json.load(fh)
        except json.JSONDecodeError:
            return None  # nanoGPT's own meta files are pickles; anything not ours is ignored
    return man if isinstance(man, dict) and "manifest_version" in man and "vocab_size" in man else None


def _stream_data(
    cfg: DataConfig, name, seq_length, train, eval, option, digests, facts, manifest=None
) -> StreamData:
    """Shared tail of memmap and megatron: vocabulary, fingerprint, describe() facts. A prepare
    manifest's vocabulary is the tokenizer's, so the model is checked against that, not the ids seen."""
    declared = cfg.vocab_size is not None
    parts = [train] if eval is None else [train, eval]
    if declared:
        vocab, source = cfg.vocab_size, "data.vocab_size"
    elif manifest is not None:
        vocab, source = int(manifest["vocab_size"]), f"the tokenizer's, {manifest['tokenizer']}"
        facts = {
            **facts,
            "tokenizer": manifest["tokenizer"],
            "prepared_fingerprint": manifest.get("fingerprint"),
        }
    else:
        vocab, source = scan_vocab(parts, option), "max token id + 1"
    methods = sorted({method for _, method in digests})
    # Content, not location: moving the files keeps the fingerprint.
    params = {
        "name": name,
        "files": [digest for digest, _ in digests],
        "token_dtype": facts["token_dtype"],
        "split": [len(train), 0 if eval is None else len(eval)],
    }
    return StreamData(
        name,
        vocab,
        seq_length,
        train,
        eval,
        fingerprint(params),
        split_option=option,
        facts={
            **facts,
            "vocab_source": source,
            "fingerprint_method": methods[0] if len(methods) == 1 else methods,
        },
        check_tokens=declared or manifest is not None,
    )


def build_memmap(cfg: DataConfig, vocab_size: int, seq_length: int) -> StreamData:
    """`path` is one .bin (eval: eval_path, else its last eval_fraction) or a directory holding
    train.bin and val.bin (eval: eval_path, else val.bin, else the last eval_fraction of train.bin)."""
    if cfg.token_dtype not in TOKEN_DTYPES:
        raise config_error(
            f"data.token_dtype={cfg.token_dtype}", "unknown token dtype", "use uint16 or uint32"
        )
    if cfg.path is None:
        raise config_error("data.path=null", "memmap needs a token file", "set data.path=/path/to/train.bin")
    check_eval_fraction(cfg.eval_fraction)
    dtype = TOKEN_DTYPES[cfg.token_dtype]
    path = os.path.expanduser(cfg.path)
    if os.path.isdir(path):
        train_path = os.path.join(path, "train.bin")
        if not os.path.isfile(train_path):
            raise config_error(
                f"data.path={cfg.path}", "directory has no train.bin", "add it or give the .bin file"
            )
    else:
        train_path = path
    manifest = read_manifest(os.path.join(path, "meta.json")) if os.path.isdir(path) else None
    if manifest is not None and manifest.get("token_dtype", cfg.token_dtype) != cfg.token_dtype:
        raise config_error(
            f"data.token_dtype={cfg.token_dtype}",
            f"{os.path.join(cfg.path, 'meta.json')} says the tokens are {manifest['token_dtype']}",
            f"set data.token_dtype={manifest['token_dtype']}",
        )
    tokens = open_tokens(train_path, dtype, "data.path")
    eval_path = os.path.expanduser(cfg.eval_path) if cfg.eval_path else None
    if eval_path is None and os.path.isdir(path) and os.path.isfile(os.path.join(path, "val.bin")):
        eval_path = os.path.join(path, "val.bin")
    if eval_path is not None:
        train, eval = (
            tokens,
            open_tokens(eval_path, dtype, "data.eval_path" if cfg.eval_path else "data.path"),
        )
        eval_source = eval_path
    else:
        train, eval = split_stream(tokens, cfg.eval_fraction)
        eval = eval if cfg.eval_fraction > 0 else None
        eval_source = f"last {cfg.eval_fraction} of {train_path}" if eval is not None else None
    digests = [file_fingerprint(train_path)] + ([file_fingerprint(eval_path)] if eval_path else [])
    facts = {"path": train_path, "eval_split": eval_source, "token_dtype": cfg.token_dtype}
    option = f"data.path={cfg.path}"
    return _stream_data(cfg, "memmap", seq_length, train, eval, option, digests, facts, manifest)


def read_megatron_index(idx_path: str, option: str) -> dict:
    """Parse PREFIX.idx as written by Megatron's _IndexWriter (all little-endian):
    9-byte magic, u64 version (1), u8 dtype code, u64 sequence count S, u64 document count D,
    then int32[S] sequence lengths, int64[S] sequence byte pointers, int64[D] document indices
    (and int8[S] modes for multimodal datasets, not used here)."""
    with open(idx_path, "rb") as fh:
        head = fh.read(34)
    if len(head) < 34 or head[:9] != MEGATRON_HEADER:
        raise config_error(option, f"{idx_path} is not a Megatron MMIDIDX index", "pass the dataset prefix")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:34])
    if version != 1 or code not in MEGATRON_DTYPES:
        raise config_error(
            option, f"{idx_path}: version {version}, dtype code {code} unsupported", "re-preprocess"
        )
    if os.path.getsize(idx_path) < 34 + 12 * seqs + 8 * docs:
        raise config_error(
            option, f"{idx_path} is truncated ({seqs} sequences, {docs} documents)", "re-preprocess"
        )
    raw = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(raw, dtype="<i4", count=seqs, offset=34)
    pointers = np.frombuffer(raw, dtype="<i8", count=seqs, offset=34 + 4 * seqs)
    doc_index = np.frombuffer(raw, dtype="<i8", count=docs, offset=34 + 12 * seqs)
    if docs and doc_index[-1] != seqs:
        raise config_error(option, f"{idx_path}: document indices do not end at {seqs}", "re-preprocess")
    return {"dtype": MEGATRON_DTYPES[code], "lengths": lengths, "pointers": pointers, "doc_index": doc_index}


def open_megatron(prefix: str, option: str) -> tuple[np.ndarray, dict]:
    """All sequences of PREFIX.bin as one flat token array, plus the parsed index."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for p in (idx_path, bin_path):
        if not os.path.isfile(p):
            hint = f" (try {option.split('=')[0]}={prefix[:-4]})" if prefix.endswith((".bin", ".idx")) else ""
            raise config_error(
                option, f"no such file {p}", f"the path is the prefix of PREFIX.bin/.idx{hint}"
            )
        require_readable(p, option)
    index = read_megatron_index(idx_path, option)
    dtype, lengths, pointers = index["dtype"], index["lengths"], index["pointers"]
    itemsize = np.dtype(dtype).itemsize
    starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * itemsize
    total = int(lengths.sum(dtype=np.int64))
    if not np.array_equal(pointers, starts) or os.path.getsize(bin_path) < total * itemsize:
        raise config_error(
            option, f"{bin_path} does not hold the sequences of its .idx back to back", "re-preprocess"
        )
    if total == 0:
        raise config_error(option, f"{bin_path} holds no tokens", "point it at a non-empty dataset")
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(total,)), index


def build_megatron(cfg: DataConfig, vocab_size: int, seq_length: int) -> StreamData:
    """Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx, MMIDIDX format).

    Sequences are concatenated in order into one stream and windows may cross document
    boundaries: like GPTDataset's sample packing, but with no EOD token added (the tokenizer's
    EOD, if preprocess_data.py appended one, is already in the stream). Eval: the eval_path prefix,
    else the last eval_fraction of the sequences (at least one).
    """
    if cfg.path is None:
        raise config_error("data.path=null", "megatron needs a dataset prefix", "set data.path=/path/PREFIX")
    check_eval_fraction(cfg.eval_fraction)
    option = f"data.path={cfg.path}"
    prefix = os.path.expanduser(cfg.path)
    tokens, index = open_megatron(prefix, option)
    digests = [file_fingerprint(prefix + ".idx"), file_fingerprint(prefix + ".bin")]
    facts = {"path": prefix, "sequences": len(index["lengths"]), "documents": len(index["doc_index"]) - 1}
    if cfg.eval_path is not None:
        eval_prefix = os.path.expanduser(cfg.eval_path)
        train, (eval, _) = tokens, open_megatron(eval_prefix, f"data.eval_path={cfg.eval_path}")
        digests += [file_fingerprint(eval_prefix + ".idx"), file_fingerprint(eval_prefix + ".bin")]
        facts["eval_split"] = eval_prefix
    elif cfg.eval_fraction > 0:
        seqs = len(index["lengths"])
        held = max(1, round(seqs * cfg.eval_fraction))
        cut = int(index["pointers"][seqs - held]) // np.dtype(index["dtype"]).itemsize if held < seqs else 0
        train, eval = tokens[:cut], tokens[cut:]
        facts["eval_split"] = f"last {held} of {seqs} sequences"
    else:
        train, eval = tokens, None
        facts["eval_split"] = None
    facts["token_dtype"] = np.dtype(index["dtype"]).name
    manifest = read_manifest(prefix + ".json")
    return _stream_data(cfg, "megatron", seq_length, train, eval, option, digests, facts, manifest)
