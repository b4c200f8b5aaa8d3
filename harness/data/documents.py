"""The documents of prepare's inputs: parquet, Arrow (what Hugging Face `datasets` writes), JSONL
and text files, or directories of them, with one-line errors for what cannot be read as text.

    for doc in documents(["shards/", "extra.jsonl"], json_key="text", text_docs="file"): ...

A directory stands for its parquet, arrow and jsonl files in sorted order (a `save_to_disk`
dataset, a folder of parquet shards), or for its text files when it has none of those (a dataset
card is not a document). A file is read by its bytes as well as its name: a parquet file named
`.txt` is still parquet. Empty documents are skipped (Megatron skips them too); an input with none
at all, undecodable bytes, a missing or non-text column or field stop with one line naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path


class PrepareError(ValueError):
    """Bad arguments or inputs: printed as one line, exit code 2."""


TEXT_SUFFIXES = (".txt", ".text", ".md", ".py")
TABLE_SUFFIXES = (".parquet", ".arrow")
JSON_SUFFIXES = (".jsonl", ".json")


def expand_inputs(paths: list[str]) -> list[str]:
    """Files as given; a directory becomes its parquet/arrow/jsonl files in sorted order (a Hugging
    Face `save_to_disk` directory holds its rows in `.arrow` files beside JSON metadata), or its text
    files if it has none of those (so a dataset's README.md is not read as a document)."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(str(f) for f in Path(p).rglob("*") if f.is_file())
            tables = [f for f in found if f.endswith(TABLE_SUFFIXES + (".jsonl",))]
            texts = [f for f in found if f.endswith(TEXT_SUFFIXES)]
            if not tables and not texts:
                raise PrepareError(
                    f"--input {p}: the directory holds no .parquet, .arrow, .jsonl or .txt files"
                )
            files += tables or texts
        elif not os.path.isfile(p):
            raise PrepareError(f"--input {p}: no such file")
        else:
            files.append(p)
    return files


def documents(paths: list[str], json_key: str, text_docs: str) -> Iterator[str]:
    """The documents of every input, in order; empty ones are skipped (Megatron skips them too), but
    an input that holds none at all is refused (a wrong --json-key reads as an empty corpus)."""
    for p in expand_inputs(paths):
        n = 0
        for doc in _file_docs(p, json_key, text_docs):
            n += 1
            yield doc
        if n == 0:
            raise PrepareError(f"--input {p}: holds no non-empty documents; check the file and --json-key")


def _file_docs(p: str, json_key: str, text_docs: str) -> Iterator[str]:
    with open(p, "rb") as fh:
        magic = fh.read(6)
    if p.endswith(".parquet") or magic[:4] == b"PAR1":
        yield from _table_docs(p, json_key, "parquet")
    elif p.endswith(".arrow") or magic == b"ARROW1" or magic[:4] == b"\xff\xff\xff\xff":
        yield from _table_docs(p, json_key, "arrow")
    elif p.endswith(JSON_SUFFIXES):
        yield from _jsonl_docs(p, json_key)
    else:
        yield from _text_docs(p, text_docs)


def _undecodable(path: str, exc: UnicodeDecodeError, where: str = "") -> PrepareError:
    return PrepareError(
        f"--input {path}: not UTF-8{where} (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
        "give parquet, arrow, .jsonl or UTF-8 text files"
    )


def _text_docs(path: str, text_docs: str) -> Iterator[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise _undecodable(path, exc) from None
    if text_docs == "file":
        parts = [text]
    elif text_docs == "paragraph":
        parts = text.split("\n\n")
    else:
        parts = text.splitlines()
    yield from (d for d in parts if d.strip())


def _table_docs(path: str, key: str, kind: str) -> Iterator[str]:
    """The `key` column of a parquet file or an Arrow IPC file/stream (what `datasets` writes),
    read one record batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            table = pq.ParquetFile(path)
            schema = table.schema_arrow
            batches = table.iter_batches(columns=[key]) if key in schema.names else []
        else:
            schema, batches = _open_arrow(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise PrepareError(
            f"--input {path}: not a readable {kind} file ({str(exc).splitlines()[0]})"
        ) from None
    if key not in schema.names:
        raise PrepareError(
            f"--input {path}: no {key!r} column (it has {', '.join(schema.names)}); set --json-key"
        )
    kind_of = schema.field(key).type
    if not (pa.types.is_string(kind_of) or pa.types.is_large_string(kind_of)):
        raise PrepareError(f"--input {path}: column {key!r} holds {kind_of}, not text; set --json-key")
    for batch in batches:
        for doc in batch.column(key).to_pylist():
            if doc:
                yield doc


def _open_arrow(path: str):
    """(schema, record batches) of an Arrow IPC stream (what `datasets` writes) or IPC file."""
    import pyarrow as pa
    import pyarrow.ipc

    try:
        reader = pa.ipc.open_stream(pa.memory_map(path))
        return reader.schema, reader
    except pa.ArrowInvalid:
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()  # memory-mapped: no copy
        return table.schema, table.to_batches()


def _jsonl_docs(path: str, key: str) -> Iterator[str]:
    with open(path, "rb") as fh:  # bytes, decoded line by line: an undecodable line is named
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _undecodable(path, exc, f" on line {n}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PrepareError(f"--input {path}: line {n} is not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or key not in row:
                raise PrepareError(f"--input {path}: line {n} has no {key!r} field; set --json-key")
            if row[key] is not None and not isinstance(row[key], str):
                raise PrepareError(
                    f"--input {path}: line {n}: {key!r} holds {type(row[key]).__name__}, not text; "
                    "set --json-key"
                )
            if row[key]:
                yield row[key]
