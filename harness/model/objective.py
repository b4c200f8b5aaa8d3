"""What the model learns to predict: the next token (autoregressive) or its masked tokens (masked diffusion).

Masked diffusion is LLaDA's objective as MegaDLMs trains it (`megatron/core/models/difflm/gpt_model.py`,
`difflm_forward_process` and the loss in `forward`; `pretrain_difflm.py`'s `loss_func`):

    t ~ U(eps, 1) per sequence                    (MegaDLMs: eps = 0; LLaDA: 1e-3)
    mask_i ~ Bernoulli(t), at least one per row   (a row with none gets one random position)
    input_i = mask_token where mask_i, else x_i
    loss = sum_i mask_i * CE(logits_i, x_i) / r_row / N

with r_row the row's realized mask ratio (masked count / length), the cross entropy at the token's
own position (no next-token shift) and N the non-padded positions (lowp's batches have no padding:
B x T). Attention has no causal mask. A share `difflm_varilen_prob` of micro-batches is cut to a
random length, MegaDLMs' `use_varilen_data` (length ~ U{2..T}) rounded up to the recipe's GEMM
multiple, so both backends see the same shapes (TE's FP8 GEMMs need multiples of 16, MXFP8's 32).

MegaDLMs un-shifts its GPT dataset's pair (input_ids[:, 1:], labels[:, :-1]: T - 1 tokens); lowp takes
the batch's inputs, the same T tokens, so no GEMM dimension changes.

Randomness: every micro-batch's masks come from a CPU generator seeded by (seed, rank, micro-batch
index), its lengths from one seeded by (seed, micro-batch index) so all ranks cut alike. The state is
that index, saved in the checkpoint: resume is exact at any world size, as the data's position is.

Eval: for each ratio t of `eval_t` and each eval batch, a mask drawn from a generator seeded by
(eval_mask_seed, batch, t) alone; the masked-token loss (the training loss at that fixed t) per t and
their mean, the midpoint rule for the bound, as loss/eval. A Markov source's exact floor for the same
masks comes from harness.data.markov.masked_token_nll.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from harness.config.schema import OBJECTIVES, ModelConfig, ObjectiveConfig
from harness.model.loss import weighted_cross_entropy

AUTOREGRESSIVE, MASKED_DIFFUSION = OBJECTIVES
VARILEN_MIN = 2
"""MegaDLMs' shortest cut (np.random.randint(low=2, ...))."""


def seeded(*key) -> torch.Generator:
    """A CPU generator seeded by a tuple of ints/strings (the data's seeded_generator rule)."""
    from harness.data.base import seeded_generator

    return seeded_generator(*key)


def set_causal(model: nn.Module, causal: bool) -> None:
    """Attention with (True) or without (False) the causal mask, in every block that has the switch."""
    for module in model.modules():
        if hasattr(module, "causal"):
            module.causal = causal


def draw_mask(shape: tuple[int, int], t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """(B, T) bool: each position masked with its row's probability t (B,); a row left with none gets
    one at a random position (MegaDLMs' rule). Always draws the same numbers for a shape."""
    B, T = shape
    mask = torch.rand((B, T), generator=gen) < t[:, None]
    extra = torch.randint(0, T, (B,), generator=gen)
    empty = ~mask.any(dim=1)
    mask[empty, extra[empty]] = True
    return mask


def token_weights(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) fp32 weights of each position's cross entropy: mask / realized ratio / (B x T), so the
    weighted sum is MegaDLMs' loss (mean over positions of mask * CE / ratio)."""
    B, T = mask.shape
    m = mask.float()
    ratio = m.sum(dim=1, keepdim=True) / T  # (B, 1), > 0: every row has a masked token
    return m / ratio / (B * T)


def varilen(T: int, multiple: int, gen: torch.Generator, prob: float) -> int:
    """A micro-batch's length: T, or with probability `prob` U{2..T} rounded up to `multiple` (at most T)."""
    u = torch.rand((), generator=gen).item()
    length = int(torch.randint(VARILEN_MIN, T + 1, (), generator=gen))
    if u >= prob:
        return T
    return min(T, multiple * math.ceil(length / multiple))


def masked_loss(model: nn.Module, noisy: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
    """sum(weights * CE(logits, targets)) of the model's logits at each position (no shift)."""
    cfg: ModelConfig = model.cfg
    return weighted_cross_entropy(
        model.hidden(noisy),
        model.lm_head,
        targets,
        weights,
        chunks=cfg.lm_head_loss_chunks,
        fused=cfg.cross_entropy_loss_fusion,
    )


class Autoregressive:
    """Next-token cross entropy under causal attention: what the GPT's own loss computes."""

    causal = True

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model.loss(x, y)

    def evaluate(self, model: nn.Module, batches, autocast: Callable, device) -> dict[str, float]:
        losses = []
        for x, y in batches:
            with autocast():
                losses.append(model.loss(x.to(device), y.to(device)))
        return {"loss": torch.stack(losses).mean().item()}

    def loss_floor(self, data, batches, device) -> float | None:
        return data.loss_floor

    def describe(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class MaskedDiffusion:
    """LLaDA/MegaDLMs masked diffusion (module docstring) for one rank's micro-batches."""

    causal = False

    def __init__(
        self, cfg: ObjectiveConfig, mask_token: int, multiple: int, seed: int, rank: int, source: str = ""
    ):
        self.cfg, self.mask_token, self.multiple = cfg, mask_token, multiple
        self.mask_token_source = source  # where the id came from (run.json)
        self.seed, self.rank = seed, rank
        self.micro_batches = 0  # the RNG's position: its state in the checkpoint

    def describe(self) -> dict:
        """The resolved mask token and where it came from, for run.json's provenance."""
        return {"mask_token": self.mask_token, "mask_token_source": self.mask_token_source}

    def corrupt(self, x: torch.Tensor, gen: torch.Generator, t: torch.Tensor):
        """(noisy inputs, (B, T) mask) of clean tokens x (B, T) at ratios t (B,), on x's device."""
        mask = draw_mask(tuple(x.shape), t, gen).to(x.device)
        return torch.where(mask, torch.full_like(x, self.mask_token), x), mask

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss of micro-batch x (the inputs; y, the shifted targets, is not used)."""
        index = self.micro_batches
        self.micro_batches += 1
        T = x.shape[1]
        length = varilen(
            T, self.multiple, seeded("difflm_varilen", self.seed, index), self.cfg.difflm_varilen_prob
        )
        x = x[:, :length]
        gen = seeded("difflm_mask", self.seed, self.rank, index)
        u = torch.rand((x.shape[0],), generator=gen)
        t = (1 - self.cfg.eps) * u + self.cfg.eps
        noisy, mask = self.corrupt(x, gen, t)
        return masked_loss(model, noisy, x, token_weights(mask))

    def eval_masks(self, batches) -> list[list[torch.Tensor]]:
        """Per eval batch, one fixed mask per ratio of eval_t (seeded by eval_mask_seed alone)."""
        out = []
        for b, (x, _) in enumerate(batches):
            row = []
            for j, t in enumerate(self.cfg.eval_t):
                gen = seeded("difflm_eval", self.cfg.eval_mask_seed, b, j)
                row.append(draw_mask(tuple(x.shape), torch.full((x.shape[0],), float(t)), gen))
            out.append(row)
        return out

    def evaluate(self, model: nn.Module, batches, autocast: Callable, device) -> dict[str, float]:
        """{"loss": the mean over eval_t, "t=0.1": ..., ...}: masked-token losses on the fixed masks."""
        per_t = [[] for _ in self.cfg.eval_t]
        for (x, _), masks in zip(batches, self.eval_masks(batches)):
            x = x.to(device)
            for j, mask in enumerate(masks):
                mask = mask.to(device)
                noisy = torch.where(mask, torch.full_like(x, self.mask_token), x)
                with autocast():
                    per_t[j].append(masked_loss(model, noisy, x, token_weights(mask)))
        return self._summarise([torch.stack(v).mean().item() for v in per_t])

    def _summarise(self, values: list[float]) -> dict[str, float]:
        out = {"loss": sum(values) / len(values)}
        out.update({f"t={t:g}": v for t, v in zip(self.cfg.eval_t, values)})
        return out

    def loss_floor(self, data, batches, device) -> float | None:
        """The source's exact masked-token loss on the eval masks (a Markov source's posterior), the
        mean over eval_t; None for a source without one."""
        nll = getattr(data, "masked_token_nll", None)
        if nll is None or not batches:
            return None
        per_t = [[] for _ in self.cfg.eval_t]
        for (x, _), masks in zip(batches, self.eval_masks(batches)):
            for j, mask in enumerate(masks):
                per_t[j].append(float((nll(x, mask, device) * token_weights(mask).double()).sum()))
        return self._summarise([sum(v) / len(v) for v in per_t])["loss"]

    def state_dict(self) -> dict:
        return {"micro_batches": self.micro_batches, "mask_token": self.mask_token}

    def load_state_dict(self, state: dict) -> None:
        """The RNG's position; a checkpoint trained with another mask token (tokenizer files changed
        since) is refused, naming the override that continues it."""
        saved = int(state.get("mask_token", self.mask_token))  # none saved: a checkpoint from before it was
        if saved != self.mask_token:
            raise ValueError(
                f"objective.mask_token: the checkpoint was trained with mask token {saved}, this run "
                f"resolves {self.mask_token} ({self.mask_token_source}); set objective.mask_token={saved}"
            )
        self.micro_batches = int(state["micro_batches"])


def per_t_row(result: dict[str, float], prefix: str) -> dict[str, float]:
    """An eval result's losses per mask ratio as metric keys `<prefix>/<t>` (none for autoregressive)."""
    return {f"{prefix}/{k[2:]}": v for k, v in result.items() if k.startswith("t=")}


def resolve_mask_token(cfg: ObjectiveConfig, model_vocab: int, data_vocab: int, tokenizer: bool) -> int:
    """objective.mask_token checked against the vocabularies: an id the data never produces (one at or
    above data_vocab) inside the model's embedding; a data tokenizer's own id (its reserved token) is
    taken as given. A bad one is a ValueError naming the option and the fix."""
    token = data_vocab if cfg.mask_token is None else cfg.mask_token
    option = f"objective.mask_token={cfg.mask_token}" + (
        f" (= data vocabulary {data_vocab})" if cfg.mask_token is None else ""
    )
    if token >= model_vocab or token < 0:
        raise ValueError(
            f"{option}: outside model.vocab_size={model_vocab}, and the data uses ids 0..{data_vocab - 1}; "
            f"set data.vocab_size<={model_vocab - 1} (a markov or synthetic source) or model.vocab_size>="
            f"{data_vocab + 1}, or objective.mask_token to a reserved token of the tokenizer"
        )
    if token < data_vocab and not tokenizer:
        raise ValueError(
            f"{option}: the data produces this id (its vocabulary is 0..{data_vocab - 1}); set "
            f"objective.mask_token=null or to an id in {data_vocab}..{model_vocab - 1}"
        )
    return token


def past_data(data_vocab: int) -> str:
    """The source of a mask token taken past the data's vocabulary."""
    return f"the first id past the data's vocabulary of {data_vocab} ids"


def choose_mask_token(
    model_vocab: int, data_vocab: int, offers: list[tuple[int, str]], produces: Callable[[int], bool]
) -> tuple[int, str]:
    """objective.mask_token=null where the model's tokenizer offers ids (harness.interop.hf_tokenizer,
    best first): (id, source) of the first offer inside the model's embedding that the data never
    produces (`produces(id)` False), else the first id past the data's vocabulary; a ValueError naming
    objective.mask_token and every offer's reason where none fits."""
    tried = []
    for token, source in [*offers, (data_vocab, past_data(data_vocab))]:
        if not 0 <= token < model_vocab:
            tried.append(f"{token}, {source}, is outside model.vocab_size={model_vocab}")
        elif produces(token):
            tried.append(f"{token}, {source}, is in the data")
        else:
            return token, source
    raise ValueError(
        f"objective.mask_token=null: no id fits the mask token ({'; '.join(tried)}); set "
        f"objective.mask_token to an id below {model_vocab} that the data never produces"
    )


def field_errors(cfg: ObjectiveConfig) -> list[str]:
    """One line per bad objective field (each naming the option and the fix)."""
    if cfg.name == AUTOREGRESSIVE:
        return []
    errs = []
    if not 0.0 <= cfg.difflm_varilen_prob <= 1.0:
        errs.append(
            f"objective.difflm_varilen_prob={cfg.difflm_varilen_prob}: a share; use a value in [0, 1]"
        )
    if not 0.0 <= cfg.eps < 1.0:
        errs.append(f"objective.eps={cfg.eps}: t ~ U(eps, 1) needs 0 <= eps < 1 (LLaDA: 1e-3)")
    if not cfg.eval_t or not all(0.0 < t <= 1.0 for t in cfg.eval_t):
        errs.append(f"objective.eval_t={list(cfg.eval_t)}: mask ratios in (0, 1]; e.g. [0.1,0.3,0.5,0.7,0.9]")
    return errs


def config_errors(
    cfg: ObjectiveConfig, data_vocab: int | None, model_vocab: int, offers: list[tuple[int, str]] = ()
) -> list[str]:
    """field_errors, and the mask token's room where the data's vocabulary is known from the config
    (`data_vocab`: a markov or synthetic source's, which draws every id below it; None: known only once
    the source is read); `offers`: the model's tokenizer's (choose_mask_token)."""
    errs = field_errors(cfg)
    if cfg.name == MASKED_DIFFUSION and data_vocab is not None:
        try:
            if cfg.mask_token is None and offers:
                choose_mask_token(model_vocab, data_vocab, list(offers), lambda t: t < data_vocab)
            else:
                resolve_mask_token(cfg, model_vocab, data_vocab, tokenizer=False)
        except ValueError as exc:
            errs.append(str(exc))
    return errs


def build_objective(
    cfg: ObjectiveConfig,
    model_cfg: ModelConfig,
    data,
    multiple: int,
    seed: int,
    rank: int,
    offers: list[tuple[int, str]] = (),
) -> Autoregressive | MaskedDiffusion:
    """The run's objective; `data` the token source (its vocabulary bounds the mask token, and it must
    never produce it); `offers`: the mask tokens a Hugging Face model's tokenizer offers, best first,
    taken (choose_mask_token) where objective.mask_token is null."""
    if cfg.name == AUTOREGRESSIVE:
        return Autoregressive()
    if cfg.name != MASKED_DIFFUSION:
        raise ValueError(f"objective.name={cfg.name}: use one of {', '.join(OBJECTIVES)}")
    errs = field_errors(cfg)
    if errs:
        raise ValueError(errs[0])
    if cfg.mask_token is None and offers:
        token, source = choose_mask_token(model_cfg.vocab_size, data.vocab_size, list(offers), data.produces)
    else:
        token = resolve_mask_token(cfg, model_cfg.vocab_size, data.vocab_size, "tokenizer" in data.facts)
        source = "objective.mask_token" if cfg.mask_token is not None else past_data(data.vocab_size)
    return MaskedDiffusion(cfg, token, multiple, seed, rank, source)
