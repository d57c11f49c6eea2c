"""qlm profile on packed data: what a packed (and sliding-window) forward saves equals the prediction, and attention
FLOPs and time follow the documents (data.mean_doc_len / --mean-doc-len)."""

from __future__ import annotations

import pytest
import torch
from helpers import RECIPE
from parallel_cases import SPEC

from qlm_core.hardware import GPUS
from qlm_core.models.flops import attended_keys_per_token, layer_flops_per_token
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.profile.activations import ActivationInputs, forward_terms, layer_bytes
from qlm_core.profile.case import build_case
from qlm_core.profile.measure import SavedTensorMeter
from qlm_core.profile.timing import estimate_time

SEQ, BATCH = 64, 2
LENGTHS = [10, 30, 24]


def _packed_inputs(spec):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ + 1), generator=g)
    segments = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None].repeat(BATCH, 1)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].repeat(BATCH, 1)
    return tokens[:, :-1], tokens[:, 1:], positions, segments


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 16], ids=["packed", "packed_window"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_packed_layer_activations_match_saved_tensors(recompute, window, dtype):
    """The pieces keep exactly what the fused kernel keeps (q, k, v, output, lse); documents are Python ranges."""
    spec = SPEC if window is None else SPEC.replace(model_type="mistral", sliding_window=window)
    model = GPTModel(spec, parallel=ParallelOptions(recompute=recompute), num_layers=3, dtype=dtype)
    ids, labels, positions, segments = _packed_inputs(spec)
    with SavedTensorMeter(model) as meter:
        loss = model(ids, positions, segment_ids=segments, labels=labels).sum()
    x = ActivationInputs(spec, SEQ, BATCH, dtype_bytes=dtype.itemsize, padded_vocab=model.padded_vocab, device="cpu")
    measured = meter.layer_bytes()
    assert layer_bytes(x, recompute) == pytest.approx(measured["layer1"], rel=0.05)
    assert layer_bytes(x, recompute) + forward_terms(x, False)["rope cos/sin"] == pytest.approx(measured["layer0"],
                                                                                                 rel=0.05)
    loss.backward()
    assert meter.live_bytes == 0


def test_attended_keys_follow_documents_and_window():
    assert attended_keys_per_token(1000) == 500
    assert attended_keys_per_token(1000, mean_doc_len=100) == 50
    assert attended_keys_per_token(1000, mean_doc_len=5000) == 500  # a document cannot outgrow its sequence
    assert attended_keys_per_token(1000, window=100) == pytest.approx(100 - 100 * 100 / 2000)
    assert attended_keys_per_token(1000, mean_doc_len=50, window=100) == 25  # the window never binds
    spec = SPEC.replace(model_type="mistral", sliding_window=8)
    dense, attention = layer_flops_per_token(spec, 1024)
    assert attention == pytest.approx(2 * 2 * (8 - 64 / 2048) * spec.num_attention_heads * spec.kv_channels)


def test_packed_data_costs_less_attention_time():
    """mean_doc_len reaches the time model (the memory of packed rows is the measured test above)."""
    gpu = GPUS["a100-80g"]
    one = build_case(tp=4, cp=4)
    packed = build_case(tp=4, cp=4, mean_doc_len=8192)
    t_one, t_packed = estimate_time(one, gpu), estimate_time(packed, gpu)
    assert t_packed.components["compute"] < 0.8 * t_one.components["compute"]
    assert t_packed.model_flops_per_sample < t_one.model_flops_per_sample


def test_mean_doc_len_option_and_its_errors(run_qlm):
    code, out, err = run_qlm("profile", "--tp", "4", "--cp", "4", "--mean-doc-len", "8192")
    assert code == 0, err
    assert "documents of 8,192 tokens" in out
    code, out, err = run_qlm("profile", "--mean-doc-len", "-1")
    assert code == 2 and "mean-doc-len must be >= 0" in (out + err)  # a QlmError: one line, exit code 2
    assert len((out + err).strip().splitlines()) == 1


def test_negative_mean_doc_len_is_a_one_line_train_error(run_qlm):
    code, _, err = run_qlm("train", RECIPE, "--set", "data.mean_doc_len=-5", "--dry-run")
    assert code == 2 and "data.mean_doc_len must be >= 0, got -5" in err and err.strip().count("\n") == 0, err
