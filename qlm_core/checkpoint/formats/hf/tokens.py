"""The special token ids an exported HF model needs so that `model.generate` stops where a turn ends.

They are read from the tokenizer files beside the config (tokenizer_config.json, tokenizer.json, the chat template)
without loading a tokenizer: the eos token, and for a ChatML template (turns end with `<|im_end|>`) that token too;
config.json gets them as `eos_token_id` (an int, or a list when there are two) and generation_config.json, which
`model.generate` reads, gets bos / eos / pad.
"""

from __future__ import annotations

import json
from pathlib import Path

from qlm_core.errors import QlmError

GENERATION_CONFIG = "generation_config.json"
CHATML_END = "<|im_end|>"
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _read_json(path: Path, origin: Path | None = None) -> dict:
    """A JSON object file ({} when absent); errors name it as `origin`/NAME when it is a copy of a file there."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        shown = origin / path.name if origin is not None else path
        raise QlmError(f"cannot read {shown} ({type(exc).__name__}: {exc})", "restore a valid JSON file") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(directory: Path, tokenizer_config: dict, origin: Path | None) -> str:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = " ".join(t.get("template", "") for t in template if isinstance(t, dict))
    parts = [template if isinstance(template, str) else ""]
    for name in _TEMPLATE_FILES:
        file = directory / name
        if file.exists():
            try:
                parts.append(file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as exc:
                shown = origin / name if origin is not None else file
                raise QlmError(f"cannot read {shown} ({type(exc).__name__})", "restore the chat template file") \
                    from None
    return "\n".join(parts)


def _vocabulary(directory: Path, tokenizer_config: dict, origin: Path | None) -> dict[str, int]:
    """token text -> id: the tokenizer's added tokens and its model vocabulary."""
    ids: dict[str, int] = {}
    tokenizer = _read_json(directory / "tokenizer.json", origin)
    vocab = (tokenizer.get("model") or {}).get("vocab") if isinstance(tokenizer.get("model"), dict) else None
    if isinstance(vocab, dict):
        ids.update({k: v for k, v in vocab.items() if isinstance(v, int)})
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids.update({entry[0]: i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry})
    for entry in tokenizer.get("added_tokens") or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), int) and isinstance(entry.get("content"), str):
            ids[entry["content"]] = entry["id"]
    for key, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        if str(key).isdigit() and (text := _token_text(entry)) is not None:
            ids[text] = int(key)
    added = _read_json(directory / "added_tokens.json", origin)
    ids.update({k: v for k, v in added.items() if isinstance(v, int)})
    return ids


def special_token_ids(directory: str | Path, origin: Path | None = None) -> dict[str, int | list[int] | None]:
    """bos_token_id, eos_token_id (the eos token, plus `<|im_end|>` for a ChatML template) and pad_token_id of the
    tokenizer in `directory`; empty when it holds no tokenizer files. `origin`: where those files were copied from
    (errors name it)."""
    directory = Path(directory)
    tokenizer_config = _read_json(directory / "tokenizer_config.json", origin)
    if not tokenizer_config and not (directory / "tokenizer.json").exists():
        return {}
    ids = _vocabulary(directory, tokenizer_config, origin)

    def id_of(key: str) -> int | None:
        text = _token_text(tokenizer_config.get(key))
        return ids.get(text) if text is not None else None

    eos = [i for i in (id_of("eos_token"),) if i is not None]
    turn_end = None
    if CHATML_END in _chat_template(directory, tokenizer_config, origin) and ids.get(CHATML_END) is not None:
        turn_end = ids[CHATML_END]
    return {"bos_token_id": id_of("bos_token"), "eos_token_id": _merge_ids(None, eos),
            "pad_token_id": id_of("pad_token"), "turn_end_id": turn_end}


def _merge_ids(existing, extra: list[int]) -> int | list[int] | None:
    """`existing` (an id, a list or None) with the ids of `extra` it lacks appended; one id stays an int."""
    merged = [existing] if isinstance(existing, int) else [i for i in existing or [] if isinstance(i, int)]
    merged += [i for i in extra if i not in merged]
    if not merged:
        return None
    return merged[0] if len(merged) == 1 else merged


def add_special_tokens(out: str | Path, config: dict, origin: str | Path | None = None) -> dict:
    """`config` (an HF config.json dict) with bos/eos/pad ids filled in from the tokenizer files in `out`, and
    OUT/generation_config.json written (or completed) with the same ids, only where something changes. Ids already
    set are kept; a ChatML model gets `<|im_end|>` as an end of generation beside its eos token. `origin`: the
    directory OUT's tokenizer files were copied from (errors name it, not the temporary output)."""
    out = Path(out)
    origin = Path(origin) if origin is not None else None
    found = special_token_ids(out, origin)
    turn_end = [found["turn_end_id"]] if found.get("turn_end_id") is not None else []
    config = dict(config)
    if config.get("eos_token_id") is None:  # the tokenizer's eos token, unless the config names its own
        config["eos_token_id"] = found.get("eos_token_id")
    config["eos_token_id"] = _merge_ids(config.get("eos_token_id"), turn_end)
    for key in ("bos_token_id", "pad_token_id"):
        if config.get(key) is None and found.get(key) is not None:
            config[key] = found[key]
    generation = _read_json(out / GENERATION_CONFIG, origin)
    before = dict(generation)
    config_eos = config["eos_token_id"]
    eos = _merge_ids(generation.get("eos_token_id"),
                     [config_eos] if isinstance(config_eos, int) else list(config_eos or []))
    if eos is not None:
        generation["eos_token_id"] = eos
    for key in ("bos_token_id", "pad_token_id"):
        if generation.get(key) is None and config.get(key) is not None:
            generation[key] = config[key]
    if generation != before and any(generation.get(k) is not None for k in ("bos_token_id", "eos_token_id",
                                                                              "pad_token_id")):
        generation.setdefault("transformers_version", config.get("transformers_version", "4.45.0"))
        (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    return config
