"""qlm eval: the qlm backend agrees with lm-eval's own hf backend, on any checkpoint format, and the CPU demo's
trained model passes its held-out task while an untrained one does not."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install '.[eval]')")

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore  # noqa: E402
from qlm_core.eval.runner import EvalConfig, result_rows, run_eval  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TASKS = ["qlm_demo_mc", "qlm_demo_gen", "qlm_demo_ppl"]


def random_hf_model(root: Path, preset: str) -> Path:
    """A random model of `preset`'s shape in transformers with qlm's demo tokenizer, saved under root/hf."""
    import transformers

    from qlm_core.data.demo import build_demo
    from qlm_core.models.presets import PRESETS

    paths = build_demo(root / "demo", num_train=200, num_eval=5, corpus_paragraphs=20)
    config = {k: v for k, v in PRESETS[preset].to_hf_config("float32").items() if k != "architectures"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    with torch.no_grad():  # transformers zero-inits MoE routers: distinct logits, so no top-k ties
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_()
    model.save_pretrained(root / "hf")
    for file in paths.tokenizer.iterdir():
        (root / "hf" / file.name).write_bytes(file.read_bytes())
    return root / "hf"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random qlm-tiny-shaped Qwen2."""
    return random_hf_model(tmp_path_factory.mktemp("eval-model"), "qlm-tiny")


def evaluate(checkpoint, backend, tmp_path, limit=12):
    return run_eval(EvalConfig(checkpoint=str(checkpoint), tasks=TASKS, limit=limit, batch_size=4, backend=backend,
                               log_samples=True, cache_dir=str(tmp_path / "tasks")))


def per_request(results) -> dict:
    """(task, doc id, request index) -> what the model answered (log-likelihood, greedy flag, or text)."""
    out = {}
    for task, samples in results["samples"].items():
        for sample in samples:
            for index, resp in enumerate(sample["resps"]):
                out[(task, sample["doc_id"], index)] = resp[0]
    return out


def assert_same(ours, theirs, tolerance=1e-4):
    ours_rows = {(t, f, m): v for t, f, m, v, _ in result_rows(ours)}
    theirs_rows = {(t, f, m): v for t, f, m, v, _ in result_rows(theirs)}
    assert ours_rows and ours_rows.keys() == theirs_rows.keys()
    for key, value in ours_rows.items():
        assert value == pytest.approx(theirs_rows[key], rel=tolerance, abs=1e-6), key
    a, b = per_request(ours), per_request(theirs)
    assert a and a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], str):
            assert a[key] == b[key], key
        elif isinstance(a[key], (list, tuple)):  # (log-likelihood, is_greedy)
            assert abs(a[key][0] - b[key][0]) <= tolerance and a[key][1] == b[key][1], (key, a[key], b[key])
        else:  # rolling log-likelihood
            assert abs(a[key] - b[key]) <= tolerance * max(1.0, abs(b[key]) / 100), (key, a[key], b[key])


@pytest.mark.slow
def test_qlm_backend_equals_lm_eval_hf_backend(hf_model, tmp_path):
    ours = evaluate(hf_model, "qlm", tmp_path)
    theirs = evaluate(hf_model, "hf", tmp_path)
    assert {t for t, *_ in result_rows(ours)} == set(TASKS)
    assert_same(ours, theirs)


@pytest.mark.slow
# GLM-4-0414; a Qwen2 windowed on its last two layers; ERNIE 4.5
@pytest.mark.parametrize("kind", ["glm4", "qwen2_swa", "ernie4_5", "gemma3", "opt", "bloom", "mpt", "gemma2"])
def test_qlm_backend_equals_lm_eval_hf_backend_on_another_family(hf_models, kind, tmp_path):
    assert_same(evaluate(hf_models[kind], "qlm", tmp_path), evaluate(hf_models[kind], "hf", tmp_path))


@pytest.mark.slow
def test_qlm_backend_equals_lm_eval_hf_backend_on_ernie_moe(moe_models, tmp_path):
    """ERNIE 4.5 MoE: softmax routing chosen with its correction bias, a shared expert, a dense first layer."""
    model = moe_models["ernie4_5_moe"]
    assert_same(evaluate(model, "qlm", tmp_path), evaluate(model, "hf", tmp_path))


@pytest.mark.slow
def test_qlm_backend_equals_lm_eval_hf_backend_on_gpt_oss(moe_models, tmp_path):
    """gpt-oss: sinks, windowed and full layers, yarn, biased router and experts with the clamped SwiGLU."""
    model = moe_models["gpt_oss"]
    assert_same(evaluate(model, "qlm", tmp_path), evaluate(model, "hf", tmp_path))


@pytest.mark.slow
def test_qlm_backend_equals_lm_eval_hf_backend_on_an_moe_model(tmp_path):
    """A Qwen3-MoE (qlm-tiny-moe's shape: q/k norms, 8 experts, top 2) in transformers, both backends."""
    moe_model = random_hf_model(tmp_path / "moe", "qlm-tiny-moe")
    assert_same(evaluate(moe_model, "qlm", tmp_path), evaluate(moe_model, "hf", tmp_path))


@pytest.mark.slow
def test_qlm_backend_equals_lm_eval_hf_backend_on_a_deepseek_v3_model(tmp_path):
    """DeepSeek-V3's layer (qlm-tiny-mla: multi-latent attention, group-limited sigmoid routing with the correction
    bias, a shared expert, a dense first layer) in transformers, both backends."""
    mla_model = random_hf_model(tmp_path / "mla", "qlm-tiny-mla")
    assert_same(evaluate(mla_model, "qlm", tmp_path), evaluate(mla_model, "hf", tmp_path))


@pytest.mark.slow
def test_megatron_tp2_pp2_checkpoint_equals_its_hf_source(hf_model, tmp_path):
    hf_to_mcore(hf_model, tmp_path / "mcore", tp=2, pp=2, verify=False)
    assert_same(evaluate(tmp_path / "mcore", "qlm", tmp_path), evaluate(hf_model, "qlm", tmp_path), tolerance=1e-5)


@pytest.mark.slow  # trains 120 steps in a subprocess
def test_demo_model_learns_its_task_and_an_untrained_one_does_not(tmp_path):
    recipe = REPO / "recipes" / "tiny-sft.toml"
    scores = {}
    for name, sets in {"trained": ["train.train_iters=120"],
                       "untrained": ["train.train_iters=1", "optim.lr=1e-12", "schedule.min_lr=0.0"]}.items():
        args = [arg for kv in sets + ["train.eval_interval=0", "checkpoint.save_interval=0",
                                      f"data.cache_dir={tmp_path / 'cache'}"] for arg in ("--set", kv)]
        subprocess.run([sys.executable, "-m", "qlm_cli.main", "train", str(recipe), "--output",
                        str(tmp_path / name), *args], check=True, capture_output=True, cwd=REPO)
        results = run_eval(EvalConfig(checkpoint=str(tmp_path / name), tasks=["qlm_demo_mc"], limit=60,
                                      cache_dir=str(tmp_path / "tasks")))
        scores[name] = results["results"]["qlm_demo_mc"]["acc,none"]
    assert scores["trained"] >= 0.8, scores  # chance is 0.25
    assert scores["untrained"] <= 0.45, scores


@pytest.mark.slow
def test_cli_writes_lm_eval_results_and_errors_offline(run_qlm, hf_model, tmp_path):
    code, stdout, stderr = run_qlm("eval", hf_model, "--tasks", "qlm_demo_mc", "--limit", "4", "--output",
                                   tmp_path / "out", "--log-samples")
    assert code == 0, stderr
    assert "qlm_demo_mc: acc" in stdout
    results = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("results_*.json")]
    assert results and "qlm_demo_mc" in results[0]["results"] and "config" in results[0]
    assert list((tmp_path / "out").rglob("samples_qlm_demo_mc_*.jsonl"))
    code, _, stderr = run_qlm("eval", hf_model, "--tasks", "no_such_task_anywhere", "--include-path", tmp_path)
    assert code == 2 and "unknown task(s) no_such_task_anywhere" in stderr


@pytest.mark.slow
def test_deepspeed_checkpoint_evaluates_like_its_hf_source(hf_model, tmp_path):
    from qlm_core.checkpoint.convert.deepspeed import hf_to_ds

    hf_to_ds(hf_model, tmp_path / "ds", verify=False)
    assert_same(evaluate(tmp_path / "ds", "qlm", tmp_path, limit=6), evaluate(hf_model, "qlm", tmp_path, limit=6),
                tolerance=1e-5)


def saved_results(output: Path) -> dict:
    """What `qlm eval --output DIR --log-samples` wrote, in the shape run_eval returns (lm-eval's sample files hold
    every response as strings: numbers come back as numbers, generations stay text)."""

    def parse(resp, task):
        if task == "qlm_demo_gen":
            return resp
        if isinstance(resp, list):
            return [parse(r, task) for r in resp]
        return resp == "True" if resp in ("True", "False") else float(resp)

    results = json.loads(next(output.rglob("results_*.json")).read_text())
    results["samples"] = {}
    for path in output.rglob("samples_*.jsonl"):
        task = next(t for t in TASKS if path.name.startswith(f"samples_{t}_"))
        samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        results["samples"][task] = [{**s, "resps": parse(s["resps"], task)} for s in samples]
    return results


@pytest.mark.distributed
def test_tensor_parallel_eval_equals_one_process(hf_model, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "qlm_cli.main", "eval", str(hf_model), "--tasks", ",".join(TASKS), "--limit", "6",
         "--batch-size", "4", "--tp", "2", "--output", str(tmp_path / "tp2"), "--log-samples"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("qlm_demo_mc: acc") == 1  # only rank 0 reports
    tp2 = saved_results(tmp_path / "tp2")
    assert set(tp2["samples"]) == set(TASKS)
    assert_same(tp2, evaluate(hf_model, "qlm", tmp_path, limit=6), tolerance=1e-5)


def test_tensor_parallel_needs_the_qlm_backend(run_qlm, hf_model):
    code, _, stderr = run_qlm("eval", hf_model, "--tasks", "qlm_demo_mc", "--tp", "2", "--backend", "hf")
    assert code == 2 and "--tp 2 needs the qlm backend" in stderr
