"""Text sources tokenized on first use and cached: Hugging Face datasets, and the stdlib preset.

    data=hf_dataset data.path=DIR_OR_FILES data.tokenizer=tokenizer.json|bpe:N [data.text_key=text]
    data=stdlib_text                        # the stdlib's .py files, lowp's own BPE (offline)

`hf_dataset` reads what `harness.data.prepare` reads: a `datasets.save_to_disk` directory or a
folder of parquet shards, `.arrow`/`.parquet`/`.jsonl` files (several separated by commas), or a hub
name (`datasets` installed and a network: downloaded once into `datasets`' own cache, then read
from its Arrow files). `stdlib_text` trains a byte-level BPE (`data.vocab_size` ids, else the
model's, at most 8192) on the running interpreter's standard-library sources, the same files in the
same order as `stdlib_bytes`, capped at `data.num_tokens` bytes; one document per file.

Both tokenize into Megatron files under `data.cache_dir`, in a directory named by a hash of what
went in (the input files' fingerprints, the tokenizer's bytes, the text field), written under a
temporary name and renamed when whole, so a second run (or a resume) reads the same tokens without
tokenizing again. From there they are `data=megatron` sources: the held-out split is the last
`data.eval_fraction` of the documents (or `data.eval_path`; stdlib_text: of the tokens, as
stdlib_bytes), and the fingerprint hashes the token files, so a resume is exact and refused on
other data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import shutil
import sysconfig
import tempfile
from pathlib import Path

from harness.config.schema import DataConfig
from harness.data.base import StreamData, check_eval_fraction, config_error, fingerprint, split_stream
from harness.data.documents import expand_inputs
from harness.data.files import build_megatron, file_fingerprint
from harness.data.tokenizer import MIN_BPE, TokenizerError, bpe_size, train_bpe

STDLIB_MAX_VOCAB = 8192
STDLIB_MIN_VOCAB = MIN_BPE


def cache_root(cfg: DataConfig) -> Path:
    return Path(os.path.expanduser(cfg.cache_dir))


def tokenized(cfg: DataConfig, inputs: list[str], tokenizer: str, key_parts: list, option: str) -> str:
    """The Megatron prefix of `inputs` tokenized with `tokenizer`, prepared once into the cache."""
    from harness.data import prepare as prep

    try:
        files = expand_inputs(inputs)
        digests = [file_fingerprint(f)[0] for f in files]
        bpe = bpe_size(tokenizer, "data.tokenizer")
        if bpe is not None:
            tokenizer = trained_bpe(cfg, files, digests, bpe)
        tok = prep.load_tokenizer(tokenizer)
    except (prep.PrepareError, TokenizerError) as exc:
        raise _source_error(exc, option) from None
    final = cache_root(cfg) / _key(tok.serialized, *key_parts, cfg.text_key, *digests)
    prefix = str(final / "tokens")
    if os.path.isfile(prefix + ".json"):
        return prefix
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        eod = any(tok.token_to_id(name) is not None for name in prep.EOD_CANDIDATES)
        prep.prepare(tokenizer, files, str(tmp / "tokens"), json_key=cfg.text_key, append_eod=eod)
        os.replace(tmp, final)
    except prep.PrepareError as exc:
        raise _source_error(exc, option) from None
    except OSError:
        if not os.path.isfile(prefix + ".json"):
            raise
        # another process finished the same files first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return prefix


def _key(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
    return h.hexdigest()[:24]


def trained_bpe(cfg: DataConfig, files: list[str], digests: list[str], size: int) -> str:
    """data.tokenizer=bpe:N: a byte-level BPE trained once on the source's own text, cached."""
    from harness.data.documents import documents

    path = cache_root(cfg) / f"bpe-{_key(size, cfg.text_key, *digests)}.tokenizer.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        train_bpe(documents(files, cfg.text_key, "file"), size, str(tmp), "data.tokenizer")
        os.replace(tmp, path)
    return str(path)


def _source_error(exc: ValueError, option: str) -> ValueError:
    """prepare's one line in the data source's words (its options are data.*, not prepare's flags)."""
    words = str(exc).replace("--input ", "").replace("--tokenizer=", "data.tokenizer=")
    return ValueError(f"{option}: {words.replace('--json-key', 'data.text_key')}")


def _as_megatron(
    cfg: DataConfig,
    name: str,
    prefix: str,
    eval_prefix: str | None,
    vocab_size: int,
    seq_length: int,
    facts: dict,
) -> StreamData:
    """The cached Megatron files read as data=megatron reads them, under the source's own name."""
    check_eval_fraction(cfg.eval_fraction)
    mcfg = dataclasses.replace(cfg, path=prefix, eval_path=eval_prefix)
    data = build_megatron(mcfg, vocab_size, seq_length)
    data.name = name
    data.facts.update(facts, cached=os.path.dirname(prefix))
    return data


def local_inputs(spec: str, option: str) -> list[str] | None:
    """The comma-separated paths of `spec`, or None if none of them exists (a hub name)."""
    paths = [os.path.expanduser(p.strip()) for p in spec.split(",") if p.strip()]
    if any(os.path.exists(p) for p in paths):
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise config_error(f"{option}={spec}", f"no such file or directory {missing[0]}", "fix the path")
        return paths
    return None


def hub_inputs(name: str, option: str) -> list[str]:
    """A hub dataset's train split as the Arrow files `datasets` caches it in."""
    fix = "give a local dataset directory or parquet/arrow/jsonl files"
    try:
        import datasets
    except ImportError:
        raise config_error(
            f"{option}={name}", "no such path, and `datasets` is not installed for a hub name", fix
        ) from None
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as exc:  # network, unknown name: the library's own error types vary
        raise config_error(
            f"{option}={name}", f"could not load it ({type(exc).__name__}: {str(exc).splitlines()[0]})", fix
        ) from None
    return [f["filename"] for f in ds.cache_files]


def build_hf_dataset(cfg: DataConfig, vocab_size: int, seq_length: int) -> StreamData:
    if cfg.path is None:
        raise config_error(
            "data.path=null", "hf_dataset needs a dataset", "set data.path=DIR, FILES or a hub name"
        )
    if cfg.tokenizer is None:
        raise config_error(
            "data.tokenizer=null",
            "hf_dataset tokenizes its text",
            "set data.tokenizer=tokenizer.json (or a model dir)",
        )
    option = f"data.path={cfg.path}"
    inputs = local_inputs(cfg.path, "data.path") or hub_inputs(cfg.path, "data.path")
    prefix = tokenized(cfg, inputs, cfg.tokenizer, ["hf_dataset"], option)
    eval_prefix = None
    if cfg.eval_path is not None:
        eval_inputs = local_inputs(cfg.eval_path, "data.eval_path") or hub_inputs(
            cfg.eval_path, "data.eval_path"
        )
        eval_prefix = tokenized(
            cfg, eval_inputs, cfg.tokenizer, ["hf_dataset"], f"data.eval_path={cfg.eval_path}"
        )
    facts = {"source": cfg.path, "text_key": cfg.text_key, "tokenizer_spec": cfg.tokenizer}
    return _as_megatron(cfg, "hf_dataset", prefix, eval_prefix, vocab_size, seq_length, facts)


def stdlib_corpus(num_bytes: int, out: Path) -> list[str]:
    """The stdlib files stdlib_bytes reads, in its order, copied (the last one cut) up to num_bytes."""
    from harness.data.stdlib_bytes import read_capped, stdlib_files

    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files(root)
    paths, total = [], 0
    for i, rel in enumerate(files):
        if total >= num_bytes:
            break
        text, _ = read_capped(root, [rel], num_bytes - total)
        total += len(text)
        dst = out / f"{i:05d}.py.txt"
        dst.write_bytes(text.decode("utf-8", "ignore").encode())  # a cut may split a character
        paths.append(str(dst))
    return paths


def build_stdlib_text(cfg: DataConfig, vocab_size: int, seq_length: int) -> StreamData:
    vocab = cfg.vocab_size if cfg.vocab_size is not None else min(vocab_size, STDLIB_MAX_VOCAB)
    if vocab < STDLIB_MIN_VOCAB:
        option = (
            f"data.vocab_size={vocab}" if cfg.vocab_size is not None else f"model.vocab_size={vocab_size}"
        )
        raise config_error(
            option,
            f"stdlib_text's BPE needs at least {STDLIB_MIN_VOCAB} ids (256 bytes, merges, <|endoftext|>)",
            f"set model.vocab_size>={STDLIB_MIN_VOCAB} (and data.vocab_size to choose the BPE's size)",
        )
    if cfg.num_tokens < 1:
        raise config_error(
            f"data.num_tokens={cfg.num_tokens}", "must be >= 1", "e.g. data.num_tokens=2000000"
        )
    version = f"{platform.python_implementation()}-{platform.python_version()}"
    home = cache_root(cfg) / f"stdlib_text-{version}-{cfg.num_tokens}-{vocab}"
    tok_path = home / "tokenizer.json"
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        files = stdlib_corpus(cfg.num_tokens, Path(tmp))
        if not tok_path.is_file():
            texts = (Path(f).read_text() for f in files)
            train_bpe(texts, vocab, str(Path(tmp) / "tokenizer.json"), "data=stdlib_text")
            os.replace(Path(tmp) / "tokenizer.json", tok_path)
        prefix = tokenized(
            dataclasses.replace(cfg, cache_dir=str(home)),
            files,
            str(tok_path),
            ["stdlib_text"],
            "data=stdlib_text",
        )
    check_eval_fraction(cfg.eval_fraction)
    whole = build_megatron(
        dataclasses.replace(cfg, path=prefix, vocab_size=None, eval_fraction=0), vocab_size, seq_length
    )
    # held out as stdlib_bytes holds out: the last eval_fraction of the tokens (a split by files
    # would hold out one large file of a small corpus, more than the rest)
    train, eval = split_stream(whole.train, cfg.eval_fraction)
    params = {"name": "stdlib_text", "tokens": whole.fingerprint, "split": [len(train), len(eval)]}
    return StreamData(
        "stdlib_text",
        whole.vocab_size,
        seq_length,
        train,
        eval if cfg.eval_fraction > 0 else None,
        fingerprint(params),
        split_option=f"data.num_tokens={cfg.num_tokens}",
        facts={
            "python_version": platform.python_version(),
            "files": len(files),
            "tokenizer": str(tok_path),
            "vocab_source": f"the tokenizer's, {tok_path}",
            "eval_split": f"last {cfg.eval_fraction} of the tokens",
            "cached": str(Path(prefix).parent),
        },
        check_tokens=True,
    )
