"""`qlm train` on preference data: bad input is a one-line error (or the documented, reported truncation), and the
preference rules across recipe fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RECIPE = """
[model]
spec = "qlm-tiny"
dtype = "fp32"
tokenizer = {tokenizer}
[data]
kind = "preference"
train = [{data}]
seq_length = 32
packing = false
valid_fraction = 0
[train]
micro_batch_size = 2
global_batch_size = 2
train_iters = 2
[logging]
tensorboard = false
plot = false
"""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    from qlm_core.data.demo import build_demo

    return build_demo(tmp_path_factory.mktemp("demo") / "demo", seed=0, num_train=30, num_eval=3,
                      corpus_paragraphs=5, preference_pairs=4).tokenizer


def write_run(tmp_path: Path, tokenizer: Path, records: list[dict]) -> Path:
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = tmp_path / "dpo.toml"
    recipe.write_text(RECIPE.format(tokenizer=json.dumps(str(tokenizer)), data=json.dumps(str(data))))
    return recipe


GOOD = {"prompt": "Sort: b a", "chosen": "a b", "rejected": "b a"}


@pytest.mark.parametrize("records,message", [
    ([GOOD, {"prompt": "Sort: b a", "chosen": "a b"}], "record 2 (trl format): the rejected response is missing"),
    ([GOOD, {"prompt": "Sort: b a", "chosen": "", "rejected": "b a"}],
     "record 2 (trl format): the chosen response is empty"),
    ([{"prompt": "Sort: b a", "chosen": "a b", "rejected": "b a", "extra": 1}, {"prompt": "", "chosen": "a",
                                                                              "rejected": "b"}],
     "record 2 (trl format): the prompt is empty"),
])
def test_bad_pairs_are_one_line_errors(run_qlm, tokenizer, tmp_path, records, message):
    code, _, stderr = run_qlm("train", write_run(tmp_path, tokenizer, records), "--output", tmp_path / "run")
    assert code == 2 and message in stderr, stderr
    assert len([line for line in stderr.splitlines() if line.strip()]) == 1, stderr


def test_a_prompt_longer_than_the_sequence_is_truncated_and_reported(run_qlm, tokenizer, tmp_path):
    long = {"prompt": "Sort: " + " ".join("abcdefgh" * 8), "chosen": "a b", "rejected": "b a"}
    code, stdout, stderr = run_qlm("train", write_run(tmp_path, tokenizer, [GOOD, long, GOOD, GOOD]), "--output",
                                   tmp_path / "run")
    assert code == 0, stderr
    assert "1 preference records were truncated to fit" in stdout
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(line["logps/chosen"] < 0 for line in lines)


@pytest.mark.parametrize("sets,message", [
    (["data.packing=true"], "data.packing with data.kind = \"preference\""),
    (["data.format=messages"], "data.format 'messages' is not a preference format"),
    (["preference.loss_type=simpo", "preference.rpo_alpha=0.5"], "preference.rpo_alpha applies to the DPO losses"),
    (["preference.loss_type=orpo", "preference.precompute_reference=true"],
     "preference.precompute_reference with the reference-free orpo loss"),
    (["preference.loss_type=hinge", "preference.label_smoothing=0.1"],
     "preference.label_smoothing applies to the sigmoid and simpo losses, not hinge"),
    (["preference.cpo_alpha=0.5"], "preference.cpo_alpha applies to the simpo loss, not sigmoid"),
    (["preference.max_length=64"], "preference.max_length 64 is longer than data.seq_length 32"),
    (["preference.beta=0"], "preference.beta must be > 0"),
    (["preference.loss_type=kto"], "preference.loss_type 'kto' is not one of sigmoid, hinge, ipo, simpo, orpo"),
])
def test_preference_recipe_rules(run_qlm, tokenizer, tmp_path, sets, message):
    args = [arg for kv in sets for arg in ("--set", kv)]
    code, _, stderr = run_qlm("train", write_run(tmp_path, tokenizer, [GOOD] * 4), "--output", tmp_path / "run",
                              *args)
    assert code == 2 and message in stderr, stderr
    assert not (tmp_path / "run").exists()


def test_moe_models_are_refused(run_qlm, tokenizer, tmp_path):
    code, _, stderr = run_qlm("train", write_run(tmp_path, tokenizer, [GOOD] * 4), "--output", tmp_path / "run",
                              "--set", "model.spec=qlm-tiny-moe")
    assert code == 2 and "preference training takes dense models" in stderr, stderr
