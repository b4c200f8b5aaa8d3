"""One interface over the three tokenizer libraries a corpus is usually prepared with.

    tok = load_tokenizer("tokenizer.json" | "model_dir/" | "cl100k.tiktoken" | "spm.model" | "hub/name")
    tok.encode_batch(["text", ...]) -> [[ids], ...];  tok.token_to_id("</s>") -> int | None
    tok.vocab_size; tok.serialized (bytes: what the data fingerprint hashes); tok.kind

- Hugging Face `tokenizers` (a `tokenizer.json`, a model directory holding one, or a hub name);
- `tiktoken` from a local `.tiktoken` file (base64 token and rank per line, as OpenAI ships them),
  split with the cl100k pre-tokenizer pattern and `<|endoftext|>` as the one special token, numbered
  right after the ranks (OpenAI's own encodings leave gaps before theirs: cl100k_base's is 100257,
  lowp's 100256; the manifest holds the id lowp used);
- `sentencepiece` from a `.model` file (Llama 2, Mistral, Gemma, T5);
- `bpe:N`: no tokenizer yet: `prepare` trains a byte-level BPE of N ids on the input itself
  (`train_bpe`, GPT-2's construction with `<|endoftext|>`) and saves it beside the output.

Each library is imported only when its kind of file is asked for; a missing one is a one-line
error naming the extra that installs it (`hf` for tokenizers, `data` for the other two).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
    r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
"""tiktoken's cl100k_base split pattern (tiktoken_ext/openai_public.py)."""
TIKTOKEN_EOT = "<|endoftext|>"
MIN_BPE = 512


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded: one line naming --tokenizer / data.tokenizer and the fix."""


def _require(module: str, option: str, spec: str):
    extra = "hf" if module == "tokenizers" else "data"
    try:
        return __import__(module)
    except ImportError:
        raise TokenizerError(
            f"{option}={spec}: the `{module}` package is not installed; pip install -e '.[{extra}]'"
        ) from None


class Tokenizer:
    """The few calls lowp makes of a tokenizer, whichever library is behind it."""

    kind = ""

    def __init__(self, spec: str):
        self.spec = spec

    vocab_size: int
    serialized: bytes

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    kind = "tokenizers"

    def __init__(self, spec: str, tok):
        super().__init__(spec)
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.serialized = tok.to_str().encode()

    def encode_batch(self, texts):
        return [enc.ids for enc in self.tok.encode_batch(texts, add_special_tokens=False)]

    def token_to_id(self, token):
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id):
        return self.tok.id_to_token(token_id)


class TiktokenTokenizer(Tokenizer):
    kind = "tiktoken"

    def __init__(self, spec: str, path: Path, option: str):
        super().__init__(spec)
        tiktoken = _require("tiktoken", option, spec)
        from tiktoken.load import load_tiktoken_bpe

        self.serialized = path.read_bytes()
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as exc:  # binascii.Error, ValueError: a line that is not "base64 rank"
            raise TokenizerError(
                f"{option}={spec}: not a .tiktoken file ({type(exc).__name__}: {exc}); "
                "each line is a base64 token and its rank"
            ) from None
        if not ranks:
            raise TokenizerError(f"{option}={spec}: the .tiktoken file holds no tokens")
        special = {TIKTOKEN_EOT: max(ranks.values()) + 1}
        self.enc = tiktoken.Encoding(
            Path(spec).stem, pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        self.vocab_size = self.enc.n_vocab

    def encode_batch(self, texts):
        return self.enc.encode_ordinary_batch(texts)

    def token_to_id(self, token):
        return self.enc._special_tokens.get(token)

    def id_to_token(self, token_id):
        try:
            return self.enc.decode_single_token_bytes(token_id).decode("utf-8", "replace")
        except KeyError:
            return None


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, spec: str, path: Path, option: str):
        super().__init__(spec)
        spm = _require("sentencepiece", option, spec)
        self.serialized = path.read_bytes()
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=self.serialized)
        except Exception as exc:  # RuntimeError from the C++ side
            raise TokenizerError(
                f"{option}={spec}: not a sentencepiece model ({str(exc).splitlines()[0]})"
            ) from None
        self.vocab_size = self.sp.get_piece_size()

    def encode_batch(self, texts):
        return self.sp.encode(texts)

    def token_to_id(self, token):
        tid = self.sp.piece_to_id(token)
        return None if tid == self.sp.unk_id() and token != self.sp.id_to_piece(tid) else tid

    def id_to_token(self, token_id):
        return self.sp.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else None


def bpe_size(spec: str, option: str = "--tokenizer") -> int | None:
    """N for a `bpe:N` spec (a byte-level BPE lowp trains on the input), else None."""
    if not spec.startswith("bpe:"):
        return None
    size = spec[4:]
    if not size.isdigit() or int(size) < MIN_BPE:
        raise TokenizerError(
            f"{option}={spec}: bpe:N needs N >= {MIN_BPE} (256 bytes, merges, <|endoftext|>)"
        )
    return int(size)


def train_bpe(texts: Iterable[str], vocab: int, path: str, option: str = "--tokenizer") -> None:
    """A GPT-2 style byte-level BPE with <|endoftext|> (id 0), trained on `texts`, saved as JSON."""
    tokenizers = _require("tokenizers", option, f"bpe:{vocab}")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[TIKTOKEN_EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(path)


def load_tokenizer(spec: str, option: str = "--tokenizer") -> Tokenizer:
    """The tokenizer `spec` names: a `.tiktoken` file, a sentencepiece `.model`, a `tokenizer.json`,
    a directory holding one of them (tokenizer.json first), or a Hugging Face hub name."""
    path = Path(spec).expanduser()
    if path.is_dir():
        found = [path / n for n in ("tokenizer.json", "tokenizer.model") if (path / n).is_file()]
        found += sorted(path.glob("*.tiktoken"))
        if not found:
            raise TokenizerError(
                f"{option}={spec}: the directory has no tokenizer.json, tokenizer.model or .tiktoken file; "
                "point at the file"
            )
        path = found[0]
    if path.is_file():
        if path.suffix == ".tiktoken":
            return TiktokenTokenizer(spec, path, option)
        if path.suffix == ".model":
            return SentencePieceTokenizer(spec, path, option)
        return _hf_from_file(spec, path, option)
    if os.sep in spec or path.suffix in (".json", ".model", ".tiktoken"):
        raise TokenizerError(f"{option}={spec}: no such file or directory; give a tokenizer file's path")
    tokenizers = _require("tokenizers", option, spec)
    try:
        return HFTokenizer(spec, tokenizers.Tokenizer.from_pretrained(spec))
    except Exception as exc:
        raise TokenizerError(
            f"{option}={spec}: could not load it from the hub ({type(exc).__name__}); "
            "give a local tokenizer.json or model directory"
        ) from None


def _hf_from_file(spec: str, path: Path, option: str) -> HFTokenizer:
    tokenizers = _require("tokenizers", option, spec)
    try:
        return HFTokenizer(spec, tokenizers.Tokenizer.from_file(str(path)))
    except Exception as exc:  # the Rust side raises a bare Exception
        raise TokenizerError(f"{option}={spec}: not a tokenizers JSON file ({exc})") from None
