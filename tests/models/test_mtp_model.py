"""Multi-token prediction in the one decoder: each depth's logits equal DeepSeek's MTP module built from transformers'
own decoder layer (tests/mtp_reference.py) for every family that has it, two depths chained; the engine trains it
with Megatron's loss (its value reported beside the language-model loss, which it leaves unchanged); the shifted
tokens and labels stay within their documents."""

import pytest
import torch
from conftest import MTP_KINDS
from helpers import qlm_from_hf
from mtp_reference import mtp_logits, mtp_token_losses
from parallel_cases import MLA as MLA_MTP  # one MTP layer

from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.config import ParallelConfig
from qlm_core.models.layout import HFTensorSource
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Batch, Engine
from qlm_core.train.mtp_targets import mtp_targets

IDS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
NEXT = torch.cat([IDS[:, 1:], torch.randint(0, 300, (2, 1), generator=torch.Generator().manual_seed(1))], dim=1)


@pytest.mark.parametrize("kind", list(MTP_KINDS))
def test_each_depths_logits_equal_deepseeks_mtp_module(mtp_models, kind):
    model, spec = qlm_from_hf(mtp_models[kind])
    assert spec.mtp_num_layers == MTP_KINDS[kind][1]
    tokens, _ = mtp_targets(IDS, NEXT, None, spec.mtp_num_layers)
    with torch.no_grad():
        parts = model.hidden_states(IDS, mtp_tokens=tokens).chunk(1 + spec.mtp_num_layers, dim=0)
        assert (model.logits(parts[0]) - model(IDS)).abs().max().item() == 0  # the main output as without MTP
        for depth, expected in enumerate(mtp_logits(mtp_models[kind], IDS), start=1):
            got = model.logits(parts[depth])
            # the last `depth` positions embed the fill token and predict nothing (as Megatron-Core's roll)
            assert (got - expected)[:, :-depth].abs().max().item() <= 1e-5, (kind, depth)


def _engine(path, scale):
    ckpt = HFCheckpoint(path)
    return Engine(ckpt.spec, ParallelConfig(), Grid.single(), micro_batch_size=1, global_batch_size=2,
                  seq_length=IDS.shape[1], source=HFTensorSource(ckpt), mtp_loss_scaling_factor=scale)


def test_the_engine_trains_megatrons_mtp_loss_and_reports_it_beside_the_lm_loss(mtp_models):
    """Two depths: mtp_loss is the mean over depths of each depth's mean token loss over the batch; the step's
    loss is the language-model loss alone (the same as with the scale at 0, where the MTP layers are frozen), while
    the gradients carry the MTP loss times its scale."""
    path = mtp_models["deepseek_v3"]
    labels = NEXT.clone()
    labels[0, 5] = -100  # an ignored label: each depth reaches it at another position
    expected = [loss.sum() / (loss != 0).sum() for loss in mtp_token_losses(path, IDS, labels)]
    trained, frozen = _engine(path, 0.3), _engine(path, 0.0)
    with_mtp, without = (engine.train_step(Batch(IDS.clone(), labels.clone())) for engine in (trained, frozen))
    assert with_mtp.figures["mtp_loss"] == pytest.approx(torch.stack(expected).mean().item(), rel=1e-5)
    assert without.figures is None and with_mtp.loss == without.loss
    assert with_mtp.grad_norm != pytest.approx(without.grad_norm, rel=1e-3)
    mtp_params = dict(frozen.chunks[0].mtp.named_parameters())
    assert mtp_params and not any(p.requires_grad for p in mtp_params.values())


def test_shifted_tokens_and_labels_stay_within_their_documents():
    ids = torch.arange(10, 20)[None]
    labels = torch.arange(11, 21)[None]
    labels[0, 3] = -100  # the first document's last token predicts nothing
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    tokens, targets = mtp_targets(ids, labels, segments, 2)
    assert tokens[0, :, 0].tolist() == [11, 12, 13, 0, 15, 16, 17, 18, 19, 0]
    assert tokens[0, :, 1].tolist() == [12, 13, 0, 0, 16, 17, 18, 19, 0, 0]
    assert targets[0, :, 0].tolist() == [12, 13, -100, -100, 16, 17, 18, 19, 20, -100]
    assert targets[0, :, 1].tolist() == [13, -100, -100, -100, 17, 18, 19, 20, -100, -100]


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
def test_shard_entries_hold_the_output_layer_exactly_where_the_model_has_one(pp, ep):
    """A tied model's last stage holds output_layer.weight only when it lacks the embedding, whatever the EP rank
    (the routed experts are sliced per layer beside it); an MTP model's last stage also holds the embedding."""
    from parallel_cases import MOE

    from qlm_core.models.layout import ModelLayout

    for spec in (MOE.replace(tie_word_embeddings=True), MOE):
        layout = ModelLayout(spec, pp=pp, ep=ep)
        for ep_rank in range(ep):
            names = [name for name, _ in layout.shard_entries(pp - 1, 0, ep_rank)]
            assert ("output_layer.weight" in names) == (not spec.tie_word_embeddings or pp > 1)
            assert ("embedding.word_embeddings.weight" in names) == (pp == 1)
            experts = {n.split("local_experts.")[1].split(".")[0] for n in names if "local_experts." in n}
            assert experts == {str(e) for e in range(4 // ep)}
    names = [name for name, _ in ModelLayout(MLA_MTP, pp=2).shard_entries(1, 0)]
    assert "embedding.word_embeddings.weight" in names and "mtp.layers.0.eh_proj.weight" in names


def test_a_reward_model_from_an_mtp_model_drops_the_mtp_layers():
    from qlm_core.models.presets import PRESETS

    assert PRESETS["qlm-tiny-mla"].as_reward_model().mtp_num_layers == 0
