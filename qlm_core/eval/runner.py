"""`qlm eval`: resolve tasks offline-first, run lm-eval with the `qlm` backend (qlm's model on any checkpoint) or
lm-eval's own `hf` backend (on the checkpoint, exported to HF first when it is not HF), and write lm-eval's result
files."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from qlm_core.checkpoint.convert.hf_megatron import write_hf
from qlm_core.checkpoint.formats.hf import copy_side_files, is_hf_dir, write_hf_config
from qlm_core.checkpoint.sources.open import open_checkpoint
from qlm_core.config import EvalBackend, choices
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


def _hf_dir_for(checkpoint: str, workdir: Path, dtype: torch.dtype) -> str:
    """The checkpoint as an HF directory for lm-eval's hf backend (exported when it is not one)."""
    if is_hf_dir(Path(checkpoint)):
        return checkpoint
    opened = open_checkpoint(checkpoint)
    layout = ModelLayout(opened.spec, make_vocab_size_divisible_by=opened.make_vocab_size_divisible_by)
    out = workdir / "hf"
    out.mkdir(parents=True)
    write_hf(out, layout, opened.weights, dtype, 2**40, lambda *a: None)
    if opened.tokenizer_dir is not None:
        copy_side_files(opened.tokenizer_dir, out)
    write_hf_config(out, None, opened.spec, dtype)  # the opened checkpoint's architecture, whatever lies beside it
    return str(out)


def check_config(config: EvalConfig):
    """Errors a user can fix before any process starts."""
    if config.backend not in BACKENDS:
        raise QlmError(f"backend {config.backend!r} is not one of {', '.join(BACKENDS)}", "pass --backend qlm or hf")
    if config.tp > 1 and config.backend != "qlm":
        raise QlmError(f"--tp {config.tp} needs the qlm backend", "drop --tp for lm-eval's hf backend (one process)")
    dtype_named(config.dtype, "--dtype")
    if config.tp < 1:
        raise QlmError(f"--tp {config.tp} is not a process count", "pass --tp 1 or more")


def worker_argv(config: EvalConfig) -> list[str]:
    """`qlm eval` arguments that make every torchrun worker run `config` (paths as given: workers share the cwd)."""
    argv = ["eval", config.checkpoint, "--tasks", ",".join(config.tasks), "--batch-size", str(config.batch_size),
            "--backend", config.backend, "--dtype", config.dtype, "--tp", str(config.tp)]
    optional = {"--include-path": config.include_path, "--num-fewshot": config.num_fewshot, "--limit": config.limit,
                "--max-length": config.max_length, "--output": config.output}
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


def run_eval(config: EvalConfig) -> dict | None:
    """lm-eval's results dict (with "samples" when log_samples); None on the other ranks of a TP evaluation."""
    import lm_eval

    from qlm_core.eval import lm as _register_qlm_backend  # noqa: F401  (registers model "qlm")
    from qlm_core.parallel.state import destroy_distributed

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_config(config)
    tp_group = _tensor_parallel_group(config)
    manager = task_manager(config)
    workdir = Path(tempfile.mkdtemp(prefix="qlm-eval-"))
    try:
        if config.backend == "qlm":
            from qlm_core.eval.lm import QlmLM

            model = QlmLM(config.checkpoint, batch_size=config.batch_size, max_length=config.max_length,
                          dtype=config.dtype, tp_group=tp_group)
            model_args = None
        else:
            dtype = DTYPES[config.dtype]
            model = "hf"
            model_args = {"pretrained": _hf_dir_for(config.checkpoint, workdir, dtype),
                          "dtype": HF_DTYPE_NAMES[dtype],
                          "device": "cuda" if torch.cuda.is_available() else "cpu"}
            if config.max_length:
                model_args["max_length"] = config.max_length
        try:
            results = lm_eval.simple_evaluate(
                model=model, model_args=model_args, tasks=config.tasks, num_fewshot=config.num_fewshot,
                limit=config.limit, batch_size=config.batch_size, log_samples=config.log_samples,
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
        save_results(results, Path(config.output), config.log_samples)
    return results


def save_results(results: dict, output: Path, log_samples: bool):
    """Results (and per-sample logs) in lm-eval's own file layout, via its EvaluationTracker."""
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(output))
    samples = results.pop("samples", None) if log_samples else None
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples:
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    if samples is not None:
        results["samples"] = samples


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
