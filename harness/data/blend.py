"""Weighted blends of Megatron datasets, in megatron-core's BlendedDataset sample order.

    data=blend data.path='0.3 data/web 0.7 data/code'     # Megatron's --data-path w1 p1 w2 p2

Each prefix is a Megatron indexed dataset (PREFIX.bin/.idx, as `harness.data.prepare` writes it),
read as `data=megatron` reads one, with its own held-out split (the last data.eval_fraction of its
sequences). The weights are normalized as megatron-core's `normalize` does, and sample s of the
blend comes from dataset `dataset_index[s]` as its `dataset_sample_index[s]`-th sample, the two
arrays of megatron-core's `build_blending_indices` (megatron/core/datasets/helpers.cpp): at each
sample the dataset whose count lags its weight's share most, the first on a tie. That order does
not depend on the blend's size, so lowp computes it as far as the run has come; it is the same
for every seed, as in Megatron.

The j-th train sample of a dataset is a random window of seq_length+1 tokens drawn from a
generator keyed by (seed, dataset, j // 1024), so any position is reached without replaying the
stream and a resume is exact. Micro-batch k holds blend samples k*B ... k*B+B-1, so a blend's
token shares match the weights at any batch size. The eval set is blended the same way over
contiguous windows of each dataset's eval split: the same batches for every seed.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from harness.config.schema import DataConfig
from harness.data.base import BLOCK, Batch, StreamData, TokenData, config_error, fingerprint, seeded_generator
from harness.data.files import build_megatron


def parse_blend(spec: str, option: str = "data.path") -> tuple[list[float], list[str]]:
    """Megatron's `w1 p1 w2 p2 ...` (whitespace separated) as (normalized weights, prefixes)."""
    parts = str(spec).split()
    fix = "give weight and prefix pairs, e.g. data.path='0.3 data/web 0.7 data/code'"
    if len(parts) < 4 or len(parts) % 2:
        raise config_error(f"{option}={spec}", "a blend needs two or more weight/prefix pairs", fix)
    try:
        weights = [float(w) for w in parts[0::2]]
    except ValueError:
        raise config_error(f"{option}={spec}", "a weight is not a number", fix) from None
    if not all(w > 0 and np.isfinite(w) for w in weights):
        raise config_error(f"{option}={spec}", "every weight must be > 0", fix)
    return normalize(weights), parts[1::2]


def normalize(weights: list[float]) -> list[float]:
    """megatron/core/datasets/utils.py `normalize`: w / sum(w) in float64."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


class BlendIndex:
    """megatron-core's build_blending_indices, grown on demand: `dataset[s]`, `sample[s]` for s < len."""

    def __init__(self, weights: list[float]):
        self.weights = [float(w) for w in weights]
        self.counts = [0] * len(weights)
        self.dataset = np.zeros(0, dtype=np.int16)
        self.sample = np.zeros(0, dtype=np.int64)

    def extend(self, size: int) -> None:
        """Compute samples up to `size` (helpers.cpp build_blending_indices, the loop at L104-129)."""
        start = len(self.dataset)
        if size <= start:
            return
        size = max(size, 2 * start)  # amortized growth
        dataset = np.zeros(size - start, dtype=np.int16)
        sample = np.zeros(size - start, dtype=np.int64)
        weights, counts = self.weights, self.counts
        for s in range(start, size):
            s_double = max(float(s), 1.0)
            best, best_error = 0, weights[0] * s_double - counts[0]
            for d in range(1, len(weights)):
                error = weights[d] * s_double - counts[d]
                if error > best_error:
                    best, best_error = d, error
            dataset[s - start], sample[s - start] = best, counts[best]
            counts[best] += 1
        self.dataset = np.concatenate([self.dataset, dataset])
        self.sample = np.concatenate([self.sample, sample])

    def __getitem__(self, span: slice) -> tuple[np.ndarray, np.ndarray]:
        self.extend(span.stop)
        return self.dataset[span], self.sample[span]


class BlendData(TokenData):
    """The blend of several StreamData in BlendedDataset's order (module docstring)."""

    def __init__(self, parts: list[StreamData], weights: list[float], prefixes: list[str], seq_length: int):
        params = {"name": "blend", "weights": weights, "parts": [p.fingerprint for p in parts]}
        super().__init__(
            "blend",
            max(p.vocab_size for p in parts),
            seq_length,
            fingerprint(params),
            facts={
                "blend": [
                    {"weight": w, "path": p, "fingerprint": d.fingerprint}
                    for w, p, d in zip(weights, prefixes, parts)
                ],
                **({"tokenizer": parts[0].facts["tokenizer"]} if "tokenizer" in parts[0].facts else {}),
            },
        )
        self.parts, self.weights = parts, weights
        self.index = BlendIndex(weights)
        self.train_tokens = sum(p.train_tokens for p in parts)
        self.eval_tokens = sum(p.eval_tokens for p in parts)
        self._starts: dict[tuple, np.ndarray] = {}

    def produces(self, token_id: int) -> bool:
        return any(p.produces(token_id) for p in self.parts)

    def _window_starts(self, seed: int, d: int, block: int) -> np.ndarray:
        key = (seed, d, block)
        if key not in self._starts:
            if len(self._starts) > 64:
                self._starts.clear()
            gen = seeded_generator("blend-train", self.parts[d].fingerprint, seed, block)
            n = len(self.parts[d].train) - self.seq_length
            self._starts[key] = torch.randint(n, (BLOCK,), generator=gen).numpy()
        return self._starts[key]

    def _train_stream(self, micro_batch_size: int, seed: int, start: int, rank: int = 0, world: int = 1):
        k = start + rank
        while True:
            lo = k * micro_batch_size
            datasets, samples = self.index[lo : lo + micro_batch_size]
            rows = []
            for d, j in zip(datasets.tolist(), samples.tolist()):
                start = self._window_starts(seed, d, j // BLOCK)[j % BLOCK : j % BLOCK + 1]
                rows.append(self.parts[d]._windows(self.parts[d].train, start))  # checks the token ids
            yield self._stack(rows)
            k += world

    @staticmethod
    def _stack(rows: list[Batch]) -> Batch:
        return torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])

    def eval_batches(self, eval_tokens: int, micro_batch_size: int) -> list[Batch]:
        n = self.num_eval_batches(eval_tokens, micro_batch_size)
        if n == 0:
            return []
        order = BlendIndex(self.weights)
        datasets, samples = order[0 : n * micro_batch_size]
        T = self.seq_length
        for d, part in enumerate(self.parts):
            need = (int(samples[datasets == d].max(initial=-1)) + 1) * T + 1
            if part.eval is None or need > len(part.eval):
                have = 0 if part.eval is None else len(part.eval)
                raise config_error(
                    f"eval_tokens={eval_tokens}",
                    f"needs {need} eval tokens of blend part {d} but its eval split has {have}",
                    "lower eval_tokens or hold out more (data.eval_fraction)",
                )
        rows = [
            self.parts[d]._windows(self.parts[d].eval, np.array([j * T])) for d, j in zip(datasets, samples)
        ]
        B = micro_batch_size
        return [self._stack(rows[i * B : (i + 1) * B]) for i in range(n)]


def build(cfg: DataConfig, vocab_size: int, seq_length: int) -> BlendData:
    if cfg.path is None:
        raise config_error(
            "data.path=null",
            "a blend needs weights and prefixes",
            "e.g. data.path='0.3 data/web 0.7 data/code'",
        )
    if cfg.eval_path is not None:
        raise config_error(
            f"data.eval_path={cfg.eval_path}",
            "a blend holds out the last data.eval_fraction of each dataset",
            "drop data.eval_path (or blend prepared eval sets of their own)",
        )
    weights, prefixes = parse_blend(cfg.path)
    parts = []
    for p in prefixes:
        parts.append(build_megatron(dataclasses.replace(cfg, path=p), vocab_size, seq_length))
    tokenizers = {p.facts.get("tokenizer") for p in parts}
    if len(tokenizers) > 1 and None not in tokenizers:
        names = ", ".join(f"{os.path.basename(p)}: {d.facts['tokenizer']}" for p, d in zip(prefixes, parts))
        raise config_error(
            f"data.path={cfg.path}",
            f"the datasets were prepared with different tokenizers ({names})",
            "prepare every dataset of a blend with one tokenizer",
        )
    return BlendData(parts, weights, prefixes, seq_length)
