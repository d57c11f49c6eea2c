"""Preference pairs: every format gives the ids of the chat template written out by hand, truncation, layout, errors."""

import json
import random

import numpy as np
import pytest

from qlm_core.data.preference import (
    PreferenceDataConfig,
    build_preference_dataset,
    load_preferences,
    pair_sequences,
    tokenize_preferences,
    truncate_pair,
)
from qlm_core.data.tokenizer import LLAMA3, LLAMA3_SPECIAL_TOKENS, build_demo_tokenizer, load_tokenizer
from qlm_core.errors import QlmError

WORDS = "the quick brown fox jumps over a lazy dog and then sleeps in the warm sun all day".split()


def write_jsonl(path, records):
    with open(path, "w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """chatml (the demo tokenizer, as tests/data/test_data_sft.py) and llama3 (its special tokens and template)."""
    root = tmp_path_factory.mktemp("tokenizers")
    corpus = [" ".join(random.Random(i).choice(WORDS) for _ in range(20)) for i in range(200)]
    chatml = load_tokenizer(build_demo_tokenizer(root / "chatml", corpus))
    llama3 = load_tokenizer(build_demo_tokenizer(root / "llama3", corpus))
    llama3.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL_TOKENS})
    llama3.chat_template = LLAMA3
    return {"chatml": chatml, "llama3": llama3}


# one conversation: system, an earlier exchange, the question; answers good / bad
SYSTEM, Q1, A1, Q2, GOOD, BAD, EXTRA = ("be brief", "the fox", "jumps", "the dog", "sleeps in the sun", "the lazy fox",
                                        "all day")
USER2 = f"{Q2}\n\n{EXTRA}"


def chatml_by_hand(turns):
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)


PROMPT_TEXT = chatml_by_hand([("system", SYSTEM), ("user", Q1), ("assistant", A1), ("user", USER2)]) + \
    "<|im_start|>assistant\n"


def records_of_each_format():
    prompt_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1},
                       {"role": "assistant", "content": A1}, {"role": "user", "content": USER2}]
    return {
        "trl": {"prompt": prompt_messages, "chosen": [{"role": "assistant", "content": GOOD}],
                "rejected": [{"role": "assistant", "content": BAD}]},
        "alpaca": {"instruction": Q2, "input": EXTRA, "chosen": GOOD, "rejected": BAD, "system": SYSTEM,
                   "history": [[Q1, A1]]},
        "sharegpt": {"conversations": [{"from": "human", "value": Q1}, {"from": "gpt", "value": A1},
                                       {"from": "human", "value": USER2}],
                     "chosen": {"from": "gpt", "value": GOOD}, "rejected": {"from": "gpt", "value": BAD},
                     "system": SYSTEM},
        "sharegpt_roles": {"conversations": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1},
                                             {"role": "assistant", "content": A1},
                                             {"role": "user", "content": USER2}],
                           "chosen": {"role": "assistant", "content": GOOD},
                           "rejected": {"role": "assistant", "content": BAD}},
    }


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", ["trl", "alpaca", "sharegpt", "sharegpt_roles"])
def test_each_format_gives_the_hand_rendered_ids(tmp_path, tokenizers, name):
    tokenizer = tokenizers["chatml"]
    path = write_jsonl(tmp_path / f"{name}.jsonl", [records_of_each_format()[name]])
    dataset = build_preference_dataset(path, tokenizer, PreferenceDataConfig(seq_length=128),
                                       cache_dir=str(tmp_path / "cache"))
    assert len(dataset) == 1 and dataset.truncated == 0
    pair = dataset.pairs[0]
    assert pair["prompt_ids"] == encode(tokenizer, PROMPT_TEXT)
    assert pair["chosen_ids"] == encode(tokenizer, f"{GOOD}<|im_end|>\n")
    assert pair["rejected_ids"] == encode(tokenizer, f"{BAD}<|im_end|>\n")
    assert tokenizer.decode(pair["chosen_ids"]) == f"{GOOD}<|im_end|>\n"


def test_trl_strings_and_parquet(tmp_path, tokenizers):
    import datasets

    tokenizer = tokenizers["chatml"]
    records = [{"prompt": Q2, "chosen": GOOD, "rejected": BAD}, {"prompt": Q1, "chosen": A1, "rejected": BAD}]
    parquet = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(records).to_parquet(str(parquet))
    for path in (write_jsonl(tmp_path / "pairs.jsonl", records), parquet):
        dataset = build_preference_dataset(path, tokenizer, PreferenceDataConfig(seq_length=64),
                                           cache_dir=str(tmp_path / "cache"))
        assert [dataset.pairs[i]["prompt_ids"] for i in range(2)] == [
            encode(tokenizer, chatml_by_hand([("user", q)]) + "<|im_start|>assistant\n") for q in (Q2, Q1)]
        assert dataset.pairs[1]["chosen_ids"] == encode(tokenizer, f"{A1}<|im_end|>\n")


def test_llama3_template_prompt_plus_response_is_the_whole_conversation(tmp_path, tokenizers):
    tokenizer = tokenizers["llama3"]
    record = records_of_each_format()["trl"]
    path = write_jsonl(tmp_path / "pairs.jsonl", [record])
    dataset = build_preference_dataset(path, tokenizer, PreferenceDataConfig(seq_length=128),
                                       cache_dir=str(tmp_path / "cache"))
    pair = dataset.pairs[0]
    for key in ("chosen", "rejected"):
        whole = tokenizer.apply_chat_template(record["prompt"] + record[key], chat_template=LLAMA3, tokenize=False)
        assert pair["prompt_ids"] + pair[f"{key}_ids"] == encode(tokenizer, whole)
    assert tokenizer.decode(pair["chosen_ids"]) == f"{GOOD}<|eot_id|>"
    assert tokenizer.decode(pair["prompt_ids"]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_truncation_follows_trl():
    prompt, chosen, rejected = list(range(10)), list(range(100, 106)), list(range(200, 203))
    # max_prompt_length: keep_end keeps the prompt's last tokens, keep_start its first; responses cut at the end
    assert truncate_pair(prompt, chosen, rejected, 12, 4) == ([6, 7, 8, 9], chosen, rejected, True)
    assert truncate_pair(prompt, chosen, rejected, 12, 4, "keep_start")[0] == [0, 1, 2, 3]
    assert truncate_pair(prompt, chosen, rejected, 13, 10) == (prompt, chosen[:3], rejected, True)
    assert truncate_pair(prompt, chosen, rejected, 16, 10) == (prompt, chosen, rejected, False)
    # a prompt longer than the sequence keeps max_length - 1 tokens: room for one response token
    assert truncate_pair(prompt, chosen, rejected, 5) == ([6, 7, 8, 9], [100], [200], True)


def test_truncated_rows_are_counted(tmp_path, tokenizers):
    tokenizer = tokenizers["chatml"]
    long_question = " ".join(WORDS * 3)
    records = [{"prompt": Q1, "chosen": GOOD, "rejected": BAD}, {"prompt": long_question, "chosen": GOOD,
                                                                  "rejected": BAD}]
    rows = load_preferences(write_jsonl(tmp_path / "pairs.jsonl", records), str(tmp_path / "cache"))
    full_prompt = encode(tokenizer, chatml_by_hand([("user", long_question)]) + "<|im_start|>assistant\n")
    assert len(full_prompt) > 24
    tokenized, truncated = tokenize_preferences(rows, tokenizer, PreferenceDataConfig(seq_length=32,
                                                                                      max_prompt_length=24))
    assert truncated == 1 and tokenized["truncated"] == [False, True]
    assert tokenized[1]["prompt_ids"] == full_prompt[-24:]
    assert len(tokenized[1]["prompt_ids"]) + len(tokenized[1]["chosen_ids"]) <= 32
    _, none_cut = tokenize_preferences(rows, tokenizer, PreferenceDataConfig(seq_length=128))
    assert none_cut == 0
    with pytest.raises(QlmError, match="max_length 40 is longer than seq_length 32"):
        tokenize_preferences(rows, tokenizer, PreferenceDataConfig(seq_length=32, max_length=40))


def test_pair_sequences_layout():
    pair = {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10]}
    (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = pair_sequences(pair, 8, pad_token_id=0)
    assert chosen_ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert chosen_labels.tolist() == [-100, -100, 8, 9, -100, -100, -100, -100]
    assert rejected_ids.tolist() == [5, 6, 7, 10, 0, 0, 0, 0]
    assert rejected_labels.tolist() == [-100, -100, 10, -100, -100, -100, -100, -100]
    assert chosen_ids.dtype == np.int64 and chosen_labels.dtype == np.int64
    with pytest.raises(ValueError, match="does not fit in 4"):
        pair_sequences(pair, 4)


def test_dataset_items_train_exactly_the_response(tmp_path, tokenizers):
    tokenizer = tokenizers["chatml"]
    path = write_jsonl(tmp_path / "pairs.jsonl", [records_of_each_format()["alpaca"]])
    dataset = build_preference_dataset(path, tokenizer, PreferenceDataConfig(seq_length=96),
                                       cache_dir=str(tmp_path / "cache"))
    (ids, labels), (rids, rlabels) = dataset[0]
    assert ids.shape == labels.shape == (96,)
    assert tokenizer.decode(labels[labels != -100]) == f"{GOOD}<|im_end|>\n"
    assert tokenizer.decode(rlabels[rlabels != -100]) == f"{BAD}<|im_end|>\n"
    n = len(encode(tokenizer, PROMPT_TEXT))
    assert ids[:n].tolist() == rids[:n].tolist() == encode(tokenizer, PROMPT_TEXT)


@pytest.mark.parametrize("records, message", [
    ([{"prompt": "p", "chosen": "", "rejected": "r"}], r"record 1 \(trl format\): the chosen response is empty"),
    ([{"prompt": "p", "chosen": "c", "rejected": [{"role": "assistant", "content": "  "}]}],
     "record 1 \\(trl format\\): the rejected response is empty"),
    ([{"prompt": "p", "chosen": "c"}], r"the first record \(trl format\) has no 'rejected' key"),
    ([{"prompt": "p", "chosen": "c", "rejected": "r"}, {"prompt": "q", "chosen": "c"}],
     r"record 2 \(trl format\): the rejected response is missing"),
    ([{"question": "p", "answer": "c"}], r"cannot tell the preference format from the first record \(its keys: "
                                         r"question, answer\)"),
    ([{"instruction": "i", "chosen": "c", "rejected": "r", "history": [["only one"]]}],
     r"record 1 \(alpaca format\): history entry 1 is not a \[user, assistant\] pair"),
    ([{"conversations": [{"from": "bot", "value": "v"}], "chosen": {"from": "gpt", "value": "c"},
       "rejected": {"from": "gpt", "value": "r"}}], "sharegpt role 'bot'"),
    ([{"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "user", "content": "c"}],
       "rejected": [{"role": "assistant", "content": "r"}]}], "the chosen response starts with a user turn"),
])
def test_bad_records_are_one_line_errors(tmp_path, records, message):
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(QlmError, match=message) as info:
        load_preferences(path, str(tmp_path / "cache"))
    assert "\n" not in str(info.value) and "record" in str(info.value) and info.value.fix


def test_unknown_format_name_is_a_user_error(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    with pytest.raises(QlmError, match="unknown preference format 'kto'"):
        load_preferences(path, str(tmp_path / "cache"), format="kto")
    with pytest.raises(QlmError, match="no instruction column for the alpaca format"):
        load_preferences(path, str(tmp_path / "cache"), format="alpaca")
