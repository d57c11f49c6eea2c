"""A CPU demo that needs no download: synthetic chat tasks a ~1-3M-parameter model learns in a few hundred steps.

Three tasks over short lists of one-token symbols (letters a-h, digits 0-9, written space-separated so the
byte-level BPE gives each symbol its own token):
    reverse   "Reverse: c a f b"          -> "b f a c"
    sort      "Sort: d a h b"             -> "a b d h"
    largest   "Largest of: 3 7 2 5"       -> "7"
Why a tiny transformer learns them quickly: every answer token is a copy of a prompt token chosen by a fixed rule
(by position for reverse, by rank for sort and largest), which is what attention does best; the prompts are ~10
tokens, the answer alphabet 18 symbols, and the tasks repeat thousands of times in a few hundred steps. The answers
are exact strings, so correctness is checkable, and the held-out eval prompts never occur in training: a model that
scores well has learnt the rule, not the examples.

Files written by build_demo:
    tokenizer/    byte-level BPE (vocab 512) with the chatml template (see tokenizer.build_demo_tokenizer)
    train.jsonl   {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} per line (OpenAI format)
    eval.jsonl    {"task", "question", "answer", "choices" (4 strings), "label" (index of the answer)} per line;
                  the wrong choices are near misses (another order of the same symbols, another symbol of the list)
    preference.jsonl  {"prompt", "chosen", "rejected"} per line (TRL's format): the answer and a near miss
    rl.jsonl      {"prompt", "answer", "task"} per line: "largest" prompts for RL, scored by their exact answer
    corpus.txt    pretraining text: paragraphs (blank-line separated) of "question\\nanswer" pairs
Everything is a deterministic function of the seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from qlm_core.data.tokenizer import build_demo_tokenizer
from qlm_core.errors import QlmError

LETTERS = "abcdefgh"
DIGITS = "0123456789"
TASKS = ("reverse", "sort", "largest")
LIST_LENGTH = 4


@dataclass
class DemoPaths:
    root: Path
    tokenizer: Path
    train: Path
    eval: Path
    corpus: Path
    preference: Path
    rl: Path


@dataclass
class Example:
    task: str
    question: str
    answer: str
    wrong: list[str]  # three plausible wrong answers


def make_example(task: str, rng: random.Random) -> Example:
    if task == "largest":
        items = rng.sample(DIGITS, LIST_LENGTH)
        answer = max(items)
        return Example(task, f"Largest of: {' '.join(items)}", answer, [d for d in items if d != answer])
    items = rng.sample(LETTERS, LIST_LENGTH)
    answer = list(reversed(items)) if task == "reverse" else sorted(items)
    wrong: list[str] = []
    while len(wrong) < 3:  # other orders of the same letters
        order = rng.sample(items, LIST_LENGTH)
        if order != answer and " ".join(order) not in wrong:
            wrong.append(" ".join(order))
    prompt = "Reverse" if task == "reverse" else "Sort"
    return Example(task, f"{prompt}: {' '.join(items)}", " ".join(answer), wrong)


def generate(seed: int, num_train: int, num_eval: int) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples; eval questions are distinct and never appear in train; tasks take turns."""
    rng = random.Random(seed)
    evals, held_out = [], set()
    while len(evals) < num_eval:
        example = make_example(TASKS[len(evals) % len(TASKS)], rng)
        if example.question not in held_out:
            held_out.add(example.question)
            evals.append(example)
    train = []
    while len(train) < num_train:
        example = make_example(TASKS[len(train) % len(TASKS)], rng)
        if example.question not in held_out:
            train.append(example)
    return train, evals


def messages(example: Example) -> list[dict]:
    return [{"role": "user", "content": example.question}, {"role": "assistant", "content": example.answer}]


def build_demo(out_dir: str | os.PathLike, seed: int = 0, num_train: int = 3000, num_eval: int = 150,
               corpus_paragraphs: int = 500, pairs_per_paragraph: int = 6,
               preference_pairs: int = 1200, rl_prompts: int = 2000) -> DemoPaths:
    """Write the demo tokenizer, train.jsonl, eval.jsonl and corpus.txt under out_dir, once: a complete directory
    with the same parameters is reused. It is built in a private directory and renamed into place, so processes
    that build it at the same time (the ranks of a run) never read a half-written file."""
    root = Path(out_dir)
    params = dict(seed=seed, num_train=num_train, num_eval=num_eval, corpus_paragraphs=corpus_paragraphs,
                  pairs_per_paragraph=pairs_per_paragraph, preference_pairs=preference_pairs, rl_prompts=rl_prompts)
    paths = _paths(root)
    if _intact(root, params):
        return paths
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise QlmError(f"cannot make the demo data under {root.parent}: a part of that path is a file",
                       "point data.cache_dir (or --output) at a directory") from None
    private = root.parent / f".{root.name}.{os.getpid()}.partial"
    shutil.rmtree(private, ignore_errors=True)
    _write_demo(private, **params)
    (private / "demo.json").write_text(json.dumps({"params": params, "files": _digests(private)}))
    if root.exists():  # an older or different build: replace it (a concurrent identical build may win the race)
        stale = root.parent / f".{root.name}.{os.getpid()}.stale"
        try:
            os.replace(root, stale)
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    try:
        os.replace(private, root)
    except OSError:  # another process put a complete build in place first
        shutil.rmtree(private, ignore_errors=True)
    return paths


def _digests(root: Path) -> dict[str, str]:
    """sha256 of every file of a demo build, by its path inside it (the stamp, demo.json, aside)."""
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file() and f.name != "demo.json"}


def _intact(root: Path, params: dict) -> bool:
    """A complete build of these parameters whose files are as written: a file cut short or edited since (a
    cache, not a user's data) makes the demo be built again, never trained on."""
    try:
        stamp = json.loads((root / "demo.json").read_text())
        return (isinstance(stamp, dict) and stamp.get("params") == params
                and stamp.get("files") == _digests(root))
    except (OSError, ValueError):
        return False


def _paths(root: Path) -> DemoPaths:
    return DemoPaths(root, root / "tokenizer", root / "train.jsonl", root / "eval.jsonl", root / "corpus.txt",
                     root / "preference.jsonl", root / "rl.jsonl")


def distinct_examples(seed: int, count: int, exclude: set[str], tasks: tuple[str, ...] = TASKS) -> list[Example]:
    """`count` examples of `tasks` with distinct questions, none in `exclude`; tasks take turns."""
    rng = random.Random(seed)
    out, seen = [], set(exclude)
    while len(out) < count:
        example = make_example(tasks[len(out) % len(tasks)], rng)
        if example.question not in seen:
            seen.add(example.question)
            out.append(example)
    return out


def _write_demo(out_dir: str | os.PathLike, seed: int = 0, num_train: int = 3000, num_eval: int = 150,
                corpus_paragraphs: int = 500, pairs_per_paragraph: int = 6, preference_pairs: int = 1200,
                rl_prompts: int = 2000) -> DemoPaths:
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = _paths(root)
    train, evals = generate(seed, num_train + corpus_paragraphs * pairs_per_paragraph, num_eval)
    sft, pretrain = train[:num_train], train[num_train:]
    rng = random.Random(seed + 3)
    with open(paths.preference, "w") as out:
        for example in distinct_examples(seed + 2, preference_pairs, {e.question for e in evals}):
            out.write(json.dumps({"prompt": example.question, "chosen": example.answer,
                                  "rejected": rng.choice(example.wrong)}) + "\n")

    # prompts for RL, scored by their exact answer (rewards.exact_answer): the one-token task, whose right answer a
    # partly trained model samples now and then (the learning signal), where four letters in order it rarely does
    with open(paths.rl, "w") as out:
        for example in distinct_examples(seed + 4, rl_prompts, {e.question for e in evals}, ("largest",)):
            out.write(json.dumps({"prompt": example.question, "answer": example.answer, "task": example.task}) + "\n")
    with open(paths.train, "w") as out:
        for example in sft:
            out.write(json.dumps({"messages": messages(example)}) + "\n")
    rng = random.Random(seed + 1)
    with open(paths.eval, "w") as out:
        for example in evals:
            choices = [example.answer, *example.wrong]
            rng.shuffle(choices)
            record = dict(task=example.task, question=example.question, answer=example.answer, choices=choices,
                          label=choices.index(example.answer))
            out.write(json.dumps(record) + "\n")
    paragraphs = ["\n".join(f"{e.question}\n{e.answer}" for e in pretrain[i:i + pairs_per_paragraph])
                  for i in range(0, len(pretrain), pairs_per_paragraph)]
    paths.corpus.write_text("\n\n".join(paragraphs) + "\n")

    # the tokenizer sees the corpus and the chat roles, so "user" / "assistant" become single tokens
    chats = [f"user\n{e.question}\nassistant\n{e.answer}\nsystem\n" for e in sft[:500]]
    build_demo_tokenizer(paths.tokenizer, paragraphs + chats)
    return paths
