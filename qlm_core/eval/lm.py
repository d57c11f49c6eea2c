"""The `qlm` backend of lm-evaluation-harness: a TemplateLM over qlm's own model, loaded from any checkpoint qlm
reads (HF, Megatron at any TP/PP, a qlm run with LoRA adapters merged) with no export step.

With a tensor-parallel group every rank holds its slice of the model and runs the whole evaluation in lockstep: the
logits are gathered over the group, so every rank sees the same numbers, makes the same choices and issues the same
collectives; each reports rank 0 to lm-eval, which then builds the results on LOCAL_RANK 0 only.

Request handling mirrors lm-eval's `hf` backend (same tokenisation, truncation, batching order, stop handling) so
that both give the same numbers on the same weights: requests are sorted and restored with lm-eval's Collator,
rolling windows come from lm-eval's utilities, and generation uses a KV cache. Requests that share a context (multiple
choice) run it once and score each continuation from its KV cache (prefix_cache.py), with the same numbers.
"""

from __future__ import annotations

import torch
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from torch.distributed import ProcessGroup

from qlm_core.decode.model import load_model
from qlm_core.decode.sampling import Sampling, generate
from qlm_core.dtypes import DTYPES
from qlm_core.eval.prefix_cache import score_shared, split_shared
from qlm_core.eval.requests import CheckedRequests
from qlm_core.eval.scoring import score_plain
from qlm_core.parallel.state import default_device


class QlmBackend(TemplateLM):
    """lm-eval's LM interface on qlm's model; QlmLM (below) is what lm-eval uses, with its requests checked."""

    def __init__(self, pretrained: str, batch_size: int | str = 8, max_length: int | None = None,
                 dtype: str = "fp32", device: str | None = None, max_gen_toks: int = 256, add_bos_token=None,
                 tp_group: ProcessGroup | None = None, iteration: int | None = None, **kwargs):
        super().__init__()
        self._device = torch.device(device) if device else default_device()
        self.model, self.tokenizer, self.description = load_model(pretrained, DTYPES[dtype], self._device, tp_group,
                                                                  iteration)
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self._max_length = max_length or self.model.spec.max_position_embeddings
        self.model.spec.check_positions(self._max_length, "max_length")
        self.max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token

    # ---- tokenisation (as lm-eval's hf backend) ------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        special = {}  # as lm-eval's hf backend: the tokenizer's default unless told, no BOS twice
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        elif self.tokenizer.bos_token and string.startswith(self.tokenizer.bos_token):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # ---- scoring ---------------------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Requests that share a context score from its KV cache (prefix_cache.py), the rest each on its own row;
        both give the numbers of lm-eval's hf path."""
        groups, alone = split_shared(requests, self.max_length)
        answers = score_shared(self.model, groups, self.batch_size)
        answers.update(zip(alone, score_plain(self.model, [requests[i] for i in alone], self.batch_size,
                                              self.max_length), strict=True))
        results = [answers[i] for i in range(len(requests))]
        for (cache_key, _, _), answer in zip(requests, results, strict=True):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None,) + window)
                owners.append(index)
        # each window's context is the window before it: nothing to share
        scores = score_plain(self.model, windows, self.batch_size, self.max_length)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores, strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation ------------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        ordered = Collator([r.args for r in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                           group_by="gen_kwargs", group_fn=lambda r: r[1])
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        results = []
        for chunk in ordered.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            sampling = Sampling(temperature=kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0,
                                top_p=kwargs.get("top_p", 1.0) or 1.0, top_k=kwargs.get("top_k", 0) or 0)
            encoded = [self.tok_encode(c, left_truncate_len=self.max_length - max_gen_toks) for c in contexts]
            width = max(len(e) for e in encoded)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
            ids = torch.full((len(encoded), width), pad, dtype=torch.long)
            mask = torch.zeros(len(encoded), width, dtype=torch.long)
            for i, e in enumerate(encoded):
                ids[i, width - len(e):], mask[i, width - len(e):] = torch.tensor(e), 1

            # lm-eval's hf stop rule: a stop string within the decoded last len(its tokens) + 2 tokens (special
            # tokens count); decoding only that tail keeps each step's check short
            lookback = max((len(self.tokenizer.encode(term, add_special_tokens=False)) + 2 for term in until),
                           default=1)

            def reached_stop(tokens: list[int], until=until, lookback=lookback) -> bool:
                text = self.tokenizer.decode(tokens[-lookback:], skip_special_tokens=False)
                return any(term in text for term in until)

            outputs = generate(self.model, ids.to(self.device), mask.to(self.device), max_new_tokens=max_gen_toks,
                               eos_token_id=self.eot_token_id, sampling=sampling, stop=reached_stop)
            for context, tokens, gen_kwargs in zip(contexts, outputs, all_kwargs, strict=True):
                text = postprocess_generated_text(generation=self.tokenizer.decode(tokens, skip_special_tokens=True),
                                                  stop=until, think_end_token=None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return ordered.get_original(results)


@register_model("qlm")
class QlmLM(CheckedRequests, QlmBackend):
    """The "qlm" backend: every request's text checked (eval/requests.py), then scored by QlmBackend."""
