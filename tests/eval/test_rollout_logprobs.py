"""A rollout's log-probs are the ones the trainer recomputes: each sampled token's log-probability under the
distribution it was drawn from equals, in fp32, the full forward's log_softmax(logits / temperature) at its
position, for left-padded prompts of different lengths, with and without an eos ending the turn."""

import pytest
import torch

from qlm_core.decode.sampling import Sampling, generate_rows, left_pad
from qlm_core.models.gpt import GPTModel
from qlm_core.models.spec import ModelSpec

SPEC = ModelSpec(model_type="qwen2", vocab_size=97, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                 num_attention_heads=4, num_query_groups=2, kv_channels=8, max_position_embeddings=128,
                 rope_theta=10000.0, norm_epsilon=1e-6, qkv_bias=True, tie_word_embeddings=False)


def _recomputed(model, prompt, tokens, temperature):
    """The training side: one forward over prompt + completion, log_softmax(logits / T) of each completion token."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids)[0].float()
    scaled = logits / temperature if temperature > 0 else logits
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return scaled.log_softmax(-1)[positions, torch.tensor(tokens)]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_rollout_logprobs_equal_the_training_forward(temperature):
    torch.manual_seed(0)
    model = GPTModel(SPEC, padded_vocab=SPEC.vocab_size).eval()
    prompts = [[5, 9, 11, 3], [7], [2, 4, 6, 8, 10, 12, 14]]
    ids, mask = left_pad(prompts, pad_id=0)
    sampling = Sampling(temperature=temperature, seed=3)
    first = generate_rows(model, ids, mask, max_new_tokens=12, eos_token_id=None, sampling=sampling)
    eos = first[1].tokens[3]  # the same draws again end row 1 with it (or earlier)
    rows = generate_rows(model, ids, mask, max_new_tokens=12, eos_token_id=eos, sampling=sampling)
    ended = 0
    for prompt, row in zip(prompts, rows, strict=True):
        trained = row.tokens + ([row.eos_token] if row.eos_token is not None else [])
        ended += row.eos_token is not None
        assert len(row.logprobs) == len(trained) > 0
        expected = _recomputed(model, prompt, trained, temperature)
        assert torch.allclose(torch.tensor(row.logprobs), expected, atol=1e-5, rtol=0), (row, expected)
    assert rows[1].eos_token == eos and ended >= 1


def test_top_k_and_top_p_renormalise_the_logprobs():
    """With top-k / top-p the token comes from the truncated distribution: its log-prob is that one's (higher than
    the full distribution's), which is what truncated importance sampling corrects for."""
    torch.manual_seed(0)
    model = GPTModel(SPEC, padded_vocab=SPEC.vocab_size).eval()
    ids, mask = left_pad([[5, 9, 11]], pad_id=0)
    full = generate_rows(model, ids, mask, max_new_tokens=6, eos_token_id=None, sampling=Sampling(0.9, seed=1))[0]
    top = generate_rows(model, ids, mask, max_new_tokens=6, eos_token_id=None,
                        sampling=Sampling(0.9, top_k=5, seed=1))[0]
    recomputed = _recomputed(model, [5, 9, 11], top.tokens, 0.9)
    assert all(a >= b - 1e-6 for a, b in zip(top.logprobs, recomputed.tolist(), strict=True))
    assert any(a > b + 1e-3 for a, b in zip(top.logprobs, recomputed.tolist(), strict=True))
    assert torch.allclose(torch.tensor(full.logprobs), _recomputed(model, [5, 9, 11], full.tokens, 0.9), atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_copies_share_the_prompt_and_answer_as_repeated_rows(temperature):
    """copies=n (a rollout's group: the prompt read once, its cache shared) answers as the prompts repeated n times
    do: the same draws from the same stream, the same tokens, log-probs within fp32 rounding, each the training
    forward's."""
    torch.manual_seed(0)
    model = GPTModel(SPEC, padded_vocab=SPEC.vocab_size).eval()
    prompts = [[5, 9, 11, 3], [7], [2, 4, 6, 8, 10, 12, 14]]
    sampling = Sampling(temperature=temperature, seed=5)
    ids, mask = left_pad(prompts, pad_id=0)
    shared = generate_rows(model, ids, mask, max_new_tokens=10, eos_token_id=None, sampling=sampling, copies=3)
    ids, mask = left_pad([p for p in prompts for _ in range(3)], pad_id=0)
    repeated = generate_rows(model, ids, mask, max_new_tokens=10, eos_token_id=None, sampling=sampling)
    assert len(shared) == 9
    assert [r.tokens for r in shared] == [r.tokens for r in repeated]
    if temperature > 0:
        assert len({tuple(r.tokens) for r in shared[:3]}) > 1  # the copies sample apart
    for row, (a, b) in enumerate(zip(shared, repeated, strict=True)):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)
        expected = _recomputed(model, prompts[row // 3], a.tokens, temperature or 1.0)
        if temperature > 0:
            assert torch.allclose(torch.tensor(a.logprobs), expected, atol=1e-5, rtol=0)


def test_sampling_draws_each_token_with_its_probability():
    """40,000 draws of one distribution (temperature 0.8, top-k 6 of 10): each kept token's share is its
    renormalised probability (within 4 standard errors), a token top-k dropped is never drawn, and the log-prob
    returned is the drawn token's under that distribution."""
    from qlm_core.decode.sampling import _choose

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -0.5, 1.5, -2.0, 0.2])
    sampling = Sampling(temperature=0.8, top_k=6, seed=9)
    chosen, logprobs = _choose(logits.expand(40_000, 10), sampling, torch.Generator().manual_seed(9))
    kept = (logits / 0.8).topk(6).indices
    probs = torch.full((10,), 0.0)
    probs[kept] = (logits[kept] / 0.8).softmax(-1)
    counts = torch.bincount(chosen, minlength=10).double() / 40_000
    error = (probs.double() * (1 - probs.double()) / 40_000).sqrt()
    assert ((counts - probs.double()).abs() <= 4 * error + 1e-12).all(), (counts, probs)
    assert torch.allclose(logprobs, probs.log()[chosen], atol=1e-6)


def test_nan_or_inf_logits_are_an_error_not_a_token():
    """A diverged model's logits give no distribution: sampling says so instead of drawing the last token."""
    from qlm_core.decode.sampling import _choose

    for bad in (float("nan"), float("inf")):
        logits = torch.randn(3, 10)
        logits[1, 2] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            _choose(logits, Sampling(temperature=1.0), torch.Generator().manual_seed(0))
