"""TokenData: a token source cut into seeded, resumable train batches and a fixed eval set.

Every source reduces to the same two questions the training loop asks: "give me micro-batch k of
the train stream for this seed" (random windows, like nanoGPT's get_batch, so that resuming at k
is exact) and "give me the held-out set" (the same batches every call, for every seed, so eval
losses are comparable across runs and recipes). The batching lives here once; sources only say
where their tokens come from.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

Batch = tuple[torch.Tensor, torch.Tensor]

BLOCK = 1024
"""Micro-batches drawn from one torch.Generator. The CPU generator keeps only 32 bits of its seed
(mt19937), so a fresh generator per batch would repeat batches by the birthday bound after ~65k
batches; one per block of 1024 keeps that out of reach while resuming costs < 1024 cheap draws."""


def config_error(option: str, problem: str, fix: str) -> ValueError:
    """The one-line error for bad user input: which option, what is wrong, how to fix it."""
    message = f"{option}: {problem}; {fix}"
    assert "\n" not in message, message
    return ValueError(message)


def seeded_generator(*key: Any) -> torch.Generator:
    """A CPU torch.Generator seeded from a tuple of ints/strings (sha256, so keys never collide)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def fingerprint(params: dict, *chunks: bytes | np.ndarray) -> str:
    """sha256 hex over the source's parameters (canonical JSON) and its token bytes."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    for chunk in chunks:
        h.update(memoryview(np.ascontiguousarray(chunk)) if isinstance(chunk, np.ndarray) else chunk)
    return h.hexdigest()


class TokenData:
    """A source of (inputs, targets) int64 batches of shape (B, T); subclasses draw and build them."""

    def __init__(
        self,
        name: str,
        vocab_size: int,
        seq_length: int,
        fingerprint: str,
        loss_floor: float | None = None,
        facts: dict | None = None,
    ):
        self.name = name
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.fingerprint = fingerprint
        self.loss_floor = loss_floor
        self.facts = dict(facts or {})

    # -- what a source provides -------------------------------------------------------------------
    train_tokens: int | None = None
    """Tokens in the train split (None: drawn on the fly, unbounded)."""
    eval_tokens: int | None = None
    """Tokens in the eval split (None: drawn on the fly, unbounded)."""

    def _draw(self, micro_batch_size: int, gen: torch.Generator) -> Any:
        """Consume the generator for one train batch (cheap: resume replays only this)."""
        raise NotImplementedError

    def _batch(self, draw: Any) -> Batch:
        """Build the (inputs, targets) tensors from one draw."""
        raise NotImplementedError

    def eval_batches(self, eval_tokens: int, micro_batch_size: int) -> list[Batch]:
        """The fixed held-out set: ceil(eval_tokens / (B*T)) batches; eval_tokens=0 -> []."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------
    def train_batches(
        self, micro_batch_size: int, seed: int, start: int = 0, rank: int = 0, world: int = 1
    ) -> TrainStream:
        """Infinite seeded train batches; start=k yields exactly batches k, k+1, ... of start=0.
        Data parallel: rank r of `world` gets batches k+r, k+r+world, ... of that one stream, so the
        ranks together see what one process sees, at any world size."""
        if micro_batch_size < 1:
            raise config_error(f"micro_batch_size={micro_batch_size}", "must be >= 1", "set it >= 1")
        assert start >= 0 and 0 <= rank < world, (start, rank, world)
        return TrainStream(self, micro_batch_size, seed, start, rank, world)

    def _train_stream(
        self, micro_batch_size: int, seed: int, start: int, rank: int = 0, world: int = 1
    ) -> Iterator[Batch]:
        block, offset = divmod(start, BLOCK)
        index = start
        while True:
            gen = seeded_generator("train", self._stream_key(), seed, block)
            for _ in range(offset):
                self._draw(micro_batch_size, gen)
            for _ in range(offset, BLOCK):
                draw = self._draw(micro_batch_size, gen)  # every rank draws every batch: cheap
                if (index - start) % world == rank:
                    yield self._batch(draw)
                index += 1
            block, offset = block + 1, 0

    def _stream_key(self) -> Any:
        """Extra generator key so that different sources with the same seed draw differently."""
        return self.name

    def num_eval_batches(self, eval_tokens: int, micro_batch_size: int) -> int:
        return math.ceil(eval_tokens / (micro_batch_size * self.seq_length))

    def produces(self, token_id: int) -> bool:
        """Whether the source can yield `token_id` (a masked-diffusion run's mask token must be an id it
        never yields): a generated source draws every id of its vocabulary."""
        return 0 <= token_id < self.vocab_size

    def describe(self) -> dict:
        """JSON-able provenance for run.json and summary.json."""
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "train_tokens": self.train_tokens,
            "eval_tokens": self.eval_tokens,
            "fingerprint": self.fingerprint,
            "loss_floor": self.loss_floor,
            **self.facts,
        }


class TrainStream:
    """The train batches of one run: an iterator that knows its position, so a checkpoint can
    store the data order (source fingerprint, seed, batch size) and where in it the run is."""

    def __init__(
        self, data: TokenData, micro_batch_size: int, seed: int, start: int = 0, rank: int = 0, world: int = 1
    ):
        self.data, self.micro_batch_size, self.seed = data, micro_batch_size, seed
        self.rank, self.world = rank, world
        self._seek(start)

    def _seek(self, position: int) -> None:
        """`position`: batches of the one stream consumed by all ranks together."""
        self.position = position
        self._it = self.data._train_stream(self.micro_batch_size, self.seed, position, self.rank, self.world)

    def __iter__(self) -> TrainStream:
        return self

    def __next__(self) -> Batch:
        batch = next(self._it)
        self.position += self.world
        return batch

    def state_dict(self) -> dict:
        return {
            "fingerprint": self.data.fingerprint,
            "seed": self.seed,
            "micro_batch_size": self.micro_batch_size,
            "position": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        order = (self.data.fingerprint, self.seed, self.micro_batch_size)
        saved = (state["fingerprint"], state["seed"], state["micro_batch_size"])
        if saved != order:
            raise ValueError(
                f"the checkpoint's data order (fingerprint {saved[0][:12]}, seed {saved[1]}, micro-batch "
                f"{saved[2]}) is not this run's ({order[0][:12]}, {order[1]}, {order[2]})"
            )
        self._seek(state["position"])


def holds(tokens: np.ndarray, token_id: int, chunk: int = 1 << 24) -> bool:
    """Whether `tokens` (an array or a memmap, read `chunk` tokens at a time) hold `token_id`."""
    return any(bool((tokens[lo : lo + chunk] == token_id).any()) for lo in range(0, len(tokens), chunk))


def split_stream(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last round(N * eval_fraction) tokens of a stream (views, no copy)."""
    n_eval = round(len(tokens) * eval_fraction)
    return tokens[: len(tokens) - n_eval], tokens[len(tokens) - n_eval :]


def check_eval_fraction(eval_fraction: float) -> None:
    if not 0.0 <= eval_fraction < 1.0:
        raise config_error(
            f"data.eval_fraction={eval_fraction}", "must be in [0, 1)", "e.g. data.eval_fraction=0.05"
        )


class StreamData(TokenData):
    """A source backed by two 1-D token arrays (in memory or np.memmap): train and eval splits.

    Train batches are B random windows of T+1 tokens from the train split (starts uniform over
    [0, N-T-1], like nanoGPT); eval batches are contiguous non-overlapping windows from the start of
    the eval split, so the held-out set never depends on the seed.
    """

    def __init__(
        self,
        name: str,
        vocab_size: int,
        seq_length: int,
        train: np.ndarray,
        eval: np.ndarray | None,
        fingerprint: str,
        split_option: str,
        loss_floor: float | None = None,
        facts: dict | None = None,
        check_tokens: bool = False,
    ):
        super().__init__(name, vocab_size, seq_length, fingerprint, loss_floor, facts)
        self.train, self.eval = train, eval
        self.train_tokens = len(train)
        self.eval_tokens = 0 if eval is None else len(eval)
        # check_tokens: the vocabulary was declared (data.vocab_size), not scanned, so each batch
        # is checked before it can reach an embedding as an out-of-range index.
        self.check_tokens = check_tokens
        window = seq_length + 1
        fix = f"use more tokens or a shorter model.seq_length (one window is seq_length+1={window})"
        if len(train) < window:
            raise config_error(split_option, f"the train split has only {len(train)} tokens", fix)
        if eval is not None and len(eval) < window:
            raise config_error(split_option, f"the eval split has only {len(eval)} tokens", fix)

    def produces(self, token_id: int) -> bool:
        """Whether the train or eval tokens hold `token_id`: a scan of the stream (a memmap in chunks)."""
        if not 0 <= token_id < self.vocab_size:
            return False
        return any(holds(a, token_id) for a in (self.train, self.eval) if a is not None)

    def _draw(self, micro_batch_size: int, gen: torch.Generator) -> np.ndarray:
        starts = torch.randint(len(self.train) - self.seq_length, (micro_batch_size,), generator=gen)
        return starts.numpy()

    def _batch(self, draw: np.ndarray) -> Batch:
        return self._windows(self.train, draw)

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> Batch:
        idx = starts[:, None] + np.arange(self.seq_length + 1)  # (B, T+1)
        window = tokens[idx].astype(np.int64)  # fancy indexing reads only these tokens of a memmap
        if self.check_tokens and (window.max() >= self.vocab_size or window.min() < 0):
            bad = int(window.max() if window.max() >= self.vocab_size else window.min())
            raise config_error(
                f"data.vocab_size={self.vocab_size}",
                f"the data holds token id {bad}",
                "set data.vocab_size to the tokenizer's vocabulary (or null to scan the files)",
            )
        return torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(window[:, 1:].copy())

    def eval_batches(self, eval_tokens: int, micro_batch_size: int) -> list[Batch]:
        n = self.num_eval_batches(eval_tokens, micro_batch_size)
        if n == 0:
            return []
        if self.eval is None:
            raise config_error(
                "data.eval_fraction=0",
                "there is no eval split",
                "set data.eval_fraction>0 (or data.eval_path), or eval_tokens=0",
            )
        T = self.seq_length
        need = n * micro_batch_size * T + 1
        if need > len(self.eval):
            raise config_error(
                f"eval_tokens={eval_tokens}",
                f"needs {need} tokens ({n} batches of {micro_batch_size}x{T} + 1) "
                f"but the eval split has {len(self.eval)}",
                "lower eval_tokens or hold out more (data.eval_fraction, data.num_tokens or data.eval_path)",
            )
        starts = np.arange(n * micro_batch_size).reshape(n, micro_batch_size) * T
        return [self._windows(self.eval, row) for row in starts]
