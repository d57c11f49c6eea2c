"""A resumed run's logs: what was written after the checkpoint it resumes from is dropped from both files."""

import json

from qlm_core.train.metrics import MetricsWriter, StepMetrics, read_jsonl


def step(n: int) -> StepMetrics:
    return StepMetrics(step=n, loss=1.0 / n, grad_norm=1.0, lr=1e-3, tokens=8, samples=8 * n, step_time_s=0.1,
                       s_per_sample=0.01, tokens_per_s=80.0, tflops_per_device=0.0, mfu=0.0, mem_peak_gb=0.1)


def test_resume_drops_train_and_eval_lines_after_the_checkpoint(tmp_path):
    first = MetricsWriter(tmp_path, tensorboard=False)
    for n in range(1, 6):
        first.log_step(step(n))
        if n % 2 == 0:
            first.log_eval(n, 0.5)
    resumed = MetricsWriter(tmp_path, tensorboard=False, resumed_from=2)
    resumed.log_step(step(3))
    resumed.log_eval(4, 0.25)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert [(r["step"], r["valid_loss"]) for r in read_jsonl(tmp_path / "eval.jsonl")] == [(2, 0.5), (4, 0.25)]
    assert list(json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])) == [
        "step", "loss", "grad_norm", "lr", "tokens", "samples", "step_time_s", "s_per_sample", "tokens_per_s",
        "tflops_per_device", "mfu", "mem_peak_gb", "skipped"]
