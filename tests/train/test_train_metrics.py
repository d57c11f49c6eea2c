"""A resumed run's logs: what was written after the checkpoint it resumes from is dropped from both files."""

import json

from qlm_core.train.metrics import MetricsWriter, StepMetrics, read_jsonl


def step(n: int) -> StepMetrics:
    return StepMetrics(step=n, loss=1.0 / n, grad_norm=1.0, lr=1e-3, label_tokens=8, samples=8 * n, step_time_s=0.1,
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
        "step", "loss", "grad_norm", "lr", "label_tokens", "samples", "step_time_s", "s_per_sample", "tokens_per_s",
        "tflops_per_device", "mfu", "mem_peak_gb", "skipped"]


def test_non_finite_values_are_written_as_json_null(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    bad = step(1)
    bad.loss, bad.grad_norm = float("nan"), float("inf")
    writer.log_step(bad)
    writer.log_eval(1, float("nan"))

    def refuse(constant):
        raise ValueError(f"bare {constant} is not JSON")
    row = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert row["loss"] is None and row["grad_norm"] is None and row["lr"] == 1e-3
    assert json.loads((tmp_path / "eval.jsonl").read_text(), parse_constant=refuse)["valid_loss"] is None


def test_loss_plot_uses_a_log_axis_and_skips_null_losses(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from qlm_core.train.metrics import plot_loss

    scales, plotted = [], []
    real_scale, real_plot = Axes.set_yscale, Axes.plot
    monkeypatch.setattr(Axes, "set_yscale", lambda self, value, **kw: (scales.append(value),
                                                                        real_scale(self, value, **kw))[1])
    monkeypatch.setattr(Axes, "plot", lambda self, x, y, *a, **kw: (plotted.append(list(y)),
                                                                     real_plot(self, x, y, *a, **kw))[1])
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for n in range(1, 5):
        metrics = step(n)
        metrics.loss = float("nan") if n == 2 else metrics.loss
        writer.log_step(metrics)
    assert plot_loss(tmp_path).exists()
    assert scales == ["log"] and plotted == [[1.0, 1 / 3, 0.25]]


def test_summary_is_totals_over_wall_time_and_mfu_never_exceeds_one(run_qlm, tmp_path, tmp_path_factory):
    """A peak far below what a step achieves (as a CPU probe measured under load can be): MFU is capped by raising
    the peak (and saying so); summary.json's rates are the run's totals over its wall time."""
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-parity.toml"
    run, cache = tmp_path / "run", tmp_path_factory.getbasetemp() / "demo-cache"  # shared with test_train_signals
    code, out, err = run_qlm("train", recipe, "--output", run, "--set", f"data.cache_dir={cache}",
                             "--set", "train.train_iters=3", "--set", "train.global_batch_size=4",
                             "--set", "logging.peak_tflops=1e-9")
    assert code == 0, err
    rows = read_jsonl(run / "metrics.jsonl")
    summary = json.loads((run / "summary.json").read_text())
    assert all(0 < r["mfu"] <= 1 for r in rows) and 0 < summary["mfu"] <= 1
    assert "raised from 1e-09" in summary["peak_source"]
    assert summary["tokens"] == 3 * 4 * 64 and summary["steps_run"] == 3
    # the trained (label) tokens are fewer than the tokens processed, and are what each line's label_tokens add up to
    assert 0 < summary["label_tokens"] == sum(r["label_tokens"] for r in rows) < summary["tokens"]
    assert summary["tokens_per_s"] == summary["tokens"] / summary["train_wall_s"]
    assert summary["s_per_sample"] == summary["train_wall_s"] / 12
    assert summary["train_wall_s"] >= sum(r["step_time_s"] for r in rows)


def test_progress_line_shows_mfu_as_the_same_fraction_as_the_logs(monkeypatch):
    from qlm_cli.commands.train import RunView
    from qlm_cli.render import console
    from qlm_core.train.trainer import Event

    monkeypatch.setattr(console, "_force_terminal", True)  # the rich bar (a log file gets plain lines)
    view = RunView()
    view(Event("start", {"layout": "dp1", "model": "m", "params": 1e6, "train_samples": 8, "steps": 2,
                         "start_step": 0, "peak_tflops": 1.0, "peak_source": "recipe"}))
    metrics = step(1)
    metrics.mfu = 0.4567
    view(Event("step", {"metrics": metrics, "total": 2}))
    view.progress.stop()
    figures = view.progress.tasks[0].fields["figures"]
    assert "MFU 0.457 " in figures and "%" not in figures
