"""A rollout in the trainer's process: groups of sampled completions packed as training rows whose old log-probs
are what the trainer's own forward gives (train_rollout_logprob_abs_diff within 1e-5 in fp32), scored and turned
into advantages, and a prompt that leaves no room to answer is one line."""

from dataclasses import replace

import pytest
import torch
from parallel_cases import SPEC

from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.decode.sampling import Sampling
from qlm_core.errors import QlmError
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Engine
from qlm_core.train.objectives.grpo import GrpoObjective
from qlm_core.train.objectives.grpo_loss import GrpoLoss
from qlm_core.train.rewards import Rewards, RewardSource
from qlm_core.train.rollouts import RolloutConfig, assemble, collect_groups, rollout, sample_groups

SEQ, PROMPTS, GENERATIONS = 32, 2, 4
EOS = 7


def _engine(temperature: float = 1.0):
    loss = GrpoLoss(loss_type="dapo", max_completion_length=12)
    return Engine(SPEC, ParallelConfig(), Grid.single(), micro_batch_size=4, global_batch_size=PROMPTS * GENERATIONS,
                  seq_length=SEQ, optim=OptimConfig(lr=1e-3), seed=3, objective=GrpoObjective(loss, temperature))


def _text(ids):
    return " ".join(str(i) for i in ids)


@pytest.fixture
def even_reward(tmp_path, monkeypatch):
    (tmp_path / "toy_rl_rewards.py").write_text(
        "def even_share(prompt, completion, record):\n"
        "    ids = [int(t) for t in completion.split()]\n"
        "    return sum(i % 2 == 0 for i in ids) / max(len(ids), 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return Rewards([RewardSource("toy_rl_rewards:even_share")])


@pytest.mark.parametrize("temperature, batch_rows", [(1.0, 0), (0.6, 0), (1.0, 3)])
def test_rollout_rows_train_on_what_was_sampled_with_its_logprobs(even_reward, temperature, batch_rows):
    """batch_rows 3: decoded three completions at a time (another left padding per batch), the same agreement."""
    engine = _engine(temperature)
    model = engine.chunks[0]
    prompts = [[11, 12, 13, 14, 15], [21, 22]]
    records = [{"prompt": "a"}, {"prompt": "b"}]
    config = RolloutConfig(num_generations=GENERATIONS, max_completion_length=12,
                           sampling=Sampling(temperature=temperature, seed=5), batch_rows=batch_rows)
    batch, metrics = rollout(model, prompts, records, config, even_reward, _text, seq_length=SEQ, eos_token_id=EOS,
                             pad_id=0)
    assert batch.input_ids.shape == batch.labels.shape == batch.old_logps.shape == (PROMPTS * GENERATIONS, SEQ)
    for row in range(PROMPTS * GENERATIONS):
        prompt = prompts[row // GENERATIONS]
        completion = batch.labels[row][batch.labels[row] >= 0].tolist()
        assert batch.input_ids[row, :len(prompt)].tolist() == prompt
        assert batch.input_ids[row, len(prompt):len(prompt) + len(completion) - 1].tolist() == completion[:-1]
    group = batch.advantages.view(PROMPTS, GENERATIONS)
    assert torch.allclose(group.mean(dim=1), torch.zeros(PROMPTS), atol=1e-6)  # relative to each group's mean
    assert {"reward", "reward_std", "frac_reward_zero_std", "rewards/even_share/mean",
            "completions/mean_length"} <= set(metrics)
    engine.forward_backward(batch)  # the trainer's forward of the same rows, at the rollout's weights
    figures = engine.objective.figures()
    assert figures["train_rollout_logprob_abs_diff/max"] <= 1e-5, figures
    assert figures["clip_ratio/region_mean"] == 0.0  # π_old is π: no ratio is away from 1


def test_a_prompt_that_leaves_no_room_to_answer_is_one_line(even_reward):
    engine = _engine()
    config = RolloutConfig(num_generations=2, max_completion_length=12)
    with pytest.raises(QlmError, match="a prompt of 25 tokens leaves no room for rl.max_completion_length 12"):
        rollout(engine.chunks[0], [list(range(25))], [{"prompt": "x"}], config, even_reward, _text, seq_length=SEQ,
                eos_token_id=EOS, pad_id=0)


def test_the_rl_loop_raises_a_reward(even_reward):
    """Rollout, then a GRPO step on it, 40 times: a random tiny model learns to answer with even token ids (from
    about half of them to over three quarters), its train / rollout log-probs agreeing to 1e-5 every step."""
    P, G = 4, 8
    loss = GrpoLoss(loss_type="dapo", max_completion_length=12)
    engine = Engine(SPEC, ParallelConfig(), Grid.single(), micro_batch_size=8, global_batch_size=P * G,
                    seq_length=SEQ, optim=OptimConfig(lr=3e-3), seed=3, objective=GrpoObjective(loss))
    g = torch.Generator().manual_seed(0)
    rewards = []
    for step in range(40):
        prompts = [torch.randint(1, SPEC.vocab_size, (6,), generator=g).tolist() for _ in range(P)]
        config = RolloutConfig(num_generations=G, max_completion_length=12, sampling=Sampling(1.0, seed=step))
        batch, metrics = rollout(engine.chunks[0], prompts, [{"prompt": ""}] * P, config, even_reward, _text,
                                 seq_length=SEQ, eos_token_id=None, pad_id=0)
        result = engine.train_step(batch, lr=3e-3)
        assert result.figures["train_rollout_logprob_abs_diff/max"] <= 1e-5
        rewards.append(metrics["reward"])
    assert sum(rewards[:5]) / 5 <= 0.6 and sum(rewards[-5:]) / 5 >= 0.75, rewards


def test_overlong_penalty_is_dapos():
    from qlm_core.train.rollouts import overlong_penalty

    assert [overlong_penalty(n, 12, 4) for n in (5, 8, 9, 10, 12, 13)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


@pytest.fixture
def easy_rewards(tmp_path, monkeypatch):
    (tmp_path / "toy_rl_easy.py").write_text(
        "def score(prompt, completion, record):\n"
        "    if record['easy']:\n        return 1.0\n"
        "    ids = [int(t) for t in completion.split()]\n"
        "    return sum(i % 2 == 0 for i in ids) / max(len(ids), 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return Rewards([RewardSource("toy_rl_easy:score")])


def dynamic_rollout(model, draw, num_prompts, config, rewards):
    """collect_groups in one process, each draw at its own seed, then the batch (RolloutBatches' step, alone)."""
    def sample(attempt):
        prompts, records = draw()
        seeded = replace(config, sampling=replace(config.sampling, seed=config.sampling.seed + attempt))
        return sample_groups(model, prompts, records, seeded, rewards, _text, seq_length=SEQ, eos_token_id=None,
                             pad_id=0)

    groups, counts = collect_groups(sample, num_prompts, config, rewards)
    batch, metrics = assemble(groups, config, rewards, seq_length=SEQ, pad_id=0)
    return batch, {**metrics, **counts}


def test_dynamic_sampling_drops_groups_without_signal_and_says_when_it_fills(easy_rewards):
    engine = _engine()
    draws = iter(range(100))

    def draw(easy_every: int):
        def next_prompts():
            k = next(draws)
            return [[10 + k, 20 + k], [30 + k, 40 + k]], [{"prompt": "", "easy": (k + i) % easy_every == 0}
                                                           for i in range(2)]
        return next_prompts

    config = RolloutConfig(num_generations=GENERATIONS, max_completion_length=8, sampling=Sampling(1.0, seed=2),
                           max_sampling_tries=4)
    batch, metrics = dynamic_rollout(engine.chunks[0], draw(2), 2, config, easy_rewards)
    assert batch.input_ids.shape[0] == 2 * GENERATIONS and metrics["dynamic_sampling/filled_groups"] == 0
    assert metrics["dynamic_sampling/draws"] == 2 and metrics["frac_reward_zero_std"] == 0  # one easy a draw
    batch, metrics = dynamic_rollout(engine.chunks[0], draw(1), 2, config, easy_rewards)  # all easy: filled after 4
    assert metrics["dynamic_sampling/draws"] == 4 and metrics["dynamic_sampling/filled_groups"] == 2
    assert torch.all(batch.advantages == 0)


def test_overlong_filtering_and_soft_punishment(even_reward):
    engine = _engine()
    config = RolloutConfig(num_generations=GENERATIONS, max_completion_length=6, sampling=Sampling(1.0, seed=1),
                           overlong_filter=True, overlong_buffer=3)
    batch, metrics = rollout(engine.chunks[0], [[3, 4, 5]], [{"prompt": ""}], config, even_reward, _text,
                             seq_length=SEQ, eos_token_id=None, pad_id=0)  # no eos: every answer is truncated
    assert torch.all(batch.labels == -100) and metrics["completions/clipped_ratio"] == 1.0
    assert metrics["rewards/overlong/mean"] == -1.0


@pytest.mark.parametrize("fields, message", [(dict(num_generations=0), "rl.num_generations is 0"),
                                             (dict(max_sampling_tries=0), "rl.max_sampling_tries is 0"),
                                             (dict(overlong_buffer=64), "rl.overlong_buffer 64 is not below")])
def test_a_wrong_rollout_setting_is_one_line(fields, message):
    with pytest.raises(QlmError, match=message):
        RolloutConfig(**fields)


def test_dynamic_sampling_says_when_the_prompts_run_out(easy_rewards):
    config = RolloutConfig(num_generations=GENERATIONS, max_completion_length=8, max_sampling_tries=1)
    with pytest.raises(QlmError, match="the prompts ran out: 1 of 2 groups"):
        dynamic_rollout(_engine().chunks[0], lambda: ([[5, 6]], [{"prompt": "", "easy": True}]), 2, config,
                        easy_rewards)
