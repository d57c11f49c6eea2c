"""MoE routing replay (R3): a rollout records the experts every token it fed was routed to, the rollout batch carries
them, and the trainer's MoE layers route each token to those experts (weighed by their own router's probabilities,
so the router still trains), or only count where their own choice differs; metrics.jsonl reports that count."""

from __future__ import annotations

import pytest
import torch
from helpers import metrics
from parallel_cases import MOE, MOE_TRAINING, SPEC

from qlm_core.config import MoeConfig, OptimConfig, ParallelConfig, load_recipe
from qlm_core.decode.sampling import Sampling, generate_rows, left_pad
from qlm_core.models import moe as moe_module
from qlm_core.models.gpt import GPTModel
from qlm_core.models.moe import MoELayer, MoeTracker
from qlm_core.models.runtime import ParallelOptions
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Engine
from qlm_core.train.objectives.grpo import GrpoObjective
from qlm_core.train.objectives.grpo_loss import GrpoLoss
from qlm_core.train.objectives.recipe import recipe_objective
from qlm_core.train.rewards import Rewards, RewardSource
from qlm_core.train.rollouts import RolloutConfig, rollout
from qlm_core.train.trainer import Trainer

MOE_LAYERS = MOE.moe.num_moe_layers(MOE.num_layers)
SEQ, EOS = 32, 7


def _model(spec=MOE) -> GPTModel:
    torch.manual_seed(0)
    model = GPTModel(spec, moe_options=MOE_TRAINING)
    model.reset_parameters(std=0.3, generator=torch.Generator().manual_seed(1))  # routers with clear choices
    return model.eval()


def _forward_routes(model: GPTModel, tokens: list[int]) -> torch.Tensor:
    """The routes one whole forward of `tokens` takes, [tokens, MoE layers, k]."""
    model.moe.tracker.recording = []
    with torch.no_grad():
        model.hidden_states(torch.tensor([tokens]))
    routes = torch.stack(model.moe.tracker.recording, dim=2)[:, 0]
    model.moe.tracker.recording = None
    return routes


def test_decoding_records_the_routes_of_every_token_it_fed():
    """Left-padded prompts of different lengths, sampled answers ending at an eos (one id in six: rows leave the
    batch at different steps) or at the length: each row's record is its prompt's routes then one per new token but
    the last, exactly what a whole forward of those tokens takes."""
    model = _model()
    prompts = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33], [41], [51, 52, 53, 54]]
    ids, mask = left_pad(prompts, 0)
    generations = generate_rows(model, ids, mask, max_new_tokens=8, eos_token_id=set(range(0, MOE.vocab_size, 6)),
                                sampling=Sampling(temperature=1.0, seed=10), record_routes=True)
    assert {g.finish for g in generations} == {"stop", "length"}
    for prompt, generation in zip(prompts, generations, strict=True):
        fed = prompt + generation.tokens[:len(generation.tokens) - (generation.eos_token is None)]
        assert generation.routes.shape == (len(fed), MOE_LAYERS, MOE.moe.topk)
        assert torch.equal(generation.routes.long(), _forward_routes(model, fed))
    shared = generate_rows(model, ids, mask, max_new_tokens=8, eos_token_id=set(range(0, MOE.vocab_size, 6)),
                           sampling=Sampling(temperature=1.0, seed=6), record_routes=True, copies=2)
    for row, generation in enumerate(shared):  # a group's copies share the prompt's routes
        fed = prompts[row // 2] + generation.tokens[:len(generation.tokens) - (generation.eos_token is None)]
        assert torch.equal(generation.routes.long(), _forward_routes(model, fed))
    plain = generate_rows(_model(SPEC), ids, mask, max_new_tokens=3, eos_token_id=None, record_routes=True)
    assert all(g.routes is None for g in plain)  # a dense model records nothing


@pytest.mark.parametrize("score, pre_softmax, bias", [("softmax", False, False), ("softmax", True, False),
                                                      ("sigmoid", False, False), ("sigmoid", False, True)])
def test_a_replayed_route_is_weighed_as_the_router_weighs_its_own(score, pre_softmax, bias):
    """expert_weights of the router's own choice are route()'s probabilities, bit for bit, for every score function:
    a replay of the routes the rollout chose gives the trainer the rollout's expert weights."""
    from dataclasses import replace

    spec = replace(MOE.moe, score_function=score, pre_softmax=pre_softmax, expert_bias=bias)
    logits = torch.randn(64, spec.num_experts, generator=torch.Generator().manual_seed(3))
    expert_bias = torch.randn(spec.num_experts) if bias else None
    probs, indices = moe_module.route(logits, spec, expert_bias)
    assert torch.equal(moe_module.expert_weights(logits, spec, indices), probs)


def _layer(replay: bool):
    torch.manual_seed(0)
    layer = MoELayer(16, MOE.moe, ParallelOptions(), MoeConfig(aux_loss_coeff=0.01), MoeTracker(replay=replay), 0,
                     torch.float32)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.5)
    return layer


def test_a_replayed_route_takes_the_given_experts_and_still_trains_the_router(monkeypatch):
    """The output is the layer's with the given experts chosen (its router's probabilities weigh them), tokens
    without a record (-1) route themselves, the router's weight gets a gradient, and the records count the tokens whose
    own choice differed. replay False: the layer's own routes, the same count."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2, 16, generator=g)
    given = torch.rand(2, 6, MOE.moe.num_experts, generator=g).argsort(-1)[..., :MOE.moe.topk].to(torch.int32)
    given[:, -1] = -1  # [b, s, k]: the last position of each row has no record
    replayed, own = _layer(True), _layer(False)
    x1 = x.clone().requires_grad_()
    out = replayed(x1, given)
    out.sum().backward()
    assert replayed.router.weight.grad is not None and replayed.router.weight.grad.abs().sum() > 0

    real = moe_module.route
    rows = given.transpose(0, 1).reshape(-1, MOE.moe.topk)

    def forced(logits, moe, bias=None):  # the layer's own routing, with the given experts chosen
        indices = torch.where(rows[:, :1] >= 0, rows.long(), real(logits, moe, bias)[1])
        return moe_module.expert_weights(logits, moe, indices), indices
    monkeypatch.setattr(moe_module, "route", forced)
    expected = _layer(True)(x.clone().requires_grad_())
    monkeypatch.setattr(moe_module, "route", real)
    assert torch.allclose(out, expected, atol=1e-6, rtol=0)
    unreplayed = _layer(True)(x.clone().requires_grad_())
    assert not torch.allclose(out, unreplayed, atol=1e-3)  # the given routes mattered

    own_out = own(x.clone().requires_grad_(), given)
    assert torch.equal(own_out, unreplayed)
    own_choice = real(own.router(x.reshape(-1, 16)), MOE.moe)[1]
    differ = (own_choice.sort(-1).values != rows.long().sort(-1).values).any(-1) & (rows[:, 0] >= 0)
    for layer in (replayed, own):
        record = layer.tracker.take_records()[-1]
        assert record.route_mismatch.tolist() == [float(differ.sum()), 10.0]
    assert 0 < differ.sum() < 10


def _rollout_engine(replay: bool | None, dtype=torch.float32):
    loss = GrpoLoss(loss_type="dapo", max_completion_length=10)
    return Engine(MOE, ParallelConfig(), Grid.single(), micro_batch_size=4, global_batch_size=8, seq_length=SEQ,
                  dtype=dtype, optim=OptimConfig(lr=1e-3), seed=3, moe=MOE_TRAINING,
                  objective=GrpoObjective(loss, routing_replay=replay))


@pytest.fixture
def odd_reward(tmp_path, monkeypatch):
    (tmp_path / "toy_routes_rewards.py").write_text(
        "def odd(prompt, completion, record):\n    return float(len(completion.split()) % 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return Rewards([RewardSource("toy_routes_rewards:odd")])


def test_a_rollout_batch_carries_its_routes_and_the_trainer_routes_them_again(odd_reward):
    """fp32 in one process: the trainer's own routers choose every recorded route again (mismatch 0), the padding
    has none (-1), and its log-probs are the rollout's."""
    engine = _rollout_engine(True)
    config = RolloutConfig(num_generations=4, max_completion_length=10, sampling=Sampling(temperature=1.0, seed=5))
    batch, _ = rollout(engine.chunks[0], [[11, 12, 13, 14, 15], [21, 22]], [{"prompt": "a"}, {"prompt": "b"}],
                       config, odd_reward, lambda ids: " ".join(map(str, ids)), seq_length=SEQ, eos_token_id=EOS,
                       pad_id=0)
    assert batch.routes.shape == (8, SEQ, MOE_LAYERS, MOE.moe.topk)
    fed = (batch.routes[..., 0, 0] >= 0)
    lengths = fed.sum(dim=1)
    assert torch.equal(fed, torch.arange(SEQ)[None] < lengths[:, None])  # every input token, then none
    assert torch.equal(lengths, (batch.labels >= 0).int().argmax(1) + (batch.labels >= 0).sum(1))
    result = engine.train_step(batch)
    assert result.moe["moe_route_mismatch"] == 0.0
    assert result.figures["train_rollout_logprob_abs_diff/max"] <= 1e-5


def test_the_recipe_chooses_replay_or_comparison(tmp_path):
    (tmp_path / "r.toml").write_text('[data]\nkind = "rl"\n[rl]\nrouting_replay = false\n')
    assert recipe_objective(load_recipe(tmp_path / "r.toml")).routing_replay is False
    (tmp_path / "r.toml").write_text('[data]\nkind = "rl"\n')
    assert recipe_objective(load_recipe(tmp_path / "r.toml")).routing_replay is True


RECIPE = """
[model]
spec = "qlm-tiny-moe"
dtype = "{dtype}"
[data]
kind = "rl"
train = ["@demo"]
seq_length = 48
cache_dir = "{cache}"
[rl]
num_generations = 4
max_completion_length = 6
reward_funcs = ["toy_routes_rewards:odd"]
routing_replay = {replay}
[train]
micro_batch_size = 8
global_batch_size = 8
train_iters = 2
[logging]
tensorboard = false
plot = false
"""


@pytest.mark.parametrize("replay", ["true", "false"])
def test_an_moe_rl_run_logs_how_many_routes_differed(tmp_path, odd_reward, replay):
    """A bf16 MoE policy: decoding (one token at a time, a KV cache) and the trainer's whole-sequence forward round
    differently, so some routes may differ; metrics.jsonl says how many, with replay on and off."""
    path = tmp_path / "moe_rl.toml"
    path.write_text(RECIPE.format(dtype="bf16", cache=tmp_path / "cache", replay=replay))
    Trainer(load_recipe(path), tmp_path / "run").run()
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= row["moe_route_mismatch"] <= 1.0 and row["moe_routes_differed"] >= 0
        assert row["train_rollout_logprob_abs_diff/mean"] >= 0
