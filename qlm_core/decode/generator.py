"""A checkpoint opened for decoding (`qlm generate`): its tokenizer, prompt template and stops first (no weights
read, so that every prompt is checked before), then qlm's model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR
from qlm_core.checkpoint.sources.open import OpenedCheckpoint, open_checkpoint
from qlm_core.data.tokenizer import load_tokenizer
from qlm_core.decode.model import build_model, require_language_model
from qlm_core.decode.prompts import Prompting, Stops, answer_text, encode_prompt, prompt_template, stop_tokens
from qlm_core.decode.sampling import Generation, Sampling, generate_rows, left_pad
from qlm_core.errors import QlmError
from qlm_core.models.gpt import GPTModel
from qlm_core.parallel.state import default_device


def check_batching(batch_size: int, iteration: int | None):
    """`qlm generate`'s --batch-size and --iteration, each named when out of range."""
    if batch_size < 1:
        raise QlmError(f"--batch-size {batch_size} holds no prompt", "pass --batch-size 1 or more")
    if iteration is not None and iteration < 0:
        raise QlmError(f"--iteration {iteration} is negative", "pass an iteration of the checkpoint, or drop it")


@dataclass
class Generator:
    """A checkpoint opened for `qlm generate`: its tokenizer, the prompt template, the stops, and (after load())
    qlm's model. Opening reads no weights, so that every prompt can be checked first."""

    opened: OpenedCheckpoint
    tokenizer: object
    template: str | None
    stops: Stops
    system: str | None = None
    model: GPTModel | None = None

    @classmethod
    def open(cls, checkpoint: str | Path, *, prompting: Prompting, tokenizer: str | Path | None = None,
             iteration: int | None = None) -> Generator:
        """`iteration` of a Megatron root or a qlm run (default: its latest)."""
        opened = open_checkpoint(checkpoint, iteration)
        require_language_model(opened, checkpoint)
        tokenizer_dir = tokenizer if tokenizer is not None else opened.tokenizer_dir
        if tokenizer_dir is None:
            raise QlmError(f"no tokenizer found with {checkpoint}", "pass --tokenizer DIR (a Hugging Face tokenizer)")
        loaded = load_tokenizer(tokenizer_dir)
        template = prompt_template(loaded, prompting, str(tokenizer_dir))
        path = Path(checkpoint)
        stops = stop_tokens(loaded, template, [opened.tokenizer_dir, path, path / HF_SIDE_DIR])
        return cls(opened, loaded, template, stops, prompting.system)

    @property
    def context(self) -> int:
        """The model's context window in tokens."""
        return self.opened.spec.max_position_embeddings

    def load(self, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> Generator:
        """Read the weights into qlm's model (the one `qlm eval` builds)."""
        self.model = build_model(self.opened, dtype, device or default_device())
        return self

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt; one-line errors for a prompt that is empty, too long or out of vocabulary."""
        vocab = self.opened.spec.vocab_size
        encoded = []
        for number, prompt in enumerate(prompts, 1):
            ids = encode_prompt(self.tokenizer, prompt, self.template, self.system)
            what = f"prompt {number}" if len(prompts) > 1 else "the prompt"
            if not ids:
                raise QlmError(f"{what} is empty", "give it some text")
            if len(ids) >= self.context:
                raise QlmError(f"{what} is {len(ids)} tokens, but the model's context window is {self.context}",
                               f"shorten it below {self.context} tokens")
            if max(ids) >= vocab:
                raise QlmError(f"the tokenizer gives token id {max(ids)}, outside the model's vocabulary of {vocab}",
                               "pass this model's tokenizer with --tokenizer DIR")
            encoded.append(ids)
        return encoded

    def run(self, encoded: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling,
            on_token: Callable[[int, int], None] | None = None) -> list[Generation]:
        """Generate for one batch of encoded prompts; at most to the end of the context window."""
        assert self.model is not None, "load() the weights first"
        rooms = [self.context - len(ids) for ids in encoded]  # each prompt's own room in the window
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        ids, mask = left_pad(encoded, pad)
        device = next(self.model.parameters()).device
        return generate_rows(self.model, ids.to(device), mask.to(device),
                             max_new_tokens=min(max_new_tokens, max(rooms)), eos_token_id=self.stops.ids,
                             sampling=sampling, stop=self.stops.reached(self.tokenizer), on_token=on_token,
                             row_limits=rooms)

    def window_warning(self, encoded: Sequence[Sequence[int]], max_new_tokens: int) -> str | None:
        """A warning line when the longest prompt leaves fewer than max_new_tokens tokens of the window."""
        longest = max(len(ids) for ids in encoded)
        if longest + max_new_tokens <= self.context:
            return None
        return (f"warning: answers stop at the context window of {self.context} tokens (the longest prompt has "
                f"{longest})")

    def text(self, generation: Generation) -> str:
        return answer_text(self.tokenizer, generation.tokens, self.stops)
