"""qlm profile counts the terms the new families bring: GLM-4's norms after attention and MLP and Gemma 3's (1 + w)
norms, q/k norms and GeGLU (their saved inputs equal the saved-tensor measurement under every recompute mode), their
weights, and an in-process --probe of a tiny GLM-4 and Gemma 3 within 5% per memory component; per-layer sliding
windows change the attention FLOPs the time counts."""

import pytest
import torch
from parallel_cases import BLOOM, GEMMA2, GEMMA3, GLM4, GPT_OSS, MPT, OPT, SPEC

from qlm_core.config import ParallelConfig
from qlm_core.hardware import gpu_spec
from qlm_core.models.gpt import GPTModel
from qlm_core.models.runtime import ParallelOptions
from qlm_core.profile.activations import ActivationInputs, forward_terms, layer_bytes
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.efficiency import Efficiency
from qlm_core.profile.measure import SavedTensorMeter
from qlm_core.profile.probe import probe
from qlm_core.profile.timing import microbatch_times

SEQ, BATCH = 64, 2


FAMILIES = {"glm4": GLM4, "gemma3": GEMMA3, "opt": OPT, "opt_gelu": OPT.replace(
    activation="gelu", linear_bias=False, qkv_bias=False), "gpt_oss": GPT_OSS, "bloom": BLOOM,
            "mpt": MPT, "gemma2": GEMMA2}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_bytes_equal_saved_tensors(recompute, dtype, family):
    spec = FAMILIES[family]
    model = GPTModel(spec, parallel=ParallelOptions(recompute=recompute), num_layers=3, dtype=dtype)
    ids = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(model) as meter:
        model(ids, labels=ids.roll(-1, 1)).sum()
    x = ActivationInputs(spec, SEQ, BATCH, dtype_bytes=dtype.itemsize, padded_vocab=model.padded_vocab, device="cpu")
    plain = ActivationInputs(spec.replace(post_norms=False), SEQ, BATCH, dtype_bytes=dtype.itemsize,
                             padded_vocab=model.padded_vocab, device="cpu")
    assert layer_bytes(x, recompute) == pytest.approx(meter.layer_bytes()["layer1"], rel=1e-9)
    if spec.post_norms:
        assert (layer_bytes(x, recompute) > layer_bytes(plain, recompute)) == (recompute != "full")


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_of_a_family_measures_what_is_predicted(family):
    case = ProfileCase(spec=FAMILIES[family], model_name=f"tiny-{family}", parallel=ParallelConfig(zero_stage=1),
                       seq_len=128, global_batch_size=2, num_gpus=1)
    result = probe(case, gpu_spec("a100-80g"), steps=1)
    for key in ("weights", "grads", "optimizer"):
        assert result.predicted[key] == result.measured[key], key
    for key in ("activations", "logits_loss"):
        assert result.predicted[key] == pytest.approx(result.measured[key], rel=0.05), key


def test_windowed_layers_take_less_attention_time():
    def seconds(spec):
        case = ProfileCase(spec=spec, model_name="tiny", parallel=ParallelConfig(), seq_len=8192,
                           global_batch_size=1, num_gpus=1)
        return microbatch_times(case, gpu_spec("h100"), Efficiency(), 0)["compute"]

    full = seconds(SPEC)
    half = seconds(SPEC.replace(sliding_window=512, window_layers=(True, False, True, False)))
    every = seconds(SPEC.replace(sliding_window=512))
    assert every < half < full


def test_gemma3_saves_one_rope_pair_per_base():
    """Gemma 3's windowed and global layers rotate by their own bases: the first layer of each kind keeps its own
    cos and sin, which the per-forward terms count."""
    model = GPTModel(GEMMA3, dtype=torch.bfloat16)  # layers 0-2 windowed, layer 3 global
    ids = torch.randint(0, GEMMA3.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(model) as meter:
        model(ids, labels=ids.roll(-1, 1)).sum()
    x = ActivationInputs(GEMMA3, SEQ, BATCH, dtype_bytes=2, padded_vocab=model.padded_vocab, device="cpu")
    held = meter.layer_bytes()
    assert sum(held.values()) == 4 * layer_bytes(x, "none") + forward_terms(x, False)["rope cos/sin"]
    assert held["layer0"] == held["layer3"] > held["layer1"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bloom_embedding_norm_is_counted(dtype):
    """BLOOM's norm after the word embedding keeps its input and statistics once per forward: the embedding's saved
    bytes equal the per-forward terms (ALiBi keeps nothing: its tiles' biases are rebuilt in backward)."""
    model = GPTModel(BLOOM, dtype=dtype)
    ids = torch.randint(0, BLOOM.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(model) as meter:
        model(ids, labels=ids.roll(-1, 1)).sum()
    x = ActivationInputs(BLOOM, SEQ, BATCH, dtype_bytes=dtype.itemsize, padded_vocab=model.padded_vocab, device="cpu")
    terms = forward_terms(x, True)
    assert terms["embedding norm"] > 0
    assert meter.first_seen["embedding"] == sum(terms.values())
