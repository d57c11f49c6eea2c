"""`qlm generate CKPT --prompt TEXT`: try a checkpoint with a chat prompt (qlm's model, KV-cache decoding)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from qlm_cli.choices import WeightDtype
from qlm_cli.render import err_console


def _write(text: str):
    """Answers go to stdout as written (no Rich markup or emoji codes). A reader that stops early (`| head`) ends the
    command quietly, as other Unix tools do."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        try:  # the interpreter's last flush would fail again: point stdout at nothing
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        raise typer.Exit(1) from None


def _stdout_is_utf8() -> bool:
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    return encoding.lower().replace("-", "").replace("_", "") == "utf8"


def generate_command(
    checkpoint: Annotated[str, typer.Argument(help="An HF model, a Megatron checkpoint (torch or torch_dist, any "
                                                   "TP/PP; its root or one iter_N directory), a DeepSpeed checkpoint "
                                                   "or a qlm run directory (its latest checkpoint, or --iteration; "
                                                   "LoRA adapters merged).")],
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", "-p", help="A user message (repeatable: one batch, left-padded); - reads one a line from "
        "stdin.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(
        "--prompt-file", help="A UTF-8 text file of prompts, one a line.")] = None,
    system: Annotated[str | None, typer.Option("--system", help="A system message before each prompt.")] = None,
    chat_template: Annotated[str | None, typer.Option(
        "--chat-template", help="chatml, qwen, llama3 or a Jinja template (default: the tokenizer's own).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template: the prompt as written.")] = False,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="A tokenizer directory (default: the one beside the checkpoint).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Longest answer in tokens.")] = 256,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="0: greedy (the default); above 0: sampling.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1: off).")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k likeliest tokens (0: off).")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 1234,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts decoded together.")] = 8,
    dtype: Annotated[WeightDtype, typer.Option("--dtype", help="Weights and compute dtype.")] = WeightDtype["fp32"],
    iteration: Annotated[int | None, typer.Option(
        "--iteration", help="The iteration of a Megatron checkpoint root or a qlm run (default: its latest).")] = None,
    jsonl: Annotated[bool, typer.Option(
        "--jsonl", help="One JSON object a prompt: prompt, answer, token_ids, finish (stop or length).")] = False,
):
    """Answer prompts with a checkpoint: its tokenizer's chat template, KV-cache decoding, greedy unless
    --temperature; a turn ends at eos or the template's end-of-turn token. One answer streams as it is decoded."""
    from qlm_core.decode.generator import Generator, check_batching
    from qlm_core.decode.prompt_input import collect_prompts
    from qlm_core.decode.prompts import Prompting, TextStream
    from qlm_core.decode.sampling import Sampling, check_sampling
    from qlm_core.dtypes import DTYPES

    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    check_sampling(sampling, max_new_tokens)
    check_batching(batch_size, iteration)
    prompts = collect_prompts(prompt or [], prompt_file,
                              lambda text: err_console.print(text, markup=False, highlight=False))
    if hasattr(sys.stdout, "reconfigure"):  # a terminal that cannot show a character gets "?", not a crash
        sys.stdout.reconfigure(errors="replace")
    generator = Generator.open(checkpoint, prompting=Prompting(chat_template, raw, system), tokenizer=tokenizer,
                               iteration=iteration)
    encoded = generator.encode(prompts)  # every prompt checked before the weights are read
    generator.load(DTYPES[dtype.value])
    warning = generator.window_warning(encoded, max_new_tokens)
    if warning:
        err_console.print(warning, markup=False, highlight=False, soft_wrap=True)
    stream = TextStream(generator.tokenizer, generator.stops) if len(prompts) == 1 and not jsonl else None
    on_token = (lambda _row, token: _write(stream.push(token))) if stream is not None else None
    for start in range(0, len(prompts), batch_size):
        batch = encoded[start:start + batch_size]
        for offset, generation in enumerate(generator.run(batch, max_new_tokens=max_new_tokens, sampling=sampling,
                                                          on_token=on_token)):
            number = start + offset
            if stream is not None:
                _write(stream.finish(generation.tokens) + "\n")
            elif jsonl:
                _write(json.dumps({"prompt": prompts[number], "answer": generator.text(generation),
                                   "token_ids": generation.tokens, "finish": generation.finish},
                                  ensure_ascii=not _stdout_is_utf8()) + "\n")  # lossless either way
            else:
                _write(f"==> prompt {number + 1} <==\n{generator.text(generation)}\n")
