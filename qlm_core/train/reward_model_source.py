"""A trained reward model as an RL reward source: rl.reward_funcs names its checkpoint (any format qlm reads whose
model has a score head: a qlm run of data.kind = "reward", its Megatron checkpoint, a *ForSequenceClassification).

As TRL 1.16's GRPOTrainer scores with a model: a conversational prompt's turns plus the completion as the
assistant's turn are rendered with the reward model's own tokenizer and chat template (no generation prompt), a
prompt taken as written is joined to the completion as text; the text is tokenised without special tokens and the
reward is the score at its last token (transformers' sequence classifier pools at the last non-pad token: the same
token). The checkpoint is opened when the run is planned (a path that is no reward model is one line then); its
weights are read at the first score, once, whole, on each rank that scores (a data-parallel replica's leader), in
the run's dtype, and rows are scored SCORE_ROWS at a time."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from qlm_core.checkpoint.sources.open import open_checkpoint
from qlm_core.data.rl_prompts import CONVERSATION
from qlm_core.data.tokenizer import load_tokenizer
from qlm_core.decode.model import build_model
from qlm_core.errors import QlmError
from qlm_core.parallel.state import default_device

SCORE_ROWS = 16  # rows of one scoring forward: bounds the reward model's activations


def is_reward_model_path(name: str) -> bool:
    """Whether an rl.reward_funcs entry names a checkpoint directory rather than a function."""
    return Path(name).is_dir()


class RewardModelSource:
    """Callable on a batch of rows (prompts, completions, records) -> their rewards."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32):
        self.path, self.dtype = path, dtype
        self.opened = open_checkpoint(path)
        if self.opened.spec.head != "score":
            raise QlmError(f"reward {path} is a language model, not a reward model (no score head)",
                           "name a reward model (a data.kind = \"reward\" run or a *ForSequenceClassification), "
                           "or a reward function")
        if self.opened.tokenizer_dir is None:
            raise QlmError(f"reward {path}: no tokenizer found with the reward model",
                           "keep the tokenizer files beside the checkpoint")
        self.tokenizer = load_tokenizer(self.opened.tokenizer_dir)
        self.model = None

    @property
    def name(self) -> str:
        return Path(self.path).resolve().name

    def _text(self, prompt: str, completion: str, record: dict[str, Any]) -> str:
        turns = json.loads(record[CONVERSATION]) if record.get(CONVERSATION) else None
        if turns is None:
            return prompt + completion
        if not getattr(self.tokenizer, "chat_template", None):
            raise QlmError(f"reward {self.path}: its tokenizer has no chat template to render the conversation with",
                           "give the reward model's tokenizer the chat template it was trained with")
        messages = [*turns, {"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def encode(self, prompts: Sequence[str], completions: Sequence[str],
               records: Sequence[dict[str, Any]]) -> list[list[int]]:
        """Each row's token ids as the reward model reads them."""
        rows = []
        limit = self.opened.spec.max_position_embeddings
        for prompt, completion, record in zip(prompts, completions, records, strict=True):
            ids = list(self.tokenizer(self._text(prompt, completion, record), add_special_tokens=False)["input_ids"])
            if not ids or len(ids) > limit:
                raise QlmError(f"reward {self.path}: a prompt and completion of {len(ids)} tokens "
                               f"{'is empty' if not ids else f'exceeds its context of {limit}'}",
                               "lower rl.max_completion_length or shorten the prompts")
            rows.append(ids)
        return rows

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 records: Sequence[dict[str, Any]]) -> list[float]:
        if self.model is None:
            self.model = build_model(self.opened, self.dtype, default_device())
        device = next(self.model.parameters()).device
        rows, rewards = self.encode(prompts, completions, records), []
        for start in range(0, len(rows), SCORE_ROWS):
            chunk = rows[start:start + SCORE_ROWS]
            width = max(len(ids) for ids in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, tokens in enumerate(chunk):  # right-padded: a causal model's last tokens do not see the pad
                ids[row, :len(tokens)] = torch.tensor(tokens)
            scores = self.model(ids.to(device))[..., 0].float().cpu()
            rewards += [scores[row, len(tokens) - 1].item() for row, tokens in enumerate(chunk)]
        return rewards
