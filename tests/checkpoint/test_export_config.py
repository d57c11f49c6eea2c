"""Exports that work without extra steps: eos ids and generation_config.json so generation stops at a turn's end,
and Megatron checkpoints without Megatron-LM args (megatron-core dist_checkpointing, Megatron-Bridge) converted with
--config or their run_config.yaml, with the vocabulary padding dropped."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY, load_safetensors_dir, make_hf_model

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from qlm_core.checkpoint.formats.megatron.bridge_config import bridge_args
from qlm_core.checkpoint.formats.megatron.format import open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import SHARD_FILE
from qlm_core.checkpoint.io.safe_load import safe_torch_load
from qlm_core.errors import QlmError

IM_END = "<|im_end|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny qwen2 whose tokenizer has ChatML tokens and template, and whose config.json has eos_token_id null."""
    path = tmp_path_factory.mktemp("chat") / "hf"
    make_hf_model(path, "qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", IM_END]})
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(eos_token_id=None, bos_token_id=None)
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


def strip_args(root: Path):
    """Make a qlm checkpoint look like megatron-core's own dist_checkpointing (or a Bridge) save: no args, no hf/."""
    shutil.rmtree(root / "hf", ignore_errors=True)
    for common in root.glob("*/common.pt"):
        state = safe_torch_load(common)
        state.pop("args")
        torch.save(state, common)
    for shard in root.glob(f"*/mp_rank_*/{SHARD_FILE}"):
        state = safe_torch_load(shard)
        state.pop("args")
        torch.save(state, shard)


def hf_logits(path: Path, vocab: int) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(ids).logits


def test_export_stops_generation_at_im_end(chat_model, tmp_path):
    mcore = hf_to_mcore(chat_model, tmp_path / "mcore", verify=False).out
    out = mcore_to_hf(mcore, tmp_path / "out", verify=False).out
    im_end = transformers.AutoTokenizer.from_pretrained(out).convert_tokens_to_ids(IM_END)
    eos = transformers.GenerationConfig.from_pretrained(out).eos_token_id
    assert im_end in (eos if isinstance(eos, list) else [eos])
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] is not None and im_end in config["eos_token_id"]


def test_training_side_dir_names_the_eos_ids(chat_model, tmp_path):
    from qlm_core.models.spec import ModelSpec
    from qlm_core.train.trainer import write_hf_side_dir

    write_hf_side_dir(tmp_path, ModelSpec.from_hf_dir(chat_model), chat_model)
    eos = json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"]
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == eos
    assert isinstance(eos, list) and len(eos) == 2  # <|endoftext|> and <|im_end|>


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_argsless_checkpoint_converts_with_config(fmt, hf_models, tmp_path):
    mcore = hf_to_mcore(hf_models["qwen2"], tmp_path / "mcore", tp=2, verify=False, format=fmt).out
    strip_args(mcore)
    with pytest.raises(QlmError, match="--config"):
        mcore_to_hf(mcore, tmp_path / "no_config")
    out = mcore_to_hf(mcore, tmp_path / "out", config=str(hf_models["qwen2"]), verify=False).out
    assert load_safetensors_dir(out)["model.embed_tokens.weight"].shape[0] == TINY["vocab_size"]
    assert torch.equal(hf_logits(out, 300), hf_logits(hf_models["qwen2"], 300))
    assert not list(tmp_path.glob(".*partial*"))


def test_argsless_checkpoint_to_deepspeed_with_config(hf_models, tmp_path):
    from qlm_core.checkpoint.convert.deepspeed import ds_to_hf, mcore_to_ds

    mcore = hf_to_mcore(hf_models["qwen2"], tmp_path / "mcore", tp=2, verify=False, format="torch_dist").out
    strip_args(mcore)
    with pytest.raises(QlmError, match="--config"):
        mcore_to_ds(mcore, tmp_path / "no_config")
    ds = mcore_to_ds(mcore, tmp_path / "ds", config=str(hf_models["qwen2"]), verify=False).out
    out = ds_to_hf(ds, tmp_path / "hf", verify=False).out
    assert torch.equal(hf_logits(out, 300), hf_logits(hf_models["qwen2"], 300))


def test_a_preset_config_is_the_config_every_megatron_export_writes(tmp_path):
    """--config PRESET names the architecture: mcore2mcore's hf/ and mcore2ds's config.json are the preset's, not the
    source's hf/config.json (which --config overrides); the tokenizer files still come from the source."""
    from qlm_core.checkpoint.convert.deepspeed import mcore_to_ds
    from qlm_core.models.presets import PRESETS

    hf_config = PRESETS["qlm-tiny"].to_hf_config()
    make_hf_model(tmp_path / "hf", "qwen2", **{k: hf_config[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings")})
    mcore = hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", verify=False, format="torch_dist").out
    side = json.loads((mcore / "hf" / "config.json").read_text())
    strip_args(mcore)
    (mcore / "hf").mkdir()
    shutil.copy(tmp_path / "hf" / "tokenizer.json", mcore / "hf")
    (mcore / "hf" / "config.json").write_text(json.dumps({**side, "max_position_embeddings": 77}))
    resharded = mcore_to_mcore(mcore, tmp_path / "tp2", tp=2, config="qlm-tiny", verify=False).out
    ds = mcore_to_ds(mcore, tmp_path / "ds", config="qlm-tiny", verify=False).out
    for written in (resharded / "hf", ds):
        assert json.loads((written / "config.json").read_text())["max_position_embeddings"] == 4096, written
        assert (written / "tokenizer.json").exists(), written


def test_args_only_checkpoint_exports_the_config_vocabulary(hf_models, tmp_path):
    """Megatron-LM's args name only the padded vocabulary: --config gives the real one."""
    mcore = hf_to_mcore(hf_models["qwen2"], tmp_path / "mcore", verify=False).out
    shutil.rmtree(mcore / "hf")
    for shard in mcore.glob(f"*/mp_rank_*/{SHARD_FILE}"):
        state = safe_torch_load(shard)
        state["args"].vocab_size = None
        torch.save(state, shard)
    padded = mcore_to_hf(mcore, tmp_path / "padded", verify=False).out
    assert load_safetensors_dir(padded)["model.embed_tokens.weight"].shape[0] == 384
    out = mcore_to_hf(mcore, tmp_path / "out", config=hf_models["qwen2"], verify=False).out
    assert load_safetensors_dir(out)["model.embed_tokens.weight"].shape[0] == 300
    assert torch.equal(hf_logits(out, 300), hf_logits(hf_models["qwen2"], 300))


def test_config_that_contradicts_the_shards_is_refused(hf_models, tmp_path):
    mcore = hf_to_mcore(hf_models["qwen2"], tmp_path / "mcore", verify=False, format="torch_dist").out
    strip_args(mcore)
    wide = tmp_path / "wide"
    make_hf_model(wide, "qwen2", intermediate_size=128)
    with pytest.raises(QlmError, match="implies"):
        mcore_to_hf(mcore, tmp_path / "out", config=wide)
    assert not (tmp_path / "out").exists()


def test_config_with_fewer_tokens_than_the_checkpoint_is_refused(hf_models, tmp_path):
    """hf/config.json (or args.vocab_size) names the real vocabulary: a smaller --config would drop rows."""
    mcore = hf_to_mcore(hf_models["qwen2"], tmp_path / "mcore", verify=False).out
    small = tmp_path / "small"
    make_hf_model(small, "qwen2", vocab_size=TINY["vocab_size"] - 10)
    with pytest.raises(QlmError, match=r"vocab_size 290 but the checkpoint's model has 300 tokens"):
        mcore_to_hf(mcore, tmp_path / "out", config=small)
    assert not (tmp_path / "out").exists()


def bridge_yaml(spec_config: dict, **override) -> str:
    model = dict(
        _target_="megatron.bridge.models.qwen.qwen_provider.Qwen2ModelProvider",
        num_layers=spec_config["num_hidden_layers"], hidden_size=spec_config["hidden_size"],
        ffn_hidden_size=spec_config["intermediate_size"], num_attention_heads=spec_config["num_attention_heads"],
        num_query_groups=spec_config["num_key_value_heads"], kv_channels=None, seq_length=256,
        rotary_base=spec_config.get("rope_theta", 10000.0), layernorm_epsilon=spec_config["rms_norm_eps"],
        normalization="RMSNorm", gated_linear_unit=True,
        activation_func={"_target_": "torch.nn.functional.silu", "_call_": False}, add_bias_linear=False,
        add_qkv_bias=True, share_embeddings_and_output_weights=False, vocab_size=spec_config["vocab_size"],
        make_vocab_size_divisible_by=128, position_embedding_type="rope", rotary_percent=1.0,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, bf16=False,
    )
    model.update(override)
    import yaml

    return yaml.safe_dump({"model": model, "train": {"train_iters": 4}, "checkpoint": {"save": "/ckpt"}})


def test_bridge_run_config_supplies_the_architecture(hf_models, tmp_path):
    mcore = hf_to_mcore(hf_models["qwen2"], tmp_path / "mcore", tp=2, verify=False, format="torch_dist").out
    strip_args(mcore)
    hf_config = json.loads((hf_models["qwen2"] / "config.json").read_text())
    (mcore / "iter_0000000" if (mcore / "iter_0000000").is_dir() else mcore / "release").joinpath(
        "run_config.yaml").write_text(bridge_yaml(hf_config))
    out = mcore_to_hf(mcore, tmp_path / "out", verify=False).out
    assert load_safetensors_dir(out)["model.embed_tokens.weight"].shape[0] == 300
    assert torch.equal(hf_logits(out, 300), hf_logits(hf_models["qwen2"], 300))
    resharded = mcore_to_mcore(mcore, tmp_path / "tp1", verify=False).out
    assert open_megatron(resharded).spec.num_layers == 4  # written with complete Megatron args
    from qlm_core.checkpoint.sources.open import open_checkpoint  # what train's model.load, eval, generate read

    assert open_checkpoint(mcore).spec.num_layers == 4


def test_bridge_args_read_the_model_section(tmp_path):
    hf_config = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 1000, "rope_theta": 1e6}
    path = tmp_path / "run_config.yaml"
    path.write_text(bridge_yaml(hf_config, share_embeddings_and_output_weights=True))
    args = bridge_args(path)
    assert (args.num_layers, args.ffn_hidden_size, args.num_query_groups, args.kv_channels) == (2, 96, 2, 16)
    assert args.swiglu and args.add_qkv_bias and not args.untie_embeddings_and_output_weights
    assert (args.vocab_size, args.rotary_base, args.norm_epsilon) == (1000, 1e6, 1e-6)
    path.write_text(bridge_yaml(hf_config, num_layers="four"))
    with pytest.raises(QlmError, match="num_layers"):
        bridge_args(path)


def test_inspect_reads_an_argsless_checkpoint_with_run_config(hf_models, tmp_path, run_qlm):
    mcore = hf_to_mcore(hf_models["qwen2"], tmp_path / "mcore", verify=False, format="torch_dist").out
    strip_args(mcore)
    code, stdout, stderr = run_qlm("convert", "inspect", mcore, "--json")
    assert code == 2 and "--config" in stderr
    hf_config = json.loads((hf_models["qwen2"] / "config.json").read_text())
    (tmp_path / "run_config.yaml").write_text(bridge_yaml(hf_config))  # above the checkpoint root
    code, stdout, stderr = run_qlm("convert", "inspect", mcore, "--json", "--no-tensors")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["args"]["args_from"] == str(tmp_path / "run_config.yaml") and report["args"]["num_layers"] == 4
