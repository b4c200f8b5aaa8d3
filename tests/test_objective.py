"""The masked-diffusion objective on hand-computed tiny cases: mask, weights, loss, floor, RNG state."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness.config.schema import ModelConfig, ObjectiveConfig
from harness.data.markov import masked_token_nll
from harness.model.gpt import GPT, flops_per_token
from harness.model.loss import chunked_linear_cross_entropy, weighted_cross_entropy
from harness.model.objective import (
    MaskedDiffusion,
    build_objective,
    draw_mask,
    resolve_mask_token,
    set_causal,
    token_weights,
    varilen,
)

P2 = np.array([[0.9, 0.1], [0.2, 0.8]])
PI2 = np.array([2 / 3, 1 / 3])  # pi P = pi: 2/3*0.9 + 1/3*0.2 = 2/3


def test_mask_at_least_one_per_row_and_all_at_t_one():
    gen = torch.Generator().manual_seed(0)
    none = draw_mask((5, 7), torch.zeros(5), gen)
    assert none.sum(dim=1).tolist() == [1] * 5  # t = 0 masks nothing: each row gets its one position
    assert draw_mask((3, 4), torch.ones(3), gen).all()


def test_weights_divide_by_the_realized_ratio_over_all_positions():
    mask = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0]], dtype=torch.bool)
    # row 0: ratio 2/4 -> 1 / 0.5 / 8 = 0.25 at its masked positions; row 1: ratio 1/4 -> 1 / 0.25 / 8 = 0.5
    expected = torch.tensor([[0.25, 0, 0, 0.25], [0, 0.5, 0, 0]])
    assert torch.equal(token_weights(mask), expected)


def test_weighted_loss_by_hand_and_chunked_equals_whole():
    torch.manual_seed(0)
    h = torch.randn(2, 4, 8)
    head = torch.nn.Linear(8, 16, bias=False)
    targets = torch.randint(0, 16, (2, 4))
    mask = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0]], dtype=torch.bool)
    w = token_weights(mask)
    ce = F.cross_entropy(head(h).view(-1, 16), targets.view(-1), reduction="none").view(2, 4)
    by_hand = 0.25 * (ce[0, 0] + ce[0, 3]) + 0.5 * ce[1, 1]  # MegaDLMs: mean of mask * CE / ratio
    whole = weighted_cross_entropy(h, head, targets, w)
    assert torch.allclose(whole, by_hand)
    h16 = h.bfloat16().requires_grad_()
    ref = weighted_cross_entropy(h16, head.bfloat16(), targets, w)
    ref.backward()
    g_ref = h16.grad.clone()
    h16.grad = None
    chunked = weighted_cross_entropy(h16, head.bfloat16(), targets, w, chunks=3)
    chunked.backward()
    assert torch.allclose(chunked, ref, rtol=1e-5)
    assert torch.allclose(h16.grad.float(), g_ref.float(), atol=1e-2)
    # the unweighted chunked path is untouched: its mean
    plain = chunked_linear_cross_entropy(h, head.weight, targets, 2)
    assert torch.allclose(plain, ce.mean(), atol=1e-2)  # bf16 logits


def test_markov_floor_is_the_posterior_between_the_nearest_neighbours():
    x = torch.tensor([[0, 1, 1], [0, 1, 0]])
    mask = torch.tensor([[False, True, False], [True, False, False]])
    nll = masked_token_nll(P2, PI2, x, mask)
    # row 0: x1 = 1 between 0 and 1: p ~ P[0,k] P[k,1] = (0.09, 0.08) -> p(1) = 8/17
    assert nll[0, 1].item() == pytest.approx(-math.log(0.08 / 0.17))
    # row 1: x0 = 0 with no left neighbour: p ~ pi_k P[k,1] = (2/3*0.1, 1/3*0.8) -> p(0) = 0.2
    assert nll[1, 0].item() == pytest.approx(-math.log(0.2))
    assert nll[~mask].abs().sum() == 0
    # two masked in a row, then nothing to the right: x = 0 ? ? with x1 = 1: p ~ P[0,k] (no right)
    x3 = torch.tensor([[0, 1, 0, 1]])
    m3 = torch.tensor([[False, True, True, False]])
    p2 = P2 @ P2  # the right neighbour is two steps away from x1
    post = P2[0] * p2[:, 1]
    assert masked_token_nll(P2, PI2, x3, m3)[0, 1].item() == pytest.approx(-math.log(post[1] / post.sum()))
    last = masked_token_nll(P2, PI2, torch.tensor([[0, 1]]), torch.tensor([[False, True]]))
    assert last[0, 1].item() == pytest.approx(-math.log(0.1))


def test_variable_length_is_rounded_to_the_gemm_multiple():
    gen = torch.Generator().manual_seed(1)
    lengths = {varilen(64, 16, gen, 1.0) for _ in range(50)}
    assert lengths <= {16, 32, 48, 64} and len(lengths) > 1
    assert varilen(64, 16, gen, 0.0) == 64


class _Data:
    vocab_size, facts = 255, {}


def test_mask_token_must_be_an_id_the_data_never_produces():
    cfg = ObjectiveConfig(name="masked_diffusion")
    assert resolve_mask_token(cfg, 256, 255, False) == 255
    with pytest.raises(ValueError, match=r"^objective.mask_token=None .*data.vocab_size<=255") as e:
        resolve_mask_token(cfg, 256, 256, False)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="the data produces this id"):
        resolve_mask_token(ObjectiveConfig(name="masked_diffusion", mask_token=3), 256, 255, False)
    assert resolve_mask_token(ObjectiveConfig(mask_token=3), 256, 255, True) == 3  # a tokenizer's reserved id


def test_eval_masks_do_not_depend_on_the_run_seed_and_the_rng_state_resumes():
    cfg = ObjectiveConfig(name="masked_diffusion", difflm_varilen_prob=0.5)
    a, b = (build_objective(cfg, ModelConfig(vocab_size=256), _Data(), 16, seed, 0) for seed in (0, 1))
    batches = [(torch.randint(0, 255, (2, 32)), None)] * 2
    ma, mb = a.eval_masks(batches), b.eval_masks(batches)
    assert all(torch.equal(x, y) for ra, rb in zip(ma, mb) for x, y in zip(ra, rb))
    assert not torch.equal(ma[0][0], ma[1][0])  # each batch its own mask
    model = _tiny_model()
    x = torch.randint(0, 255, (2, 32))
    first = [a.loss(model, x, None) for _ in range(3)]
    resumed = MaskedDiffusion(cfg, 255, 16, 0, 0)
    resumed.load_state_dict({"micro_batches": 1})
    assert [resumed.loss(model, x, None) for _ in range(2)] == first[1:]


def _tiny_model() -> GPT:
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=32)
    return GPT(cfg, _PlainOps())


class _PlainOps:
    def linear(self, name, i, o, bias):
        return torch.nn.Linear(i, o, bias=bias)

    def activation(self, name, kind):
        return torch.nn.GELU()

    def norm(self, name, cfg):
        from harness.model.gpt import norm

        return norm(cfg)


def test_bidirectional_attention_sees_later_tokens_and_flops_count_it():
    torch.manual_seed(0)
    model = _tiny_model()
    x = torch.randint(0, 255, (1, 8))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % 255
    with torch.no_grad():
        assert torch.equal(model(x)[0, 0], model(y)[0, 0])  # causal: position 0 cannot see the last
        set_causal(model, False)
        assert not torch.equal(model(x)[0, 0], model(y)[0, 0])
    cfg = model.cfg
    attn = cfg.num_layers * cfg.hidden_size * cfg.seq_length
    assert flops_per_token(cfg, 100, causal=False) - flops_per_token(cfg, 100) == 6 * attn


class _Scripted(torch.nn.Module):
    """Logits that favour token 7 everywhere, more strongly at later positions; records each input."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.clone())
        logits = torch.zeros(*x.shape, 16)
        logits[..., 7] = torch.arange(x.shape[1], dtype=torch.float32)
        return logits


def test_low_confidence_remasking_fixes_the_most_confident_masked_positions_first():
    from harness.model.unmask import generate, transfer_counts

    assert transfer_counts(10, 4) == [3, 3, 2, 2]
    model = _Scripted()
    prompt = torch.tensor([[1, 2]])
    out = generate(model, prompt, gen_length=4, steps=2, mask_token=15)
    assert out.tolist() == [[1, 2, 7, 7, 7, 7]]
    # step 1 fixed the two most confident (the last two), step 2 the rest
    assert model.seen[1].tolist() == [[1, 2, 15, 15, 7, 7]]
    blocks = _Scripted()
    generate(blocks, prompt, gen_length=4, steps=2, mask_token=15, block_length=2)
    assert blocks.seen[1].tolist() == [[1, 2, 7, 7, 15, 15]]  # the first block is done before the second


def test_validation_refuses_bad_objective_fields_in_one_line_each():
    from harness.model.objective import config_errors

    cfg = ObjectiveConfig(name="masked_diffusion", difflm_varilen_prob=2.0, eps=1.0, eval_t=[0.0])
    errs = config_errors(cfg, 256, 256)
    assert [e.split("=")[0] for e in errs] == [
        "objective.difflm_varilen_prob",
        "objective.eps",
        "objective.eval_t",
        "objective.mask_token",
    ]
    assert config_errors(ObjectiveConfig(name="masked_diffusion"), None, 256) == []  # a tokenizer decides
    assert config_errors(ObjectiveConfig(eps=5.0), 256, 256) == []  # autoregressive reads none of them


def test_each_mask_ratios_eval_loss_is_a_metric_key_analysis_knows():
    from analysis import keys as A
    from harness.lifecycle import metrics as M
    from harness.model.objective import per_t_row

    assert A.LOSS_EVAL_AT_T_PREFIX == M.LOSS_EVAL_AT_T + "/"
    assert per_t_row({"loss": 1.0, "t=0.1": 2.0, "t=0.9": 3.0}, M.LOSS_EVAL_AT_T) == {
        "loss/eval_at_t/0.1": 2.0,
        "loss/eval_at_t/0.9": 3.0,
    }
    assert per_t_row({"loss": 1.0}, M.LOSS_EVAL_AT_T) == {}  # autoregressive: loss/eval alone
