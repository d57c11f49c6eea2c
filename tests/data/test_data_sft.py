"""SFT: formats -> messages, labels on exactly the assistant tokens (three kinds of template), truncation, packing."""

import json
import random

import numpy as np
import pytest

from qlm_core.data.sft import (
    SFTConfig,
    build_sft_dataset,
    first_fit,
    load_conversations,
    render_example,
    tokenize_conversations,
)
from qlm_core.data.tokenizer import (
    CHATML,
    LLAMA3,
    LLAMA3_SPECIAL_TOKENS,
    build_demo_tokenizer,
    chat_template,
    has_generation_markers,
    load_tokenizer,
)
from qlm_core.errors import QlmError

WORDS = "the quick brown fox jumps over a lazy dog and then sleeps in the warm sun all day".split()
# a template in another style, without {% generation %}: labels come from rendering turn by turn
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
)


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversations(count, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        messages = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):
            messages.append({"role": "user", "content": sentence(rng, rng.randint(1, 8))})
            messages.append({"role": "assistant", "content": sentence(rng, rng.randint(1, 12))})
        out.append(messages)
    return out


def write_jsonl(path, records):
    with open(path, "w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """chatml (the demo tokenizer), llama3 (its special tokens, named template) and plain (own, unmarked template)."""
    root = tmp_path_factory.mktemp("tokenizers")
    corpus = [sentence(random.Random(i), 20) for i in range(200)]
    chatml = load_tokenizer(build_demo_tokenizer(root / "chatml", corpus))
    llama3 = load_tokenizer(build_demo_tokenizer(root / "llama3", corpus))
    llama3.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL_TOKENS})
    llama3.chat_template = LLAMA3
    plain = load_tokenizer(build_demo_tokenizer(root / "plain", corpus))
    plain.chat_template = PLAIN_TEMPLATE
    return {"chatml": (chatml, "<|im_end|>"), "llama3": (llama3, "<|eot_id|>"), "plain": (plain, "<|endoftext|>")}


def test_named_templates():
    assert chat_template("qwen") == chat_template("chatml") == CHATML and chat_template("LLAMA3") == LLAMA3
    assert has_generation_markers(CHATML) and has_generation_markers(LLAMA3)
    assert not has_generation_markers(PLAIN_TEMPLATE)
    with pytest.raises(QlmError, match="unknown chat template 'vicuna'"):
        chat_template("vicuna")


def test_each_format_yields_its_messages(tmp_path):
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Add", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi", "input": "", "output": "hi", "system": "be kind"},
    ])
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q1"},
                           {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
                           {"from": "gpt", "value": "a2"}]},
    ])
    messages = write_jsonl(tmp_path / "messages.jsonl", [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a"}], "id": 7},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "name": "bot"}]},
    ])
    cache = str(tmp_path / "cache")
    assert load_conversations(alpaca, cache)["messages"] == [
        [{"role": "user", "content": "Add\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
        [{"role": "system", "content": "be kind"}, {"role": "user", "content": "Say hi"},
         {"role": "assistant", "content": "hi"}],
    ]
    assert load_conversations(sharegpt, cache)["messages"] == [[
        {"role": "system", "content": "s"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]]
    assert load_conversations(messages, cache)["messages"] == [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    ]


def test_unknown_formats_and_roles_are_user_errors(tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(QlmError, match=r"first record \(its keys: prompt, completion\)"):
        load_conversations(write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "completion": "c"}]), cache)
    with pytest.raises(QlmError, match="sharegpt role 'bot'"):
        load_conversations(write_jsonl(tmp_path / "y.jsonl", [{"conversations": [{"from": "bot", "value": "v"}]}]),
                           cache)
    with pytest.raises(QlmError, match="does not exist"):
        load_conversations(tmp_path / "missing.jsonl", cache)
    with pytest.raises(QlmError, match="no instruction, output column for the alpaca format"):
        load_conversations(write_jsonl(tmp_path / "z.jsonl", [{"messages": []}]), cache, format="alpaca")


def test_an_explicit_format_overrides_detection(tmp_path):
    record = {"messages": [{"role": "user", "content": "m"}], "instruction": "i", "output": "o"}
    path = write_jsonl(tmp_path / "both.jsonl", [record])
    cache = str(tmp_path / "cache")
    assert load_conversations(path, cache)["messages"][0][0]["content"] == "m"
    assert load_conversations(path, cache, format="alpaca")["messages"][0] == [
        {"role": "user", "content": "i"}, {"role": "assistant", "content": "o"}]


def trained_runs(input_ids, labels):
    """Runs of consecutive trained target tokens (the token at t+1 for each labelled t)."""
    runs, current = [], []
    for t in range(len(labels)):
        if labels[t] != -100:
            assert labels[t] == input_ids[t + 1]
            current.append(int(labels[t]))
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("kind", ["chatml", "llama3", "plain"])
def test_labels_cover_exactly_the_assistant_turns(tmp_path, tokenizers, kind):
    tokenizer, end_of_turn = tokenizers[kind]
    convs = conversations(12)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in convs])
    config = SFTConfig(seq_length=256, pack=False, shuffle=False)
    dataset = build_sft_dataset(path, tokenizer, config, cache_dir=str(tmp_path / "cache"))
    assert len(dataset) == len(convs)
    for messages, i in zip(convs, range(len(dataset)), strict=True):
        item = dataset[i]
        assert item["position_ids"] is None and item["segment_ids"] is None
        expected = [m["content"].strip() + end_of_turn for m in messages if m["role"] == "assistant"]
        runs = [tokenizer.decode(run) for run in trained_runs(item["input_ids"], item["labels"])]
        if kind == "plain":  # "...: content" splits as " content": the leading space is the content's first token
            runs = [run.lstrip() for run in runs]
        assert runs == expected


def test_unmarked_templates_match_the_generation_mask(tokenizers):
    """The turn-by-turn fallback marks the same tokens as {% generation %} for the same template."""
    tokenizer, _ = tokenizers["chatml"]
    unmarked = CHATML.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert not has_generation_markers(unmarked)
    for messages in conversations(10, seed=3):
        assert render_example(messages, tokenizer, CHATML) == render_example(messages, tokenizer, unmarked)


def test_truncation_policies(tmp_path, tokenizers):
    tokenizer, _ = tokenizers["chatml"]
    convs = conversations(30, seed=1)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in convs])
    rendered = [render_example(m, tokenizer, CHATML) for m in convs]
    full = [ids for ids, _ in rendered]
    cache = str(tmp_path / "cache")
    limit = 40
    right = build_sft_dataset(path, tokenizer, SFTConfig(seq_length=64, max_length=limit, pack=False, shuffle=False),
                              cache)
    kept = [ids[:limit] for ids, mask in rendered if any(mask[1:limit])]  # cut ones with no answer left go
    assert len(kept) < len(convs)
    assert [right.samples[i]["input_ids"].tolist() for i in range(len(right))] == kept
    drop = build_sft_dataset(path, tokenizer, SFTConfig(seq_length=64, max_length=limit, truncation="drop",
                                                        pack=False, shuffle=False), cache)
    assert [drop.samples[i]["input_ids"].tolist() for i in range(len(drop))] == [ids for ids in full
                                                                                 if len(ids) <= limit]
    assert 0 < len(drop) < len(convs)
    with pytest.raises(QlmError, match="longer than seq_length"):
        build_sft_dataset(path, tokenizer, SFTConfig(seq_length=64, max_length=65), cache)


def test_packing_invariants(tmp_path, tokenizers):
    tokenizer, _ = tokenizers["chatml"]
    convs = conversations(60, seed=2)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in convs])
    S = 128
    config = SFTConfig(seq_length=S, num_proc=2)
    dataset = build_sft_dataset(path, tokenizer, config, cache_dir=str(tmp_path / "cache"))
    samples = sorted(tuple(render_example(m, tokenizer, CHATML)[0][:S]) for m in convs)
    assert len(dataset) < len(convs)  # packing put several samples in a sequence
    seen = []
    for i in range(len(dataset)):
        item = dataset[i]
        ids, labels, positions, segments = (item[k] for k in ("input_ids", "labels", "position_ids", "segment_ids"))
        assert all(v.shape == (S,) and v.dtype == np.int64 for v in item.values())
        assert np.all(np.diff(segments) >= 0) and segments[0] == 0 and np.all(np.diff(segments) <= 1)
        members = len(dataset.sequences[i])
        assert segments.max() in (members - 1, members)  # one segment per sample, then one for the padding
        for segment in np.unique(segments):
            where = np.flatnonzero(segments == segment)
            assert np.array_equal(positions[where], np.arange(where.size))  # positions restart per sample
            if segment < members:
                seen.append(tuple(ids[where].tolist()))
            else:
                assert np.all(ids[where] == tokenizer.pad_token_id) and np.all(labels[where] == -100)
        labelled = np.flatnonzero(labels != -100)
        assert np.all(labelled < S - 1) and np.all(segments[labelled + 1] == segments[labelled])  # never across
        assert np.array_equal(labels[labelled], ids[labelled + 1])
    assert sorted(seen) == samples  # every sample exactly once
    unpacked = build_sft_dataset(path, tokenizer, SFTConfig(seq_length=S, pack=False, num_proc=1),
                                 cache_dir=str(tmp_path / "cache2"))
    assert len(unpacked) == len(convs)
    one, two = (d.samples.with_format(None)["input_ids"] for d in (unpacked, dataset))
    assert list(one) == list(two)  # num_proc 2 tokenises exactly as num_proc 1


def test_first_fit_matches_the_plain_definition():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, 300).tolist()
    bins, room = [], []
    for item, length in enumerate(lengths):
        slot = next((b for b, r in enumerate(room) if r >= length), len(bins))
        if slot == len(bins):
            bins.append([])
            room.append(50)
        bins[slot].append(item)
        room[slot] -= length
    assert first_fit(lengths, 50) == bins
    assert first_fit([], 10) == []


def test_samples_without_trained_tokens_are_dropped(tmp_path, tokenizers):
    tokenizer, _ = tokenizers["chatml"]
    records = [{"messages": [{"role": "user", "content": "hello"}]},
               {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
               {"messages": []}]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    dataset = build_sft_dataset(path, tokenizer, SFTConfig(seq_length=32, pack=False), str(tmp_path / "cache"))
    assert len(dataset) == 1
    only_prompts = write_jsonl(tmp_path / "prompts.jsonl", records[:1])
    with pytest.raises(QlmError, match="no sample"):
        build_sft_dataset(only_prompts, tokenizer, SFTConfig(seq_length=32), str(tmp_path / "cache"))


def test_tokenizers_without_a_template_need_a_named_one(tmp_path):
    import datasets

    bare = load_tokenizer(build_demo_tokenizer(tmp_path / "bare", ["a b c"] * 5))
    bare.chat_template = None
    convs = datasets.Dataset.from_dict({"messages": conversations(2)})
    with pytest.raises(QlmError, match="has no chat template"):
        tokenize_conversations(convs, bare, SFTConfig(seq_length=64))
    assert len(tokenize_conversations(convs, bare, SFTConfig(seq_length=256, chat_template="chatml"))) == 2
