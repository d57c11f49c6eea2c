"""qlm's DeepSeek-V3-class checkpoints (multi-latent attention with and without q's low rank, yarn, rotary rows
interleaved and in halves, sigmoid group-limited routing with a correction bias and scaling, shared experts, dense
first layers) load into REAL megatron-core 0.16.1 (local spec, its MLATransformerConfig): legacy files at TP2 x PP2
and at TP2 x EP2 with sequence parallelism, strictly; torch_dist written at TP1 and loaded through
dist_checkpointing at TP2 x PP2 (nothing asked for absent). megatron-core's logits equal transformers'. One torchrun
launch (4 gloo ranks). GLM-4.5 (glm4_moe: partial RoPE, q/k/v biases, q/k norms, the same router) goes through the
same checks. With multi-token prediction layers (two depths; GLM-4.5's one), megatron-core builds its
MultiTokenPredictionBlock on the last stage, loads qlm's mtp.layers.* strictly and gives transformers' token losses
and DeepSeek's MTP loss (tests/mtp_reference.py)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import MLA_KINDS, launch_torchrun, make_hf_model
from mtp_reference import mtp_token_losses

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
# multi-token prediction (mtp_models): DeepSeek-V3's two depths at TP2 x PP2 and from torch_dist, GLM-4.5's one at
# TP2 x EP2 with sequence parallelism
MTP_CASES = {"deepseek_v3_mtp_torch": ("deepseek_v3", "torch"), "deepseek_v3_mtp_torch_dist": ("deepseek_v3",
                                                                                                "torch_dist"),
             "glm4_moe_mtp_torch_ep2": ("glm4_moe", "torch_ep2")}


@pytest.fixture(scope="module")
def peer_run(mla_models, mtp_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mla_peer")
    models = {**mla_models, "glm4_moe": tmp / "glm4_moe"}
    make_hf_model(models["glm4_moe"], "glm4_moe")
    cases = []
    for i, (case, (kind, name)) in enumerate({**CASES, **MTP_CASES}.items()):
        fmt = "torch_dist" if name == "torch_dist" else "torch"
        source = mtp_models[kind] if case in MTP_CASES else models[kind]
        hf_to_mcore(source, tmp / case, **LAYOUTS[name], format=fmt, verify=False)
        tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(i))
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(ids).logits
        if case in MTP_CASES:  # the per-token loss and the mean over depths of their mean token losses, over
            # megatron-core's vocabulary padded at TP2 (its loss softmaxes the padding's zero logits too)
            depths = [loss.sum() / (loss != 0).sum() for loss in mtp_token_losses(source, ids, labels, 512)]
            padded = F.pad(logits, (0, 512 - logits.shape[-1]))
            expected = {"loss": F.cross_entropy(padded.flatten(0, 1), labels.flatten(), reduction="none").view(2, 16),
                        "mtp_loss": torch.stack(depths).mean().item()}
        else:
            expected = logits
        torch.save(expected, tmp / f"{case}.expected.pt")
        torch.save(ids, tmp / f"{case}.ids.pt")
        torch.save(labels, tmp / f"{case}.labels.pt")
        cases.append({"ckpt": str(tmp / case), "format": fmt, "tp": 2, "pp": 2, "ids": str(tmp / f"{case}.ids.pt"),
                      "labels": str(tmp / f"{case}.labels.pt"), "expected": str(tmp / f"{case}.expected.pt"),
                      "result": str(tmp / f"{case}.json"), "sequence_parallel": name == "torch_ep2"})
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


@pytest.mark.parametrize("case", MTP_CASES)
def test_megatron_core_builds_mtp_loads_qlms_files_and_gives_deepseeks_mtp_loss(peer_run, case):
    result = json.loads((peer_run / f"{case}.json").read_text())
    assert result["shape"] == [2, 16] and result["max_abs_diff"] <= 1e-4, result  # the main per-token loss
    assert result["mtp_loss"] == pytest.approx(result["expected_mtp_loss"], rel=1e-4), result
