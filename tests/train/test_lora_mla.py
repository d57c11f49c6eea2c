"""LoRA on multi-latent attention (Megatron-Bridge's MLA targets: linear_q_proj or linear_q_down_proj and
linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, linear_proj): qlm's adapters equal PEFT's on transformers'
DeepSeek-V3 (rotary rows reordered for rope_interleave false included). The MLP targets are left out of the PEFT
comparison: PEFT with transformers 5 retargets gate_proj / up_proj / down_proj of an MoE model to its fused routed
experts, dropping the dense and shared-expert adapters (the dense models' PEFT test covers them)."""

import json

import pytest
import torch
from conftest import MLA_KINDS
from test_lora import qlm_lora_model, token_ids

from qlm_core.checkpoint.formats.hf.peft import export_peft
from qlm_core.checkpoint.sources.lora import GlobalTensorSource
from qlm_core.config import LoraConfig
from qlm_core.models.layout import LORA_TARGETS, ModelLayout
from qlm_core.train.lora import lora_state_dict

MLA_TARGETS = ["linear_proj", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
               "linear_kv_up_proj"]
HF_MODULES = {"linear_proj": ["o_proj"], "linear_q_proj": ["q_proj"], "linear_q_down_proj": ["q_a_proj"],
              "linear_q_up_proj": ["q_b_proj"], "linear_kv_down_proj": ["kv_a_proj_with_mqa"],
              "linear_kv_up_proj": ["kv_b_proj"], "linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]}


@pytest.mark.parametrize("kind", list(MLA_KINDS))
def test_mla_adapters_equal_pefts(kind, mla_models, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = LoraConfig(rank=4, alpha=8.0, target_modules=MLA_TARGETS)
    model, layout = qlm_lora_model(mla_models[kind], config)
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[1] for name, _ in model.named_parameters() if ".lora_A" in name}
    q = ["linear_q_proj"] if layout.spec.mla.q_lora_rank is None else ["linear_q_down_proj", "linear_q_up_proj"]
    assert adapted == {"linear_proj", "linear_kv_down_proj", "linear_kv_up_proj", *q}
    out = export_peft(layout, GlobalTensorSource(lora_state_dict(model)), config, tmp_path / "peft",
                      base_model_name_or_path=str(mla_models[kind]))
    written = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert sorted(written) == sorted(m for t in adapted for m in HF_MODULES[t])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(mla_models[kind]), out).eval()
    ids = token_ids(layout.spec.vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids), peft_model(ids).logits
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
    assert (ours[..., :300] - base).abs().max() > 1e-2
    assert (ours[..., :300] - theirs).abs().max() <= 1e-5


def test_grouped_query_targets_adapt_nothing_in_mla_and_the_reverse(mla_models, hf_models):
    from qlm_core.models.spec import ModelSpec

    mla = ModelLayout(ModelSpec.from_hf_dir(mla_models["deepseek_v3"]))
    gqa = ModelLayout(ModelSpec.from_hf_dir(hf_models["qwen2"]))
    assert mla.lora_linear(1, "linear_qkv") is None and mla.lora_linear(1, "linear_q_proj") is None
    assert mla.lora_linear(1, "linear_kv_up_proj") == "self_attention.linear_kv_up_proj"
    assert gqa.lora_linear(1, "linear_kv_up_proj") is None and gqa.lora_linear(1, "linear_qkv") is not None
    assert list(LORA_TARGETS)[:2] == ["linear_proj", "linear_q_proj"]  # state_dict order within a layer


def test_targets_that_adapt_nothing_are_one_line(mla_models):
    from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
    from qlm_core.errors import QlmError
    from qlm_core.models.gpt import GPTModel
    from qlm_core.train.lora import apply_lora

    spec = HFCheckpoint(mla_models["deepseek_v3"]).spec
    model = GPTModel(spec)
    with pytest.raises(QlmError, match=r"the LoRA target modules \['linear_qkv'\] adapt no linear of this "
                                       "deepseek_v3 model"):
        apply_lora([model], LoraConfig(rank=4, target_modules=["linear_qkv"]), model.parallel)
