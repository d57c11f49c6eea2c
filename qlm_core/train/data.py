"""The run's training and validation datasets from the recipe's [data] section.

`train = ["@demo"]` builds qlm's own CPU demo (a generated chat task and a tokenizer trained on it, see
qlm_core/data/demo.py) in the run's cache, so the README's first command needs no download.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import ConcatDataset, Subset

from qlm_core.config import PAIR_KINDS, DataConfig, DataKind, PreferenceConfig, RewardConfig, RlConfig, choices
from qlm_core.data.demo import build_demo
from qlm_core.data.indexed import IndexedDataset
from qlm_core.data.preference import PreferenceDataConfig, build_preference_dataset
from qlm_core.data.preprocess import preprocess
from qlm_core.data.pretrain import PretrainConfig, build_pretrain_datasets
from qlm_core.data.rl_prompts import PromptSet, load_prompts
from qlm_core.data.sft import SFTConfig, build_sft_dataset
from qlm_core.data.tokenizer import load_tokenizer
from qlm_core.disk import file_in_the_way
from qlm_core.errors import QlmError

DEMO = "@demo"


@dataclass
class RunData:
    train: object
    valid: object | None
    tokenizer_dir: Path | None
    truncated: int = 0  # preference data: the records whose prompt or responses were cut (every file, both splits)


def demo_paths(cache_dir: Path, seed: int):
    return build_demo(Path(cache_dir) / "demo", seed=seed)


def demo_corpus_prefix(paths, cache_dir: Path) -> str:
    """The demo's plain-text corpus as an indexed dataset (built once)."""
    prefix = Path(cache_dir) / "demo" / "corpus"
    if not (Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists()):
        preprocess([str(paths.corpus)], paths.tokenizer, prefix, append_eod=True,
                   cache_dir=str(Path(cache_dir) / "datasets"))
    return str(prefix)


def check_data_files(data: DataConfig):
    """Before any process starts: every named file or indexed prefix exists."""
    if not data.train:
        raise QlmError("data.train is empty", 'list the training files (or "@demo" for the built-in demo)')
    assert data.kind in choices(DataKind), data.kind  # the recipe's schema checked it (config.py)
    for name in list(data.train) + list(data.valid):
        if name == DEMO:
            continue
        if data.kind == "pretrain":
            if not (Path(f"{name}.bin").exists() and Path(f"{name}.idx").exists()):
                raise QlmError(f"indexed dataset {name}.bin/.idx does not exist",
                               "create it with qlm data preprocess, or fix data.train")
            if IndexedDataset(name).num_documents == 0:
                raise QlmError(f"indexed dataset {name} holds no documents", "preprocess non-empty input")
        elif not Path(name).is_file():
            raise QlmError(f"data file {name} does not exist", "fix data.train / data.valid")
        elif not _has_records(Path(name)):
            raise QlmError(f"data file {name} holds no records", "point data.train at a non-empty json/jsonl file")


def _has_records(path: Path) -> bool:
    """A cheap look: a jsonl with a non-blank line, or a json file that is not an empty list/object."""
    with open(path, "rb") as fh:
        head = fh.read(4096).strip()
    if path.suffix == ".json":
        return head not in (b"", b"[]", b"{}") and not (head.startswith(b"[") and head[1:].strip() == b"]")
    return bool(head)


def build_run_data(data: DataConfig, tokenizer_dir: Path | None, cache_dir: Path, train_samples: int,
                   valid_samples: int, preference: PreferenceConfig | None = None,
                   rl: RlConfig | None = None, reward: RewardConfig | None = None) -> RunData:
    train_names, valid_names = list(data.train), list(data.valid)
    if DEMO in train_names or DEMO in valid_names:
        paths = demo_paths(cache_dir, data.seed)
        demo = {"sft": paths.train, "preference": paths.preference, "reward": paths.preference,
                "rl": paths.rl}.get(data.kind)
        demo = str(demo) if demo is not None else demo_corpus_prefix(paths, cache_dir)
        train_names = [demo if n == DEMO else n for n in train_names]
        valid_names = [demo if n == DEMO else n for n in valid_names]
        tokenizer_dir = tokenizer_dir or paths.tokenizer
    if data.kind == "pretrain":
        return _pretrain(data, train_names, valid_names, tokenizer_dir, cache_dir, train_samples, valid_samples)
    if tokenizer_dir is None:
        raise QlmError(f"{data.kind} data needs a tokenizer", "set model.tokenizer or load an HF model with one")
    cache = str(Path(cache_dir) / "datasets")
    if data.kind == "rl":
        rl = rl or RlConfig()

        def build(name):
            return load_prompts(name, tokenizer_dir, data.chat_template or None, seq_length=data.seq_length,
                                max_completion_length=rl.max_completion_length, cache_dir=cache)
    elif data.kind in PAIR_KINDS:
        if data.kind == "reward":  # TRL's RewardConfig has max_length only: prompts are cut to fit it
            pref = PreferenceConfig(max_length=(reward or RewardConfig()).max_length)
        else:
            pref = preference or PreferenceConfig()
        config = PreferenceDataConfig(
            seq_length=data.seq_length, chat_template=data.chat_template or None, max_length=pref.max_length,
            max_prompt_length=pref.max_prompt_length, truncation_mode=pref.truncation_mode, format=data.format,
            num_proc=data.workers,
        )

        def build(name):
            return build_preference_dataset(name, tokenizer_dir, config, cache_dir=cache)
    else:
        config = SFTConfig(
            seq_length=data.seq_length, chat_template=data.chat_template or None, truncation=data.truncation,
            pack=data.packing, shuffle=True, seed=data.seed, num_proc=data.workers, format=data.format,
        )

        def build(name):
            return build_sft_dataset(name, tokenizer_dir, config, cache_dir=cache)
    train = [build(name) for name in train_names]
    valid = [build(name) for name in valid_names]
    if data.kind == "rl":
        return _prompt_data(data, train, valid, tokenizer_dir)
    truncated = sum(getattr(dataset, "truncated", 0) for dataset in train + valid)
    train_set = train[0] if len(train) == 1 else ConcatDataset(train)
    if valid:
        return RunData(train_set, valid[0] if len(valid) == 1 else ConcatDataset(valid), tokenizer_dir, truncated)
    held_out = int(len(train_set) * data.valid_fraction)
    if held_out == 0:
        return RunData(train_set, None, tokenizer_dir, truncated)
    cut = len(train_set) - held_out
    order = range(len(train_set))
    if data.kind in PAIR_KINDS:  # SFT data is shuffled when built; pairs keep the file's order, so hold out a sample
        order = np.random.default_rng(data.seed).permutation(len(train_set)).tolist()
    return RunData(Subset(train_set, order[:cut]), Subset(train_set, order[cut:]), tokenizer_dir, truncated)


def _prompt_data(data: DataConfig, train: list[PromptSet], valid: list[PromptSet], tokenizer_dir: Path) -> RunData:
    """RL prompts: the files joined; without data.valid, a seeded data.valid_fraction of them held out."""
    def joined(sets: list[PromptSet]) -> PromptSet:
        return PromptSet([i for s in sets for i in s.ids], [r for s in sets for r in s.records])

    train_set = joined(train)
    if valid:
        return RunData(train_set, joined(valid), tokenizer_dir)
    held_out = int(len(train_set) * data.valid_fraction)
    if held_out == 0:
        return RunData(train_set, None, tokenizer_dir)
    order = np.random.default_rng(data.seed).permutation(len(train_set)).tolist()
    cut = len(train_set) - held_out
    return RunData(train_set.subset(order[:cut]), train_set.subset(order[cut:]), tokenizer_dir)


def _pretrain(data, train_names, valid_names, tokenizer_dir, cache_dir, train_samples, valid_samples) -> RunData:
    eod = None
    if data.reset_position_ids:
        if tokenizer_dir is None:
            raise QlmError("reset_position_ids needs the tokenizer's end-of-document id", "set model.tokenizer")
        eod = load_tokenizer(tokenizer_dir).eos_token_id
    config = PretrainConfig(seq_length=data.seq_length, seed=data.seed, split=data.split,
                            reset_position_ids=data.reset_position_ids, eod_token_id=eod,
                            cache_dir=str(Path(cache_dir) / "index"))
    blend = list(zip(data.weights, train_names, strict=False)) if data.weights else train_names  # length checked below
    if len(data.weights) not in (0, len(train_names)):
        raise QlmError(f"data.weights has {len(data.weights)} entries for {len(train_names)} datasets",
                       "give one weight per training prefix")
    if valid_names:
        config_all = PretrainConfig(**{**config.__dict__, "split": "100,0"})
        train, _ = build_pretrain_datasets(blend, config_all, train_samples)
        valid, _ = build_pretrain_datasets(valid_names, config_all, valid_samples)
        return RunData(train, valid, tokenizer_dir)
    train, valid = build_pretrain_datasets(blend, config, train_samples, valid_samples)
    return RunData(train, valid, tokenizer_dir)


def check_cache_dir(setting: str, run_dir: Path):
    """The run's cache folder (data.cache_dir `setting`, else RUN/cache), or the first of its parents that exists,
    must be a folder: a file in the way is one line before any data is read."""
    path = Path(setting) if setting else Path(run_dir) / "cache"
    part = file_in_the_way(path)
    if part is not None:
        key = "data.cache_dir" if setting else "the run's cache folder (RUN/cache)"
        raise QlmError(f"{key} {path}: {part} is a file, not a folder",
                       "remove the file, or point data.cache_dir at a folder")
