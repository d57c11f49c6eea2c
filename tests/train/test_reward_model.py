"""`qlm train` with data.kind = "reward" (a Bradley-Terry reward model) against TRL 1.16's RewardTrainer on the same
tiny model, pairs and batch: per-step loss and TRL's accuracy / margin / min, mean and max reward within 1e-5
(fp32), with and without center_rewards_coefficient; and the head's file formats both ways.

Both start from one *ForSequenceClassification checkpoint (its `score` drawn once by transformers), so the two
trainers hold the same head. Every step takes the whole data set as its one batch; AdamW without weight decay at a
constant rate, clipping at 1.0, in both (as tests/train/test_dpo_trl.py), with Adam's epsilon at 1e-6: a
scalar head leaves many weights with gradients at the 1e-9 rounding level, which the first step's g/(|g|+eps) at
eps 1e-8 turns into whole steps of either sign (measured: one v_proj element 4e-4 apart after step 1, all else
within 3e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import call_qlm, load_safetensors_dir, make_chat_hf_model

PAIRS, STEPS, LR = 4, 3, 1e-3
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KEYS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen2 language model with the demo's chatml tokenizer, the same model as a one-label sequence
    classifier (transformers' own new `score`), and PAIRS conversational pairs."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("reward-trl")
    lm, rm = root / "lm", root / "rm"
    demo = make_chat_hf_model(lm, root / "demo", TEMPLATE)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(lm)
    # the tokenizer's pad token (<|endoftext|>): Qwen2's embedding takes it as padding_idx, a row that never trains
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(rm)
    tokenizer.save_pretrained(rm)
    rows = []
    for line in demo.preference.read_text().splitlines()[:PAIRS]:
        pair = json.loads(line)
        rows.append({"prompt": [{"role": "user", "content": pair["prompt"]}],
                     "chosen": [{"role": "assistant", "content": pair["chosen"]}],
                     "rejected": [{"role": "assistant", "content": pair["rejected"]}]})
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return lm, rm, data, rows


def qlm_run(model: Path, data: Path, run: Path, extra: str = "", steps: int = STEPS) -> list[dict]:
    recipe = run.parent / f"{run.name}.toml"
    recipe.write_text(f"""
[model]
load = {json.dumps(str(model))}
dtype = "fp32"
[data]
kind = "reward"
train = [{json.dumps(str(data))}]
seq_length = 64
packing = false
valid_fraction = 0
cache_dir = {json.dumps(str(run.parent / "cache"))}
{extra}
[train]
micro_batch_size = {PAIRS}
global_batch_size = {PAIRS}
train_iters = {steps}
[optim]
lr = {LR}
weight_decay = 0.0
beta2 = 0.999
eps = 1e-6
clip_grad = 1.0
[schedule]
lr_schedule = "constant"
[logging]
tensorboard = false
plot = false
""")
    code, out, err = call_qlm("train", recipe, "--output", run)
    assert code == 0, out[-2000:] + err[-2000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def trl_run(model: Path, rows: list[dict], out: Path, **reward_args) -> list[dict]:
    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(
        output_dir=str(out), per_device_train_batch_size=PAIRS, gradient_accumulation_steps=1, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-6, max_grad_norm=1.0, logging_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", seed=0, dataloader_num_workers=0, bf16=False, fp16=False, optim="adamw_torch",
        **reward_args,
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32)
    trainer = RewardTrainer(model=policy, args=args, train_dataset=datasets.Dataset.from_list(rows),
                            processing_class=tokenizer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    assert len(logs) == STEPS, trainer.state.log_history
    return logs


def assert_same(qlm: list[dict], trl: list[dict]):
    for step, (ours, theirs) in enumerate(zip(qlm, trl, strict=True), 1):
        for key in KEYS:
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), (step, key, ours[key], theirs[key])
    assert qlm[-1]["loss"] < qlm[0]["loss"]  # it trained: the comparison is of moving numbers
    assert len({round(entry["margin"], 6) for entry in qlm}) == len(qlm)


@pytest.mark.slow
def test_reward_model_matches_trl_reward_trainer(setup, tmp_path):
    _, rm, data, rows = setup
    assert_same(qlm_run(rm, data, tmp_path / "qlm"), trl_run(rm, rows, tmp_path / "trl"))


@pytest.mark.slow
def test_centered_reward_model_matches_trl(setup, tmp_path):
    _, rm, data, rows = setup
    qlm = qlm_run(rm, data, tmp_path / "qlm", "[reward]\ncenter_rewards_coefficient = 0.01")
    assert_same(qlm, trl_run(rm, rows, tmp_path / "trl", center_rewards_coefficient=0.01))


def test_reward_model_from_a_language_model_exports_a_sequence_classifier(setup, tmp_path):
    """A language model trained as a reward model gets a new score head, seeded; the run exports to a
    *ForSequenceClassification that transformers loads, its scores at every position those of qlm's model (convert's
    verification, on by default)."""
    from transformers import AutoModelForSequenceClassification

    lm, _, data, _ = setup
    run = tmp_path / "run"
    metrics = qlm_run(lm, data, run, steps=1)
    code, out, err = call_qlm("convert", "mcore2hf", "--mcore", run / "checkpoints", "--out", tmp_path / "hf")
    assert code == 0, out[-2000:] + err[-2000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["pad_token_id"] == 0
    tensors = load_safetensors_dir(tmp_path / "hf")
    assert tensors["score.weight"].shape == (1, config["hidden_size"]) and "lm_head.weight" not in tensors
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert model.config.num_labels == 1
    again = qlm_run(lm, data, tmp_path / "again", steps=1)  # the same seed draws the same head
    assert again[0]["loss"] == metrics[0]["loss"]
    for what in (run, tmp_path / "hf"):  # a reward model has no vocabulary to decode or score text with
        for verb in (("generate", what, "--prompt", "hi"), ("eval", what, "--tasks", "qlm_demo_mc"),
                     ("eval", what, "--tasks", "qlm_demo_mc", "--backend", "hf")):
            code, out, err = call_qlm(*verb)
            lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
            assert code == 2 and len(lines) == 1 and "is a reward model" in lines[0], (verb, out[-800:], err[-800:])


def test_a_reward_model_scores_rl_completions_as_trl_grpo_does(setup, tmp_path):
    """rl.reward_funcs naming a reward model: qlm's rewards of prompt + completion rows equal TRL 1.16
    GRPOTrainer's scoring with the same model (its chat-template rendering of prompt + completion turns, right
    padding, `logits[:, 0]`), for conversation and string prompts, within 1e-5."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl.data_utils import apply_chat_template

    from qlm_core.data.rl_prompts import load_prompts
    from qlm_core.train.rewards import Rewards, RewardSource

    _, rm, _, _ = setup
    conversations = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sort b a c"}],
                     [{"role": "user", "content": "largest of 3 9 4"}]]
    strings = ["count the letters of abc", "reverse xyz"]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in conversations + strings))
    prompts = load_prompts(prompts_file, rm, None, seq_length=64, max_completion_length=8,
                           cache_dir=str(tmp_path / "cache"))
    completions = ["a b c", "9", "3 letters, surely", "zyx"]
    rewards = Rewards([RewardSource(str(rm))])
    assert rewards.names == ["rm"]
    ours = rewards.score([r["prompt"] for r in prompts.records], completions, prompts.records)[:, 0]

    tokenizer = AutoTokenizer.from_pretrained(rm)
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    trl_prompts = conversations + [[{"role": "user", "content": p}] for p in strings]  # qlm renders strings as turns
    texts = [apply_chat_template({"messages": p + [{"role": "assistant", "content": c}]}, tokenizer)["text"]
             for p, c in zip(trl_prompts, completions, strict=True)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        theirs = model(**inputs).logits[:, 0].double()
    assert torch.allclose(ours, theirs, atol=1e-5), (ours, theirs)
    assert len(set(ours.tolist())) == len(completions)  # distinct rows, distinct rewards: nothing pooled wrongly
