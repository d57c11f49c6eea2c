"""RL prompt files: each record's prompt (a string, or a conversation ending with the user's turn) rendered as
transformers' apply_chat_template renders it with the generation prompt; the record's other fields kept for the
rewards; bad prompts are one line naming the file and the record."""

import json

import pytest

from qlm_core.data.demo import build_demo
from qlm_core.data.rl_prompts import CONVERSATION, load_prompts, user_fields
from qlm_core.data.tokenizer import load_tokenizer
from qlm_core.errors import QlmError


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_demo(tmp_path_factory.mktemp("demo") / "demo", num_train=50, num_eval=5, corpus_paragraphs=5,
                      preference_pairs=10, rl_prompts=10).tokenizer


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompts_render_as_transformers_chat_template_with_the_generation_prompt(tokenizer_dir, tmp_path):
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: c a b"}]
    path = _write(tmp_path / "p.jsonl", [{"prompt": "Largest of: 1 7 3", "answer": "7"},
                                        {"prompt": turns, "answer": "a b c"}])
    prompts = load_prompts(path, tokenizer_dir, None, seq_length=64, max_completion_length=8,
                           cache_dir=str(tmp_path / "cache"))
    tokenizer = load_tokenizer(tokenizer_dir)
    expected = [tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
                for conversation in ([{"role": "user", "content": "Largest of: 1 7 3"}], turns)]
    assert [list(ids) for ids in prompts.ids] == [list(e) for e in expected]
    assert [user_fields(r) for r in prompts.records] == [{"prompt": "Largest of: 1 7 3", "answer": "7"},
                                                         {"prompt": "Sort: c a b", "answer": "a b c"}]
    # the turns rendered, for a reward model's own template
    assert [json.loads(r[CONVERSATION]) for r in prompts.records] == [
        [{"role": "user", "content": "Largest of: 1 7 3"}], turns]


@pytest.mark.parametrize("record, message", [
    ({"prompt": [{"role": "assistant", "content": "hi"}]}, "record 1: the prompt's conversation does not end"),
    ({"prompt": [{"role": "user"}]}, "record 1: a prompt turn is not"),
    ({"prompt": "Reverse: " + " ".join("abcdefgh" * 4)}, "record 1: its prompt of .* leaves no room"),
])
def test_a_bad_prompt_is_one_line_naming_the_file_and_record(tokenizer_dir, tmp_path, record, message):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "Largest of: 1 7 3"}, record])
    with pytest.raises(QlmError, match=message):
        load_prompts(path, tokenizer_dir, None, seq_length=32, max_completion_length=8,
                     cache_dir=str(tmp_path / "cache"))
