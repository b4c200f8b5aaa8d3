"""The mask token a Hugging Face model directory's tokenizer offers a masked-diffusion run.

A masked-diffusion LM replaces masked tokens by an id the data never produces. For a model from Hugging
Face (model=hf, init_from) that id should be one the tokenizer sets aside, so that the pretrained
embedding of a real token is not overwritten with a new meaning. The tokenizer's files are read as JSON
(`tokenizer.json`'s added_tokens and model vocabulary, `tokenizer_config.json`'s added_tokens_decoder
and mask_token, `special_tokens_map.json`'s mask_token), no tokenizer library needed, and offer, best first:

1. its mask token: `mask_token` (BERT's `[MASK]`), else a special added token whose name says mask
   (LLaDA's `<|mdm_mask|>`);
2. its first reserved special token: the lowest-id special added token whose name says reserved or
   unused (Llama 3's `<|reserved_special_token_0|>` = 128002, Gemma's `<unused0>`);
3. the first id past its whole vocabulary (added tokens included; known from tokenizer.json, not from a
   sentencepiece model's tokenizer_config.json alone), which no text can produce: the embedding's
   padding rows where the model has them (Qwen2.5: 151665 of 151936 rows; its tokenizer has
   no mask or reserved token, only special tokens with a job: `<|endoftext|>`, chat, tool, FIM and
   vision placeholders).

The caller (harness.model.objective.choose_mask_token) takes the first offer inside the model's
embedding that the data never produces. The rules look at the tokenizer's files, never at a model's name.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

from harness.config.schema import ObjectiveConfig
from harness.model.objective import MASKED_DIFFUSION

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MASK_NAME = re.compile(r"mask", re.IGNORECASE)
RESERVED_NAME = re.compile(r"reserved|unused", re.IGNORECASE)

Offer = tuple[int, str]
"""(token id, where it came from: the words run.json records)."""


def run_offers(objective: ObjectiveConfig, hf_config: str | None, init_from: str | None) -> list[Offer]:
    """The offers a run takes its mask token from: a masked-diffusion run with objective.mask_token=null
    whose model comes from Hugging Face (init_from, model.hf_config); [] for every other run."""
    if objective.name != MASKED_DIFFUSION or objective.mask_token is not None:
        return []
    return mask_token_offers(hf_directory(hf_config, init_from))


def hf_directory(hf_config: str | None, init_from: str | None) -> Path | None:
    """The Hugging Face directory a run's model comes from: init_from's (a directory, or the one
    holding its safetensors file), else model.hf_config's; None for a lowp model preset."""
    for path in (init_from, hf_config):
        if path is None or str(path) in ("???", "None"):
            continue
        p = Path(os.path.expanduser(str(path)))
        return p if p.is_dir() else p.parent
    return None


def mask_token_offers(directory: Path | None) -> list[Offer]:
    """What the tokenizer files in `directory` offer as a mask token, best first (the module's rules);
    [] where the directory has no tokenizer files."""
    if directory is None:
        return []
    paths = tuple(str(Path(directory) / f) for f in FILES)
    stamps = tuple(os.path.getmtime(p) if os.path.isfile(p) else None for p in paths)
    return list(_offers(paths, stamps))


@functools.lru_cache(maxsize=8)
def _offers(paths: tuple[str, ...], stamps: tuple[float | None, ...]) -> tuple[Offer, ...]:
    """mask_token_offers, cached on the files' modification times (a multirun validates every job)."""
    docs = {Path(p).name: _read(p) for p, s in zip(paths, stamps) if s is not None}
    if not docs:
        return ()
    added, vocab = _tokens(docs)  # content -> (id, special); content -> id
    ids = {**vocab, **{c: i for c, (i, _) in added.items()}}
    where = "/".join(sorted(docs))
    offers: list[Offer] = []
    named = _declared_mask(docs)
    if named is None:  # a special added token named like a mask, lowest id first
        masks = [(i, c) for c, (i, special) in added.items() if special and MASK_NAME.search(c)]
        named = min(masks)[1] if masks else None
    if named is not None and named in ids:
        offers.append((ids[named], f"the tokenizer's mask token {named!r} ({where})"))
    reserved = [(i, c) for c, (i, special) in added.items() if special and RESERVED_NAME.search(c)]
    if reserved:
        i, c = min(reserved)
        offers.append((i, f"the tokenizer's first reserved special token {c!r} ({where})"))
    if vocab:  # the whole vocabulary is known only from tokenizer.json (not from a sentencepiece model's)
        size = max(ids.values()) + 1
        offers.append((size, f"the first id past the tokenizer's vocabulary of {size} ids ({where})"))
    return tuple(offers)


def _read(path: str) -> dict:
    """A tokenizer file's JSON object; ValueError naming the file and the override if it is not one."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"objective.mask_token=null: cannot read {path} ({exc}) to find the tokenizer's mask token; "
            "fix the file or set objective.mask_token to an id the data never produces"
        ) from None
    return doc if isinstance(doc, dict) else {}


def _tokens(docs: dict[str, dict]) -> tuple[dict[str, tuple[int, bool]], dict[str, int]]:
    """The added tokens (content -> (id, special)) of tokenizer.json and tokenizer_config.json, and
    tokenizer.json's model vocabulary (content -> id; a Unigram model's list by position)."""
    added: dict[str, tuple[int, bool]] = {}
    for tok in docs.get("tokenizer.json", {}).get("added_tokens") or []:
        if isinstance(tok, dict) and "content" in tok and "id" in tok:
            added[tok["content"]] = (int(tok["id"]), bool(tok.get("special")))
    for i, tok in (docs.get("tokenizer_config.json", {}).get("added_tokens_decoder") or {}).items():
        if isinstance(tok, dict) and "content" in tok:
            added.setdefault(tok["content"], (int(i), bool(tok.get("special"))))
    model_vocab = (docs.get("tokenizer.json", {}).get("model") or {}).get("vocab") or {}
    if isinstance(model_vocab, list):  # Unigram: [[piece, score], ...]
        vocab = {piece[0]: i for i, piece in enumerate(model_vocab)}
    else:
        vocab = {c: int(i) for c, i in model_vocab.items()}
    return added, vocab


def _declared_mask(docs: dict[str, dict]) -> str | None:
    """The mask_token of tokenizer_config.json or special_tokens_map.json (a string, or an AddedToken
    written as {"content": ...})."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = docs.get(name, {}).get("mask_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and token:
            return token
    return None
