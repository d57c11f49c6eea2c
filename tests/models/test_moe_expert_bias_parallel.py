"""Aux-loss-free balancing across layouts: at dp2 ZeRO 1, tp2 (sp), cp2, ep2 and pp2 the expert biases move
exactly as in one process (their counts are the whole global batch's) and the losses follow it over 10 steps; a
checkpoint written at ep2 carries the biases (both formats), so a one-process resume continues the uninterrupted run.
One torchrun launch (2 gloo ranks, tests/workers/expert_bias_worker.py)."""

import json

import pytest
from conftest import run_worker_jobs
from workers.expert_bias_worker import LAYOUTS, SAVED, STEPS, biases, make_engine, step


@pytest.fixture(scope="module")
def bias_run(tmp_path_factory):
    return run_worker_jobs("expert_bias_worker.py", 2, tmp_path_factory.mktemp("expert_bias"), timeout=600)


@pytest.fixture(scope="module")
def one_process():
    engine = make_engine(1, {})
    losses = [step(engine) for _ in range(STEPS)]
    return {"losses": losses, "biases": biases(engine)}


def result(bias_run, name: str) -> dict:
    out, code, errors = bias_run
    file = out / f"{name}.json"
    assert file.exists(), f"worker exit {code}: {errors}"
    return json.loads(file.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_biases_and_losses_follow_one_process(bias_run, one_process, layout):
    got = result(bias_run, layout)
    assert got["biases"] == one_process["biases"]  # integer counts: the same signs, bit for bit
    assert any(v != 0 for bias in got["biases"].values() for v in bias)
    assert got["losses"] == pytest.approx(one_process["losses"], rel=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("job", ["saved", "resumed"])
def test_a_checkpoint_carries_the_biases(bias_run, one_process, fmt, job):
    got = result(bias_run, f"{fmt}.{job}")
    assert got["biases"] == one_process["biases"]
    assert got["losses"] == pytest.approx(one_process["losses"][SAVED:], rel=1e-4)
