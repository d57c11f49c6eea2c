"""qlm's MoE and Qwen3 checkpoints load into REAL megatron-core 0.16.1 (local spec, SequentialMLP experts, the
allgather dispatcher, the gated shared expert, q/k layernorm): legacy files written at TP2 x PP2 with strict
load_state_dict (every key and shape), torch_dist written at TP1 through dist_checkpointing at TP2 x PP2 (strict:
no key missing or left over); megatron-core's logits equal transformers'. One torchrun launch (4 gloo ranks)."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import QWEN3_MOE_KINDS, launch_torchrun

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install '.[test]')")
pytestmark = [pytest.mark.peer, pytest.mark.distributed,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

CASES = {f"{kind}_{fmt}": (kind, fmt) for kind in QWEN3_MOE_KINDS for fmt in ("torch", "torch_dist")}


@pytest.fixture(scope="module")
def peer_run(moe_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_peer")
    cases = []
    for i, (name, (kind, fmt)) in enumerate(CASES.items()):
        layout = dict(tp=2, pp=2) if fmt == "torch" else dict(tp=1)
        hf_to_mcore(moe_models[kind], tmp / name, **layout, format=fmt, verify=False)
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(i))
        model = transformers.AutoModelForCausalLM.from_pretrained(moe_models[kind], dtype=torch.float32).eval()
        with torch.no_grad():
            torch.save(model(ids).logits, tmp / f"{name}.expected.pt")
        torch.save(ids, tmp / f"{name}.ids.pt")
        cases.append({"ckpt": str(tmp / name), "format": fmt, "tp": 2, "pp": 2, "ids": str(tmp / f"{name}.ids.pt"),
                      "expected": str(tmp / f"{name}.expected.pt"), "result": str(tmp / f"{name}.json")})
    (tmp / "cases.json").write_text(json.dumps(cases))
    worker = Path(__file__).parent / "peers" / "megatron_moe_worker.py"
    proc = launch_torchrun(worker, 4, tmp / "cases.json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp


@pytest.mark.parametrize("name", CASES)
def test_megatron_core_loads_qlm_moe_checkpoints_and_gives_transformers_logits(peer_run, name):
    result = json.loads((peer_run / f"{name}.json").read_text())
    assert result["shape"] == [2, 16, 512]  # megatron's padding at TP2 (qlm wrote 512 at TP2, 384 at TP1)
    assert result["max_abs_diff"] <= 1e-4, result
