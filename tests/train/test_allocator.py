"""Allocator control (issue 17 item 5): expandable segments unless the user configured the allocator, the
train.empty_cache_interval key, and the CUDA allocator figures of metrics.jsonl."""

import os
from pathlib import Path

import pytest
import torch

from qlm_core.config import load_recipe
from qlm_core.errors import QlmError
from qlm_core.hardware import EXPANDABLE_SEGMENTS, configure_cuda_allocator, empty_device_cache
from qlm_core.train.metrics import StepMetrics, device_memory_gb, read_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_expandable_segments_are_set_on_cuda_when_the_user_set_nothing():
    env = {"PATH": "/usr/bin"}
    assert configure_cuda_allocator(env, cuda_available=True) == EXPANDABLE_SEGMENTS
    assert env == {"PATH": "/usr/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("value", ["max_split_size_mb:128", "expandable_segments:False", ""])
def test_a_users_allocator_configuration_is_left_alone(variable, value):
    env = {variable: value}
    assert configure_cuda_allocator(env, cuda_available=True) is None
    assert env == {variable: value}


def test_nothing_is_set_without_cuda():
    env = {}
    assert configure_cuda_allocator(env, cuda_available=False) is None
    assert env == {}


def test_the_default_is_the_process_environment_and_this_machines_cuda(monkeypatch):
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    monkeypatch.setattr(os, "environ", environ)  # the real one is left as it was
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert configure_cuda_allocator() == EXPANDABLE_SEGMENTS
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE_SEGMENTS


def test_empty_device_cache_calls_the_devices_own(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cuda"))
    assert empty_device_cache(torch.device("cuda", 0)) is True
    assert calls == ["cuda"]
    assert not hasattr(torch.cpu, "empty_cache")  # the CPU has no caching allocator: nothing to call
    assert empty_device_cache(torch.device("cpu")) is False


@pytest.mark.parametrize("value", ["-1", "2.5", "true"])
def test_empty_cache_interval_is_validated(value):
    with pytest.raises(QlmError, match="empty_cache_interval"):
        load_recipe(None, [f"train.empty_cache_interval={value}"])
    assert load_recipe(None, ["train.empty_cache_interval=50"]).train.empty_cache_interval == 50
    assert load_recipe(None).train.empty_cache_interval == 0


def metrics(**memory) -> StepMetrics:
    return StepMetrics(step=1, loss=1.0, grad_norm=1.0, lr=1e-3, label_tokens=8, samples=8, step_time_s=0.1,
                       s_per_sample=0.01, tokens_per_s=80.0, tflops_per_device=0.0, mfu=0.0, mem_peak_gb=2.0, **memory)


def test_cuda_memory_figures_come_from_the_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 * 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 5 * 2**30)
    figures = device_memory_gb()
    assert figures == {"mem_allocated_gb": 1.5, "mem_reserved_gb": 5.0}
    line = metrics(**figures).record()
    assert (line["mem_peak_gb"], line["mem_allocated_gb"], line["mem_reserved_gb"]) == (2.0, 1.5, 5.0)


def test_cpu_lines_leave_the_allocator_figures_out(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_memory_gb() == {}
    line = metrics(**device_memory_gb()).record()
    assert "mem_reserved_gb" not in line and "mem_allocated_gb" not in line and line["mem_peak_gb"] == 2.0


def test_the_trainer_empties_the_cache_every_interval_steps(tmp_path, monkeypatch):
    """5 steps at interval 2: after steps 2 and 4 (counted by the lines metrics.jsonl holds when it is called)."""
    from qlm_core.train.trainer import Trainer

    run = tmp_path / "run"
    seen = []
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: seen.append(len(read_jsonl(run / "metrics.jsonl"))),
                        raising=False)
    recipe = load_recipe(REPO / "recipes" / "tiny-sft.toml", [
        "train.train_iters=5", "train.empty_cache_interval=2", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.eval_interval=0", "train.eval_iters=1", "data.seq_length=32",
        "logging.tensorboard=false", "logging.plot=false", "checkpoint.save_interval=0",
        f"data.cache_dir={str(tmp_path / 'cache')!r}"])
    Trainer(recipe, run).run()
    assert seen == [2, 4]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all("mem_peak_gb" in r and "mem_reserved_gb" not in r for r in rows)  # this machine has no CUDA
