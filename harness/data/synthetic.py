"""Uniform random tokens: for benchmarks only (nothing to learn, the loss floor is ln V).

Tokens are drawn on the fly from seeded generators, so there is no stream to store and
`data.num_tokens` is not used; train and eval are different generator streams of `data.seed`.
"""

from __future__ import annotations

import math

import torch

from harness.config.schema import DataConfig
from harness.data.base import Batch, TokenData, fingerprint, seeded_generator


class SyntheticData(TokenData):
    def __init__(self, vocab_size: int, seq_length: int, data_seed: int):
        params = {"name": "synthetic", "vocab_size": vocab_size, "seed": data_seed}
        super().__init__(
            "synthetic",
            vocab_size,
            seq_length,
            fingerprint(params),
            loss_floor=math.log(vocab_size),
            facts={"seed": data_seed, "generated": "on the fly (train_tokens/eval_tokens unbounded)"},
        )
        self.data_seed = data_seed

    def _stream_key(self) -> tuple:
        return (self.name, self.vocab_size, self.data_seed)

    def _draw(self, micro_batch_size: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(self.vocab_size, (micro_batch_size, self.seq_length + 1), generator=gen)

    def _batch(self, draw: torch.Tensor) -> Batch:
        return draw[:, :-1].contiguous(), draw[:, 1:].contiguous()

    def eval_batches(self, eval_tokens: int, micro_batch_size: int) -> list[Batch]:
        gen = seeded_generator("eval", self._stream_key())
        n = self.num_eval_batches(eval_tokens, micro_batch_size)
        return [self._batch(self._draw(micro_batch_size, gen)) for _ in range(n)]


def build(cfg: DataConfig, vocab_size: int, seq_length: int) -> SyntheticData:
    return SyntheticData(vocab_size, seq_length, cfg.seed)
