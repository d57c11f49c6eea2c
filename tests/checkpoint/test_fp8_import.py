"""FP8 checkpoints with block scales (DeepSeek-V3 as released): a fixture made with torch's float8_e4m3fn and fp32
`weight_scale_inv` grids reads dequantised exactly as transformers' own Fp8Dequantize computes it, streams into
Megatron and back out as bf16 (or fp32) bit for bit, says so, and drops the quantization_config from what it writes;
an FP8 weight without its scales is one line."""

import json

import pytest
import torch
from conftest import make_hf_model
from safetensors.torch import load_file, save_file

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.errors import QlmError

# the tiny model's sizes in several blocks each (transformers' CPU dequantisation derives the block from the grid,
# so the fixture's blocks divide every size; ragged last blocks, as DeepSeek-V3's 576-row kv_a_proj_with_mqa has,
# are checked against DeepSeek's own rule in test_ragged_blocks_scale_by_their_own_block)
BLOCK = (4, 8)


def quantise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv grid): each block scaled to e4m3's range, as DeepSeek's release does."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    scales = torch.empty(grid)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]].float()
            scales[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (block / scales[i, j]).to(q.dtype)
    return q, scales


def quantised_name(name: str) -> bool:
    return name.endswith("proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "deepseek_v3"
    make_hf_model(path, "deepseek_v3", dtype=torch.bfloat16)
    tensors = load_file(path / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if quantised_name(name):
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = quantise(tensor)
        else:
            out[name] = tensor
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))
    return path, out


def transformers_dequantised(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, scales, dtype)


def test_fp8_weights_read_as_transformers_dequantises_them(fp8_model):
    path, stored = fp8_model
    ckpt = HFCheckpoint(path)
    quantised = [n for n in stored if quantised_name(n)]
    assert len(quantised) > 20 and not any(n.endswith("weight_scale_inv") for n in ckpt.names)
    for name in quantised:
        q, scales = stored[name], stored[name[: -len("weight")] + "weight_scale_inv"]
        assert ckpt.dtype(name) == torch.bfloat16
        ours = ckpt.read(name)
        assert torch.equal(ours, transformers_dequantised(q, scales, torch.bfloat16)), name
        # a slice along either axis, as the layout reads them (rows 5.. cross a block edge)
        assert torch.equal(ckpt.read(name, 0, 5, q.shape[0]), ours[5:]), name
        assert torch.equal(ckpt.read(name, 1, 3, 19), ours[:, 3:19]), name
        fp32 = torch.empty(q.shape, dtype=torch.float32)
        ckpt.read_into(name, 0, 0, q.shape[0], fp32)
        assert torch.equal(fp32, transformers_dequantised(q, scales, torch.float32)), name


def test_ragged_blocks_scale_by_their_own_block():
    """A 20 x 40 weight in 16 x 16 blocks: its last block row and column are partial, and each entry takes the
    scale of block (row // 16, column // 16) (DeepSeek's weight_dequant)."""
    from qlm_core.checkpoint.formats.hf.fp8 import dequantise

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(20, 40, generator=generator).to(torch.float8_e4m3fn)
    scales = torch.rand(2, 3, generator=generator) + 0.5
    want = torch.empty(20, 40)
    for i in range(20):
        for j in range(40):
            want[i, j] = q[i, j].float() * scales[i // 16, j // 16]
    assert torch.equal(dequantise(q, scales, (16, 16), 0, 0, torch.float32), want)
    assert torch.equal(dequantise(q[17:], scales, (16, 16), 0, 17, torch.float32), want[17:])
    assert torch.equal(dequantise(q[:, 15:33], scales, (16, 16), 1, 15, torch.float32), want[:, 15:33])


def test_fp8_model_converts_to_megatron_and_back_as_bf16(fp8_model, tmp_path):
    path, stored = fp8_model
    result = hf_to_mcore(path, tmp_path / "mcore", tp=2, ep=2, verify=True)
    # verify loads the FP8 source in transformers (which dequantises it on CPU) for the logits
    assert result.verify.ok and any("FP8 weights dequantised (4x8 block scales)" in n for n in result.notes)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", verify=True)
    back = load_file(tmp_path / "hf" / "model.safetensors")
    ckpt = HFCheckpoint(path)
    assert sorted(back) == sorted(ckpt.names)
    for name, tensor in back.items():  # the routers' correction bias is kept in fp32, as Megatron holds it
        dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert tensor.dtype == dtype and torch.equal(tensor, ckpt.read(name).to(dtype)), name
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_an_fp8_weight_without_its_scales_is_one_line(fp8_model, tmp_path):
    import shutil

    path, stored = fp8_model
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = dict(stored)
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QlmError, match="the FP8 tensor model.layers.0.self_attn.o_proj.weight has no "
                                       "weight_scale_inv beside it"):
        HFCheckpoint(broken)


def test_multi_token_prediction_layers_config_json_does_not_count_are_refused_not_dropped(fp8_model, tmp_path):
    """An MTP module held as model.layers.<N>.* (DeepSeek-V3's release) that num_nextn_predict_layers does not
    count would be dropped by a conversion: one line naming the key; counted but incomplete: the missing tensor."""
    import json
    import shutil

    path, stored = fp8_model
    mtp = tmp_path / "mtp"
    shutil.copytree(path, mtp)
    tensors = dict(stored)
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    tensors["model.layers.4.enorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(tensors, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QlmError, match=r"tensor model.layers.4.hnorm.weight is missing"):
        HFCheckpoint(mtp).check_model()  # config.json counts one layer (DeepseekV3Config's default)
    config = json.loads((mtp / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(QlmError, match=r"holds multi-token prediction layer\(s\) from model.layers.4.\* that "
                                       r"config.json does not count \(it says 0\); converting would drop them"):
        HFCheckpoint(mtp).check_model()


def test_a_scale_grid_of_the_wrong_shape_is_one_line(fp8_model, tmp_path):
    import shutil

    path, stored = fp8_model
    broken = tmp_path / "grid"
    shutil.copytree(path, broken)
    tensors = dict(stored)
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(3, 3)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QlmError, match=r"o_proj.weight_scale_inv is \[3, 3\] but a \[64, 32\] weight in 4x8 blocks "
                                       r"needs \[16, 4\]"):
        HFCheckpoint(broken)
