"""`qlm train` with data.kind = "preference" against TRL's own trainers on the same tiny model, data and batch:
per-step loss and TRL's rewards/... metrics within 1e-5 (fp32), for sigmoid DPO (DPOTrainer, a frozen reference
model) and the reference-free SimPO with
CPO's NLL term (CPOTrainer, loss_type simpo, cpo_alpha 0.5).

Every step takes the whole data set as its one batch, so the two trainers' data orders cannot differ; the optimizer
is AdamW without weight decay at a constant learning rate with clipping at 1.0 in both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import call_qlm, make_chat_hf_model

PAIRS, STEPS, LR = 4, 3, 1e-3
# chatml without the newline after each turn, so that a response ends with the end-of-sequence token (ORPOTrainer
# appends one where it is missing)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen2 with the demo's chatml tokenizer, and PAIRS conversational pairs (TRL's format)."""
    root = tmp_path_factory.mktemp("dpo-trl")
    model = root / "hf"
    demo = make_chat_hf_model(model, root / "demo", TEMPLATE)
    rows = []
    for line in demo.preference.read_text().splitlines()[:PAIRS]:
        pair = json.loads(line)
        rows.append({"prompt": [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": pair["prompt"]}],
                     "chosen": [{"role": "assistant", "content": pair["chosen"]}],
                     "rejected": [{"role": "assistant", "content": pair["rejected"]}]})
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model, data, rows


def qlm_metrics(model: Path, data: Path, run: Path, loss_type: str, beta: float, extra: str = "") -> list[dict]:
    recipe = run.parent / f"{run.name}.toml"
    recipe.write_text(f"""
[model]
load = {json.dumps(str(model))}
dtype = "fp32"
[data]
kind = "preference"
train = [{json.dumps(str(data))}]
seq_length = 64
packing = false
valid_fraction = 0
cache_dir = {json.dumps(str(run.parent / "cache"))}
[preference]
loss_type = "{loss_type}"
beta = {beta}
{extra}
[train]
micro_batch_size = {PAIRS}
global_batch_size = {PAIRS}
train_iters = {STEPS}
loss_chunk_tokens = 0
[optim]
lr = {LR}
weight_decay = 0.0
beta2 = 0.999
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


def trl_metrics(trainer_cls, config_cls, model: Path, rows: list[dict], out: Path, **loss_args) -> list[dict]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    args = config_cls(
        output_dir=str(out), per_device_train_batch_size=PAIRS, gradient_accumulation_steps=1, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", seed=0, dataloader_num_workers=0, bf16=False, fp16=False, optim="adamw_torch",
        **loss_args,
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = trainer_cls(model=policy, args=args, train_dataset=datasets.Dataset.from_list(rows),
                          processing_class=tokenizer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    assert len(logs) == STEPS, trainer.state.log_history
    return logs


def assert_same(qlm: list[dict], trl: list[dict], keys):
    for step, (ours, theirs) in enumerate(zip(qlm, trl, strict=True), 1):
        for key in keys:
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), (step, key, ours[key], theirs[key])


@pytest.mark.slow
def test_sigmoid_dpo_matches_trl_dpo_trainer(setup, tmp_path):
    from trl import DPOConfig, DPOTrainer

    model, data, rows = setup
    qlm = qlm_metrics(model, data, tmp_path / "qlm", "sigmoid", 0.1)
    trl = trl_metrics(DPOTrainer, DPOConfig, model, rows, tmp_path / "trl", beta=0.1, loss_type=["sigmoid"],
                      max_length=None)
    assert_same(qlm, trl, KEYS + ("logps/chosen", "logps/rejected"))
    assert qlm[-1]["loss"] < qlm[0]["loss"]  # it trained: the comparison is of moving numbers


@pytest.mark.slow
def test_simpo_matches_trl_cpo_trainer(setup, tmp_path):
    trl_module = pytest.importorskip("trl.experimental.cpo")
    model, data, rows = setup
    qlm = qlm_metrics(model, data, tmp_path / "qlm", "simpo", 2.0, "simpo_gamma = 0.5\ncpo_alpha = 0.5")
    trl = trl_metrics(trl_module.CPOTrainer, trl_module.CPOConfig, model, rows, tmp_path / "trl", beta=2.0,
                      loss_type="simpo", simpo_gamma=0.5, cpo_alpha=0.5, max_length=64)
    assert_same(qlm, trl, KEYS + ("logps/chosen", "logps/rejected", "nll_loss"))
    assert qlm[-1]["loss"] < qlm[0]["loss"]
