"""A seeded first-order Markov source: data with structure and a known loss floor.

Each row of the V x V transition matrix is a Dirichlet(alpha) sample (small alpha: few likely
successors per token), so a model can learn the bigram table and nothing more; the best possible
per-token loss is the entropy rate H = -sum_i pi_i sum_j P_ij ln P_ij (nats), pi the stationary
distribution. (The first position of each window has no context; its floor is the marginal
entropy H(pi), reported as `marginal_entropy`.)

For the masked-diffusion objective the floor is the exact posterior of each masked token given the
unmasked ones (`masked_token_nll`): in a Markov chain it depends only on the nearest unmasked
neighbours u (a steps left) and w (b steps right), p(k) ~ P^a[u, k] P^b[k, w] (pi in place of P^a[u]
with no left neighbour, 1 in place of P^b[:, w] with none to the right).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from harness.config.schema import DataConfig
from harness.data.base import StreamData, check_eval_fraction, config_error, fingerprint, split_stream

MAX_VOCAB = 4096
"""The source keeps a dense V x V float64 matrix: 4096 -> 128 MiB; a 50k vocab would be 20 GB."""

CHAIN_LENGTH = 4096
"""Tokens per independent chain. The stream is many chains, each started from pi and advanced in
lock-step (one vectorised draw per step for all chains), concatenated; the one non-Markov jump
at each chain boundary touches 1/4096 of the transitions, far below what a loss curve resolves."""


def transition_matrix(vocab_size: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """(V, V) row-stochastic matrix, rows ~ Dirichlet(alpha)."""
    return rng.dirichlet(np.full(vocab_size, alpha), size=vocab_size)


def stationary_distribution(P: np.ndarray, tol: float = 1e-14, max_iter: int = 100_000) -> np.ndarray:
    """pi with pi P = pi, by power iteration from uniform (V^2 per step; eig would be V^3)."""
    pi = np.full(len(P), 1.0 / len(P))
    for _ in range(max_iter):
        nxt = pi @ P
        nxt /= nxt.sum()
        if np.abs(nxt - pi).sum() < tol:
            return nxt
        pi = nxt
    raise AssertionError(f"power iteration did not converge in {max_iter} steps")


def entropy_rate(P: np.ndarray, pi: np.ndarray) -> float:
    """H = -sum_i pi_i sum_j P_ij ln P_ij in nats (0 ln 0 = 0)."""
    logP = np.log(P, where=P > 0, out=np.zeros_like(P))
    return float(-(pi * (P * logP).sum(axis=1)).sum())


def sample_stream(
    P: np.ndarray, pi: np.ndarray, num_tokens: int, rng: np.random.Generator, chain_length: int = CHAIN_LENGTH
) -> np.ndarray:
    """num_tokens tokens (uint16) from independent stationary chains, concatenated."""
    V = len(P)
    length = min(chain_length, num_tokens)
    chains = math.ceil(num_tokens / length)
    # Row i of the CDF shifted by i makes one sorted array, so a single searchsorted samples the
    # successor of every chain at once: the successor of s is the first j with cdf[s, j] > u.
    cdf = np.cumsum(P, axis=1)
    cdf[:, -1] = 1.0
    flat = (cdf + np.arange(V)[:, None]).ravel()  # (V*V,)
    last_possible = V - 1 - np.argmax(P[:, ::-1] > 0, axis=1)  # if s+u rounds up to s+1
    out = np.empty((chains, length), dtype=np.uint16)
    state = np.minimum(np.searchsorted(np.cumsum(pi), rng.random(chains), side="right"), V - 1)
    out[:, 0] = state
    for t in range(1, length):
        col = np.searchsorted(flat, state + rng.random(chains), side="right") - state * V
        state = np.where(col < V, col, last_possible[state])
        out[:, t] = state
    return out.ravel()[:num_tokens]


def masked_token_nll(
    P: np.ndarray, pi: np.ndarray, x: torch.Tensor, mask: torch.Tensor, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(B, T) float64: -ln p(x_i | the unmasked tokens of its row) at masked positions, 0 elsewhere,
    for windows x (B, T) of the stationary chain. Messages from each side, one V x V product per
    position: left_i = (e_{x_{i-1}} or left_{i-1}) P from pi, right_i = P (e_{x_{i+1}} or right_{i+1})
    from ones; the posterior is left_i * right_i normalised. (Exact up to the chain joins: one
    transition in CHAIN_LENGTH is not Markov.)"""
    Pt = torch.as_tensor(P, dtype=torch.float64, device=device)
    x, mask = x.to(device).long(), mask.to(device)
    B, T = x.shape
    V = Pt.shape[0]
    onehot = torch.nn.functional.one_hot(x, V).double()  # (B, T, V)
    left = torch.empty(B, T, V, dtype=torch.float64, device=device)
    left[:, 0] = torch.as_tensor(pi, dtype=torch.float64, device=device)
    for i in range(1, T):
        prev = torch.where(mask[:, i - 1, None], left[:, i - 1], onehot[:, i - 1])
        left[:, i] = prev @ Pt
    right = torch.ones(B, T, V, dtype=torch.float64, device=device)
    for i in range(T - 2, -1, -1):
        nxt = torch.where(mask[:, i + 1, None], right[:, i + 1], onehot[:, i + 1])
        right[:, i] = nxt @ Pt.T
    post = left * right
    p = post.gather(2, x[..., None]).squeeze(2) / post.sum(dim=2)
    return torch.where(mask, -torch.log(p), torch.zeros_like(p)).cpu()


def build(cfg: DataConfig, vocab_size: int, seq_length: int) -> StreamData:
    V = vocab_size
    option = f"data.vocab_size={cfg.vocab_size}" if cfg.vocab_size is not None else "data.vocab_size=null"
    if V > MAX_VOCAB:
        raise config_error(
            f"{option} (V={V})",
            f"a markov source keeps a dense VxV transition matrix, at most V={MAX_VOCAB}",
            f"set data.vocab_size<={MAX_VOCAB}",
        )
    if not cfg.alpha > 0:
        raise config_error(f"data.alpha={cfg.alpha}", "must be > 0", "e.g. data.alpha=0.05")
    if cfg.num_tokens < 1:
        raise config_error(
            f"data.num_tokens={cfg.num_tokens}", "must be >= 1", "e.g. data.num_tokens=2000000"
        )
    check_eval_fraction(cfg.eval_fraction)
    matrix_seed, stream_seed = np.random.SeedSequence(cfg.seed).spawn(2)
    P = transition_matrix(V, cfg.alpha, np.random.default_rng(matrix_seed))
    pi = stationary_distribution(P)
    stream = sample_stream(P, pi, cfg.num_tokens, np.random.default_rng(stream_seed))
    train, eval = split_stream(stream, cfg.eval_fraction)
    params = {"name": "markov", "vocab_size": V, "alpha": cfg.alpha, "seed": cfg.seed}
    params["num_tokens"] = cfg.num_tokens
    data = StreamData(
        "markov",
        V,
        seq_length,
        train,
        eval if cfg.eval_fraction > 0 else None,
        fingerprint(params, stream.astype("<u2")),
        split_option=f"data.num_tokens={cfg.num_tokens}",
        loss_floor=entropy_rate(P, pi),
        facts={
            "alpha": cfg.alpha,
            "seed": cfg.seed,
            "marginal_entropy": float(-(pi * np.log(pi, where=pi > 0, out=np.zeros_like(pi))).sum()),
            "chain_length": CHAIN_LENGTH,
        },
    )
    data.masked_token_nll = functools.partial(masked_token_nll, P, pi)  # the masked-diffusion floor
    return data
