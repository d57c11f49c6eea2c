"""Checkpoints written by `qlm convert hf2mcore` load into REAL megatron-core at their TP/PP and give
transformers' logits. One torchrun launch (4 gloo ranks) runs every case."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import LLAMA3_ROPE, launch_torchrun, make_hf_model

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install '.[test]')")
pytestmark = [pytest.mark.peer, pytest.mark.distributed]

CASES = {
    "qwen2_tp2_pp2": ("qwen2", dict(tp=2, pp=2)),
    "qwen2_tied_tp2_pp2": ("qwen2_tied", dict(tp=2, pp=2)),
    "llama3_tp4_two_groups": ("llama31", dict(tp=4)),
    "qwen2_tp2_uneven_pp2": ("qwen2", dict(tp=2, pp=2, first_stage_layers=1)),
    # sliding windows of 8 on layers 2-3 only (window_size and window_attn_skip_freq), over 16 tokens
    "qwen2_swa_tp2_pp2": ("qwen2_swa", dict(tp=2, pp=2)),
    "mistral_tp2": ("mistral", dict(tp=2)),
    # GLM-4-9B's attention: q/k/v biases, half of each head rotated in interleaved pairs (rotary_interleaved)
    "glm_tp2_pp2": ("glm", dict(tp=2, pp=2)),
    # ERNIE 4.5: the whole head in interleaved pairs, tied embeddings across the pipeline
    "ernie4_5_tp2_pp2": ("ernie4_5", dict(tp=2, pp=2)),
    # OPT: LayerNorm, biases on every linear (add_bias_linear), ReLU, learned positions offset by 2, tied
    "opt_tp2_pp2": ("opt", dict(tp=2, pp=2)),
}


def test_megatron_core_reproduces_transformers_logits(hf_models, tmp_path):
    # Megatron-Core's Llama 3.1 rope scaling hard-codes low/high frequency factors 1/4 and an original context of
    # 8192, so this model uses those (the fixture's 64 exercises qlm's general implementation elsewhere).
    rope = {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}
    make_hf_model(tmp_path / "llama31", "llama3", rope_scaling=rope, max_position_embeddings=16384)
    hf_models = {**hf_models, "llama31": tmp_path / "llama31"}
    cases = []
    for name, (kind, layout) in CASES.items():
        hf_to_mcore(hf_models[kind], tmp_path / name, **layout, verify=False)
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(len(cases)))
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_models[kind], dtype=torch.float32).eval()
        with torch.no_grad():
            torch.save(model(ids).logits, tmp_path / f"{name}.expected.pt")
        torch.save(ids, tmp_path / f"{name}.ids.pt")
        cases.append({"ckpt": str(tmp_path / name), "ids": str(tmp_path / f"{name}.ids.pt"),
                      "expected": str(tmp_path / f"{name}.expected.pt"), "result": str(tmp_path / f"{name}.json")})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    worker = Path(__file__).parents[1] / "peers" / "megatron_logits.py"
    proc = launch_torchrun(worker, 4, tmp_path / "cases.json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name, case in zip(CASES, cases, strict=True):
        result = json.loads(Path(case["result"]).read_text())
        assert result["shape"] == [2, 16, 300], name
        assert result["max_abs_diff"] <= 1e-4, (name, result)
