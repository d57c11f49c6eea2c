"""qlm's DeepSeek-V3-class checkpoints (multi-latent attention with and without q's low rank, yarn, rotary rows
interleaved and in halves, sigmoid group-limited routing with a correction bias and scaling, shared experts, dense
first layers) load into REAL megatron-core 0.16.1 (local spec, its MLATransformerConfig): legacy files at TP2 x PP2
and at TP2 x EP2 with sequence parallelism, strictly; torch_dist written at TP1 and loaded through
dist_checkpointing at TP2 x PP2 (nothing asked for absent). megatron-core's logits equal transformers'. One torchrun
launch (4 gloo ranks). GLM-4.5 (glm4_moe: partial RoPE, q/k/v biases, q/k norms, the same router) goes through the
same checks."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import MLA_KINDS, launch_torchrun, make_hf_model

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install '.[test]')")
pytestmark = [pytest.mark.peer, pytest.mark.distributed,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

LAYOUTS = {"torch": dict(tp=2, pp=2), "torch_dist": dict(tp=1), "torch_ep2": dict(tp=2, ep=2)}
# GLM-4.7-Flash is left out: megatron-core normalises the MLA latents with the layers' epsilon (GLM's 1e-5), where
# transformers and DeepSeek's reference use 1e-6 (qlm follows transformers)
CASES = {f"{kind}_{name}": (kind, name) for kind in MLA_KINDS if kind != "glm4_moe_lite" for name in LAYOUTS}
# GLM-4.5's grouped-query attention (half of each head rotated, q/k/v biases, q/k norms) with the same router
CASES |= {f"glm4_moe_{name}": ("glm4_moe", name) for name in LAYOUTS}


@pytest.fixture(scope="module")
def peer_run(mla_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mla_peer")
    models = {**mla_models, "glm4_moe": tmp / "glm4_moe"}
    make_hf_model(models["glm4_moe"], "glm4_moe")
    cases = []
    for i, (case, (kind, name)) in enumerate(CASES.items()):
        fmt = "torch_dist" if name == "torch_dist" else "torch"
        hf_to_mcore(models[kind], tmp / case, **LAYOUTS[name], format=fmt, verify=False)
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(i))
        model = transformers.AutoModelForCausalLM.from_pretrained(models[kind], dtype=torch.float32).eval()
        with torch.no_grad():
            torch.save(model(ids).logits, tmp / f"{case}.expected.pt")
        torch.save(ids, tmp / f"{case}.ids.pt")
        cases.append({"ckpt": str(tmp / case), "format": fmt, "tp": 2, "pp": 2, "ids": str(tmp / f"{case}.ids.pt"),
                      "expected": str(tmp / f"{case}.expected.pt"), "result": str(tmp / f"{case}.json"),
                      "sequence_parallel": name == "torch_ep2"})
    (tmp / "cases.json").write_text(json.dumps(cases))
    worker = Path(__file__).parents[1] / "peers" / "megatron_moe_worker.py"
    proc = launch_torchrun(worker, 4, tmp / "cases.json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp


@pytest.mark.parametrize("case", CASES)
def test_megatron_core_builds_mla_loads_qlms_files_and_gives_transformers_logits(peer_run, case):
    result = json.loads((peer_run / f"{case}.json").read_text())
    assert result["shape"] == [2, 16, 512]  # megatron's padding at TP2
    assert result["max_abs_diff"] <= 1e-4, result
