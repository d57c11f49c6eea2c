"""The requests lm-eval hands a backend, checked before any of them is scored: every text argument must be text, and
every continuation must fit the window (--max-length).

lm-eval reads a templated `doc_to_target` that looks like a Python list (`[1, 2, 3]`) with ast.literal_eval, so a
document whose text has that shape reaches the backend as a list, and the tokenizer or lm-eval's own sort fails
with a traceback far from the cause. Both backends (qlm's and lm-eval's hf) go through CheckedRequests."""

from __future__ import annotations

from qlm_core.errors import QlmError

# request type -> the names of its text arguments, in order (lm-eval's Instance.args)
TEXT_ARGUMENTS = {"loglikelihood": ("context", "continuation"), "loglikelihood_rolling": ("text",),
                  "generate_until": ("context",)}


def check_requests(requests, kind: str):
    for request in requests:
        for name, value in zip(TEXT_ARGUMENTS[kind], request.args, strict=False):
            if not isinstance(value, str):
                raise QlmError(
                    f"task {request.task_name} document {request.doc_id}: its {name} is a {type(value).__name__} "
                    f"({str(value)[:60]}), not text (lm-eval reads a templated doc_to_target that looks like a "
                    "Python list as one)",
                    "name the column itself in the task's YAML (doc_to_target: text, not \"{{text}}\"), or make "
                    "the document's text not look like a list")


def check_continuations_fit(requests, encode, max_length: int):
    """Every continuation fits the window: both backends keep the last max_length tokens of context + continuation
    and score the continuation's tokens within them."""
    for request in requests:
        tokens = len(encode(request.args[1]))
        if tokens > max_length:
            raise QlmError(f"task {request.task_name} document {request.doc_id}: its continuation is {tokens} tokens, "
                           f"more than the window of {max_length} (--max-length)",
                           f"pass --max-length {tokens} or more, or leave it out (the model's context window)")


class CheckedRequests:
    """A mixin put before an lm-eval LM class: its three request methods check their requests first."""

    def loglikelihood(self, requests, *args, **kwargs):
        check_requests(requests, "loglikelihood")
        check_continuations_fit(requests, self.tok_encode, self.max_length)
        return super().loglikelihood(requests, *args, **kwargs)

    def loglikelihood_rolling(self, requests, *args, **kwargs):
        check_requests(requests, "loglikelihood_rolling")
        return super().loglikelihood_rolling(requests, *args, **kwargs)

    def generate_until(self, requests, *args, **kwargs):
        check_requests(requests, "generate_until")
        return super().generate_until(requests, *args, **kwargs)
