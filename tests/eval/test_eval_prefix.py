"""The qlm backend's loglikelihood with shared contexts (qlm_core/eval/prefix_cache.py) gives every request the
log-likelihood and greedy flag of scoring it alone on its own row, as lm-eval's hf backend does: several contexts,
continuations of different lengths (one token too), a batch size that splits groups, a sliding window shorter than
the contexts, a context long enough to be cut from the left, and a context that only one request has."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install '.[eval]')")

from qlm_core.eval.lm import QlmLM  # noqa: E402
from qlm_core.eval.prefix_cache import split_shared  # noqa: E402
from qlm_core.eval.scoring import score_plain  # noqa: E402

MAX_LENGTH = 48


@torch.no_grad()
def alone(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """One request on its own: the whole row's logits, cut from the left as lm-eval's hf backend cuts it."""
    row = (context + continuation)[-(MAX_LENGTH + 1):][:-1]
    log_probs = F.log_softmax(model(torch.tensor([row])).float(), dim=-1)[0, -len(continuation):]
    target = torch.tensor(continuation)
    return float(log_probs.gather(-1, target[:, None]).sum()), bool((log_probs.argmax(-1) == target).all())


@torch.no_grad()
def greedy_continuation(model, context: list[int], length: int) -> list[int]:
    tokens = list(context)
    for _ in range(length):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(context):]


def make_requests(model, vocab: int) -> list[tuple]:
    generator = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    requests = []
    for number, (context_length, continuation_lengths) in enumerate(
            [(30, [5, 1, 12, 7]), (3, [2, 9, 1]), (17, [4, 4, 6, 1, 3]), (41, [3, 6, 2, 12]), (9, [8])]):
        context = tokens(context_length)
        continuations = [tokens(n) for n in continuation_lengths]
        if number == 0:  # one greedy continuation among the choices, so that is_greedy is True somewhere
            continuations[0] = greedy_continuation(model, context, 5)
        requests += [((f"c{number}", f"a{i}"), context, cont) for i, cont in enumerate(continuations)]
    generator.manual_seed(1)
    return [requests[i] for i in torch.randperm(len(requests), generator=generator).tolist()]


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])  # mistral: sliding window 8, shorter than most contexts
@pytest.mark.parametrize("batch_size", [3, 16])
def test_shared_contexts_score_as_each_request_alone(hf_models, kind, batch_size):
    lm = QlmLM(str(hf_models[kind]), batch_size=batch_size, max_length=MAX_LENGTH, device="cpu")
    requests = make_requests(lm.model, lm.model.spec.vocab_size)
    groups, plain = split_shared(requests, MAX_LENGTH)
    # the 41-token context is cut from the left for its 12-token continuation: that request alone stays plain
    cut = [i for i, (_, ctx, cont) in enumerate(requests) if len(ctx) + len(cont) > MAX_LENGTH + 1]
    assert len(cut) == 1 and cut[0] in plain
    assert sorted(len(g.members) for g in groups) == [3, 3, 4, 5] and len(plain) == 2

    cached = []
    lm.cache_hook.add_partial = lambda kind_, key, answer: cached.append((kind_, key, answer))
    fed = []  # token slots (padding too) through the model: sharing runs fewer than one row per request
    handle = lm.model.embedding.register_forward_hook(lambda _m, args, _out: fed.append(args[0].numel()))
    try:
        answers = lm._loglikelihood_tokens(requests)
        shared_slots = sum(fed)
        fed.clear()
        score_plain(lm.model, requests, batch_size, MAX_LENGTH)
    finally:
        handle.remove()
    expected = [alone(lm.model, ctx, cont) for _, ctx, cont in requests]
    assert len(answers) == len(requests)
    for (key, _, _), (logprob, greedy), (want_logprob, want_greedy) in zip(requests, answers, expected, strict=True):
        assert abs(logprob - want_logprob) <= 1e-5 and greedy == want_greedy, (key, logprob, want_logprob)
    assert any(greedy for _, greedy in expected) and not all(greedy for _, greedy in expected)
    assert cached == [("loglikelihood", key, answer) for (key, _, _), answer in zip(requests, answers, strict=True)]
    assert shared_slots < 0.75 * sum(fed)


def test_rolling_and_unshared_requests_take_the_plain_path(hf_models):
    requests = [(None, [1, 2, 3], [4, 5]), (None, [1, 2], [3]), (None, [7] * 40, [8] * 10), (None, [7] * 40, [9])]
    groups, plain = split_shared(requests, max_length=MAX_LENGTH)  # [7]*40 + 10 tokens is cut: no group of two
    assert groups == [] and plain == [0, 1, 2, 3]


# mistral: its 8-token window slides during decoding; qwen2_swa: on its last two layers only; glm4: GLM's RoPE pairs
@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen2_swa", "glm4", "gemma3", "gemma2", "ernie4_5_moe", "opt",
                                  "bloom", "mpt"])
def test_batched_decoding_with_a_kv_cache_equals_greedy_without_one(hf_models, moe_models, kind):
    """generate_rows: left-padded rows of different lengths, the cache written in place (KVCache.reserve), each
    step's one query against its row's keys (AttentionInputs.key_mask) and finished rows dropped from the batch
    (KVCache.select) give the tokens of transformers' model re-run on each row whole, without a cache."""
    from transformers import AutoModelForCausalLM

    from qlm_core.decode.sampling import generate_rows, left_pad

    path = {**hf_models, **moe_models}[kind]
    hf = AutoModelForCausalLM.from_pretrained(path).eval()

    @torch.no_grad()
    def transformers_greedy(context: list[int], length: int) -> list[int]:
        tokens = list(context)
        for _ in range(length):
            tokens.append(int(hf(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
        return tokens[len(context):]

    lm = QlmLM(str(path), batch_size=4, max_length=MAX_LENGTH, device="cpu")
    generator = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, lm.model.spec.vocab_size, (n,), generator=generator).tolist() for n in (3, 11, 6)]
    ids, mask = left_pad(contexts, 0)
    expected = [transformers_greedy(c, 14) for c in contexts]
    rows = generate_rows(lm.model, ids, mask, max_new_tokens=14, eos_token_id=None)
    assert [row.tokens for row in rows] == expected
    # an eos that ends the first row early: the finished row leaves the batch, the others go on as before
    eos = next((t for i, t in enumerate(expected[0]) if i and t not in expected[0][:i]
                and any(t not in e[:i + 2] for e in expected[1:])), None)
    if eos is None:  # no token ends one row early but not the others: tiny ERNIE MoE / OPT / BLOOM repeat one token
        # per row, tiny MPT's rows share theirs
        assert kind in ("ernie4_5_moe", "opt", "bloom", "mpt")
        assert kind == "mpt" or all(len(set(tokens[1:])) == 1 for tokens in expected)
        return
    rows = generate_rows(lm.model, ids, mask, max_new_tokens=14, eos_token_id=eos)
    cut = [tokens[:tokens.index(eos)] if eos in tokens else tokens for tokens in expected]
    assert [row.tokens for row in rows] == cut and len(cut[0]) < 14 and max(map(len, cut)) > len(cut[0])
    assert [row.finish for row in rows] == ["stop" if eos in tokens else "length" for tokens in expected]
