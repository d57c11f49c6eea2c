"""`qlm eval`: resolve tasks offline-first, run lm-eval with the `qlm` backend (qlm's model on any checkpoint) or
lm-eval's own `hf` backend (on the checkpoint, exported to HF first when it is not HF), and write lm-eval's result
files."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from qlm_core.checkpoint.formats.hf.checkpoint import copy_side_files, is_hf_dir, write_hf_config
from qlm_core.checkpoint.formats.hf.write import write_hf
from qlm_core.checkpoint.io.staging import probe_writable
from qlm_core.checkpoint.sources.open import open_checkpoint
from qlm_core.config import EvalBackend, check_finite, choices
from qlm_core.decode.model import require_language_model
from qlm_core.dtypes import DTYPES, HF_DTYPE_NAMES, dtype_named
from qlm_core.errors import QlmError
from qlm_core.eval.tasks import DEMO_TASKS, write_demo_tasks
from qlm_core.models.layout import ModelLayout

BACKENDS = choices(EvalBackend)


@dataclass
class EvalConfig:
    checkpoint: str
    tasks: list[str]
    include_path: str | None = None
    num_fewshot: int | None = None
    limit: float | None = None
    batch_size: int = 8
    max_length: int | None = None
    apply_chat_template: bool = False
    backend: str = "qlm"
    dtype: str = "fp32"
    output: str | None = None
    log_samples: bool = False
    tp: int = 1  # tensor-parallel ranks for the qlm backend (one process each, launched by torchrun)
    cache_dir: str | None = None  # where qlm's generated demo tasks live
    iteration: int | None = None  # of a Megatron checkpoint root or a qlm run (default: its latest)


EVAL_EXTRA = 'pip install -e ".[eval]"'


def require_module(module: str, needed_by: str):
    """A missing optional dependency as one line naming the extra that brings it (found without importing it)."""
    if importlib.util.find_spec(module) is None:
        raise QlmError(f"{needed_by} needs the Python package {module}, which is not installed",
                       f"install qlm's eval extra: {EVAL_EXTRA}")


def results_folder(config: EvalConfig) -> Path | None:
    """Where --output puts lm-eval's files: as `lm_eval --output_path DIR` does, DIR/<model name>/ with the model
    named by the checkpoint path as given (lm-eval's sanitize_model_name: `runs/x` -> `runs__x`); a DIR ending in
    .json names the results file itself (lm-eval writes NAME_<date>.json beside it)."""
    if not config.output:
        return None
    output = Path(config.output)
    if output.suffix == ".json":
        return output.parent
    from lm_eval.utils import sanitize_model_name

    return output / sanitize_model_name(config.checkpoint)


def check_output(output: str):
    """--output must be a folder qlm can write, checked (created, a probe file written and removed) before any
    evaluation runs."""
    path = Path(output)
    folder = path.parent if path.suffix == ".json" else path
    if folder.exists() and not folder.is_dir():
        raise QlmError(f"--output {output} is a file, not a folder", "pass a folder for lm-eval's result files")
    try:
        probe_writable(folder)
    except OSError as exc:
        raise QlmError(f"cannot write to --output {output} ({exc.strerror or exc})",
                       "pass a folder you can write to") from None


def task_manager(config: EvalConfig):
    """A TaskManager that scans only local YAMLs when every task is local (no 14k built-in YAML scan, no hub);
    otherwise the built-in index, with a clear error for tasks that need the Hugging Face hub."""
    from lm_eval.tasks import TaskManager

    include = []
    if any(t in DEMO_TASKS for t in config.tasks):
        cache = Path(config.cache_dir or Path(tempfile.gettempdir()) / "qlm-eval-tasks")
        include.append(str(write_demo_tasks(cache)))
    if config.include_path:
        if not Path(config.include_path).exists():
            raise QlmError(f"--include-path {config.include_path} does not exist", "point it at a folder of task YAMLs")
        include.append(config.include_path)
    local = TaskManager(include_path=include or None, include_defaults=False) if include else None
    if local is not None and all(t in local.all_tasks for t in config.tasks):
        return local
    manager = TaskManager(include_path=include or None, include_defaults=True)
    unknown = [t for t in config.tasks if t not in manager.all_tasks]
    if unknown:
        raise QlmError(f"unknown task(s) {', '.join(unknown)}",
                       f"qlm's own tasks are {', '.join(DEMO_TASKS)}; others need --include-path or lm-eval's names")
    return manager


def _hf_dir_for(checkpoint: str, workdir: Path, dtype: torch.dtype, iteration: int | None = None) -> str:
    """The checkpoint as an HF directory for lm-eval's hf backend (exported when it is not one)."""
    opened = open_checkpoint(checkpoint, iteration)
    require_language_model(opened, checkpoint)
    if is_hf_dir(Path(checkpoint)) and iteration is None:
        return checkpoint
    layout = ModelLayout(opened.spec, make_vocab_size_divisible_by=opened.make_vocab_size_divisible_by)
    out = workdir / "hf"
    out.mkdir(parents=True)
    write_hf(out, layout, opened.weights, dtype, 2**40, lambda *a: None)
    if opened.tokenizer_dir is not None:
        copy_side_files(opened.tokenizer_dir, out)
    write_hf_config(out, None, opened.spec, dtype)  # the opened checkpoint's architecture, whatever lies beside it
    return str(out)


def check_config(config: EvalConfig):
    """Errors a user can fix before any process starts: every number, the output folder, the packages."""
    if config.backend not in BACKENDS:
        raise QlmError(f"backend {config.backend!r} is not one of {', '.join(BACKENDS)}", "pass --backend qlm or hf")
    if config.tp < 1:
        raise QlmError(f"--tp {config.tp} is not a process count", "pass --tp 1 or more")
    if config.tp > 1 and config.backend != "qlm":
        raise QlmError(f"--tp {config.tp} needs the qlm backend", "drop --tp for lm-eval's hf backend (one process)")
    dtype_named(config.dtype, "--dtype")
    if not Path(config.checkpoint).exists():
        raise QlmError(f"{config.checkpoint} does not exist",
                       "point at an HF model, a Megatron or DeepSpeed checkpoint, or a qlm run directory")
    if not config.tasks:
        raise QlmError("--tasks names no task", f"pass comma-separated task names, e.g. --tasks {DEMO_TASKS[0]}")
    check_finite("--limit", config.limit)
    if config.limit is not None and (config.limit <= 0 or (config.limit >= 1 and config.limit != int(config.limit))):
        raise QlmError(f"--limit {config.limit:g} is neither a document count nor a fraction",
                       "pass a count of 1 or more, or a fraction in (0, 1)")
    counts = {"--batch-size": (config.batch_size, 1), "--max-length": (config.max_length, 1),
              "--num-fewshot": (config.num_fewshot, 0), "--iteration": (config.iteration, 0)}
    for flag, (value, least) in counts.items():
        if value is not None and value < least:
            raise QlmError(f"{flag} {value} is out of range", f"pass {least} or more")
    require_module("lm_eval", "qlm eval")
    if config.backend == "hf":
        require_module("accelerate", "lm-eval's hf backend")
    if config.output:
        check_output(config.output)


def documents_limit(limit: float | None) -> float | int | None:
    """lm-eval's `limit`: a fraction as given, a count as an int; a count past any task (beyond what Python can
    slice) is every document."""
    if limit is None or limit < 1:
        return limit
    return None if limit > sys.maxsize else int(limit)


def worker_argv(config: EvalConfig) -> list[str]:
    """`qlm eval` arguments that make every torchrun worker run `config` (paths as given: workers share the cwd)."""
    argv = ["eval", config.checkpoint, "--tasks", ",".join(config.tasks), "--batch-size", str(config.batch_size),
            "--backend", config.backend, "--dtype", config.dtype, "--tp", str(config.tp)]
    optional = {"--include-path": config.include_path, "--num-fewshot": config.num_fewshot, "--limit": config.limit,
                "--max-length": config.max_length, "--output": config.output, "--iteration": config.iteration}
    argv += [arg for flag, value in optional.items() if value is not None for arg in (flag, str(value))]
    flags = {"--apply-chat-template": config.apply_chat_template, "--log-samples": config.log_samples}
    return argv + [flag for flag, on in flags.items() if on]


def _tensor_parallel_group(config: EvalConfig):
    """Under torchrun with config.tp ranks: the TP group (None for one process)."""
    from qlm_core.parallel.state import Grid, init_distributed, resolve_sizes

    if config.tp == 1:
        return None
    _, world = init_distributed()
    if world != config.tp:
        raise QlmError(f"qlm eval --tp {config.tp} runs {config.tp} processes, but this launch has {world}",
                       f"launch {config.tp} ranks (qlm eval starts torchrun itself when not under one)")
    return Grid.build(resolve_sizes(world, tp=config.tp)).tp_group


def _git_hash_quietly() -> str | None:
    """lm-eval records `git describe` of the cwd; outside a repository its git call prints `fatal: not a git
    repository` on stderr. The same hash, without the noise."""
    try:
        proc = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except OSError:  # no git
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def _quiet_libraries():
    """Keep lm-eval's own request progress; drop the loading bars of transformers and datasets and lm-eval's git
    noise (qlm's tasks carry every metric field, so lm-eval does not warn about them)."""
    import datasets
    import lm_eval.evaluator
    from transformers.utils import logging as transformers_logging

    lm_eval.evaluator.get_git_commit_hash = _git_hash_quietly
    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def run_eval(config: EvalConfig) -> dict | None:
    """lm-eval's results dict (with "samples" when log_samples); None on the other ranks of a TP evaluation."""
    check_config(config)
    import lm_eval

    from qlm_core.eval import lm as _register_qlm_backend  # noqa: F401  (registers model "qlm")
    from qlm_core.parallel.state import destroy_distributed

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _quiet_libraries()
    tp_group = _tensor_parallel_group(config)
    manager = task_manager(config)
    workdir = Path(tempfile.mkdtemp(prefix="qlm-eval-"))
    try:
        if config.backend == "qlm":
            from qlm_core.eval.lm import QlmLM

            model = QlmLM(config.checkpoint, batch_size=config.batch_size, max_length=config.max_length,
                          dtype=config.dtype, tp_group=tp_group, iteration=config.iteration)
            model_args = None
        else:
            from lm_eval.models.huggingface import HFLM

            from qlm_core.eval.requests import CheckedRequests

            dtype = DTYPES[config.dtype]
            hf_args = {"pretrained": _hf_dir_for(config.checkpoint, workdir, dtype, config.iteration),
                       "dtype": HF_DTYPE_NAMES[dtype], "batch_size": config.batch_size,
                       "device": "cuda" if torch.cuda.is_available() else "cpu"}
            if config.max_length:
                hf_args["max_length"] = config.max_length
            model = type("CheckedHFLM", (CheckedRequests, HFLM), {})(**hf_args)  # lm-eval's hf, requests checked
            model_args = None
        try:
            results = lm_eval.simple_evaluate(
                model=model, model_args=model_args, tasks=config.tasks, num_fewshot=config.num_fewshot,
                limit=documents_limit(config.limit), batch_size=config.batch_size, log_samples=config.log_samples,
                apply_chat_template=config.apply_chat_template, task_manager=manager,
            )
        except ConnectionError as exc:
            raise QlmError(f"a task needs the Hugging Face hub, which is not reachable ({exc})",
                           "give it local data: a task YAML with dataset_path: json in --include-path") from None
        except Exception as exc:  # datasets raises several types when a hub dataset is missing offline
            if "offline" in str(exc).lower() or "hub" in str(exc).lower() or "couldn't" in str(exc).lower():
                raise QlmError(f"a task's dataset is not available offline ({str(exc).splitlines()[0]})",
                               "give it local data: a task YAML with dataset_path: json in --include-path") from None
            raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if config.tp > 1:
            destroy_distributed()
    if config.output and results is not None:
        save_results(results, config)
    return results


def save_results(results: dict, config: EvalConfig) -> Path:
    """Results (and per-sample logs) in lm-eval's own file layout, via its EvaluationTracker, under
    results_folder(config); returns the results file. lm-eval logs a failed write and carries on: qlm raises."""
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(config.output))
    tracker.general_config_tracker.log_experiment_args(
        model_source=config.backend, model_args={"pretrained": config.checkpoint},
        system_instruction=None, chat_template=None, fewshot_as_multiturn=False)
    samples = results.pop("samples", None) if config.log_samples else None
    tracker.save_results_aggregated(results=results, samples=samples)
    output, date_id = Path(config.output), getattr(tracker, "date_id", "")
    written = (output.with_name(f"{output.stem}_{date_id}.json") if output.suffix == ".json"
               else results_folder(config) / f"results_{date_id}.json")
    if not date_id or not written.is_file():
        raise QlmError(f"lm-eval could not write its results under {config.output}",
                       "pass an --output folder you can write to")
    if samples:
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    if samples is not None:
        results["samples"] = samples
    return written


def result_rows(results: dict) -> list[tuple[str, str, str, float, float | None]]:
    """(task, filter, metric, value, stderr) for every reported metric."""
    rows = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if key in ("alias", "sample_len") or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, _, filter_name = key.partition(",")
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            rows.append((task, filter_name, metric, float(value),
                         float(stderr) if isinstance(stderr, (int, float)) else None))
    return rows
