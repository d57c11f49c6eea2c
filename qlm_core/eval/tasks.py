"""qlm's own lm-eval tasks, generated on the machine (nothing to download): the held-out questions of the CPU demo
that recipes/tiny-sft.toml trains on (qlm_core/data/demo.py), in three forms:

  qlm_demo_mc    multiple choice: the answer among 4 candidates (acc, acc_norm; chance is 0.25)
  qlm_demo_gen   generate_until the end of the turn, a regex filter keeps the answer symbols (exact_match)
  qlm_demo_ppl   loglikelihood_rolling over held-out demo text (word/byte perplexity, bits per byte), the plain
                 text tiny-pretrain.toml trains on (DEMO_NOTES: a chat-tuned model scores it badly, and why)

The prompts use the chatml turns the demo model was trained with, so no --apply-chat-template is needed. The data
is generated with the demo's default seed, so its questions are the ones tiny-sft.toml held out from training.
"""

from __future__ import annotations

import json
from pathlib import Path

from qlm_core.data.demo import build_demo
from qlm_core.disk import write_text_atomic

DEMO_TASKS = ("qlm_demo_mc", "qlm_demo_gen", "qlm_demo_ppl")
DEMO_SEED = 1234  # DataConfig.seed's default, which recipes/tiny-sft.toml keeps
PROMPT = "<|im_start|>user\n{{question}}<|im_end|>\n<|im_start|>assistant\n"

_YAML = {
    "qlm_demo_mc": """task: qlm_demo_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{prompt}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "qlm_demo_gen": """task: qlm_demo_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{prompt}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|im_end|>", "\\n"]
  max_gen_toks: 16
  do_sample: false
filter_list:
  - name: answer-symbols
    filter:
      - function: regex
        regex_pattern: "([a-h0-9](?: [a-h0-9])*)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "qlm_demo_ppl": """task: qlm_demo_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
""",
}


# what a demo task's figures mean, printed under its results
DEMO_NOTES = {
    "qlm_demo_ppl": "qlm_demo_ppl scores plain demo text, the format tiny-pretrain.toml trains on; a chat-tuned model "
                    "(tiny-sft.toml: chatml turns, loss on the answers only) never learned to predict that text, so "
                    "its perplexities run into the millions: judge it by qlm_demo_mc and qlm_demo_gen",
}


def write_demo_tasks(out_dir: Path, seed: int = DEMO_SEED) -> Path:
    """Generate the demo tasks' data and YAMLs under out_dir (an lm-eval include path); returns out_dir."""
    out_dir = Path(out_dir)
    paths = build_demo(out_dir / "demo", seed=seed)
    held_out_text = build_demo(out_dir / "demo-text", seed=seed + 1, num_train=10, num_eval=1,
                               corpus_paragraphs=40).corpus
    paragraphs = [p for p in held_out_text.read_text().split("\n\n") if p.strip()]
    ppl = out_dir / "qlm_demo_ppl.jsonl"
    write_text_atomic(ppl, "".join(json.dumps({"text": p.strip()}) + "\n" for p in paragraphs))
    data = {"qlm_demo_mc": paths.eval, "qlm_demo_gen": paths.eval, "qlm_demo_ppl": ppl}
    prompt = PROMPT.replace("\n", "\\n")
    for task, template in _YAML.items():
        write_text_atomic(out_dir / f"{task}.yaml", template.format(data=data[task].resolve(), prompt=prompt))
    return out_dir


