"""Shared-prefix packing (train/shared_prefix.py): a rollout group's rows run their prompt once, and the rows'
hidden states, losses and gradients are those of the rows run whole."""

import torch
from parallel_cases import SPEC

from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.kernels.pieces import FULL, Piece, self_attention_pieces
from qlm_core.models.gpt import GPTModel
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Engine
from qlm_core.train.objectives.grpo import GrpoObjective
from qlm_core.train.objectives.grpo_loss import GrpoLoss
from qlm_core.train.shared_prefix import pack_shared_prefixes


def _rows():
    """Two groups of a 4-token prompt (rows 0-2, rows 4-5), a row with no label between them (row 3), answers of
    different lengths; -100 on prompts and padding."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, SPEC.vocab_size, (6, 10), generator=g)
    ids[1:3, :4] = ids[0, :4]
    ids[5, :4] = ids[4, :4]
    labels = torch.randint(0, SPEC.vocab_size, (6, 10), generator=g)
    labels[:, :3] = -100
    for row, end in enumerate([10, 7, 5, 0, 9, 8]):
        labels[row, end:] = -100
    labels[3] = -100
    return ids, torch.arange(10)[None].expand(6, 10), labels


def test_groups_share_their_prompt_through_the_first_label_position():
    ids, positions, labels = _rows()
    packed = pack_shared_prefixes(ids, positions, labels, multiple=4)
    # group 1: prefix 4 (the prompt: inputs through the first label's position, 3), then 6, 3, 1 own tokens;
    # group 2: prefix 4, then 5, 4; padding to 28
    assert packed.documents.rows == (((0, 4), (4, 10), (10, 13), (13, 14), (14, 18), (18, 23), (23, 27),
                                      (27, 28)),)
    assert packed.documents.prefixes == ((None, (0, 4), (0, 4), (0, 4), None, (14, 18), (14, 18), None),)
    assert packed.saved_tokens == 6 * 10 - 28
    assert torch.equal(packed.input_ids[0, :10], ids[0, :10])
    assert torch.equal(packed.position_ids[0, 10:13], torch.arange(4, 7))
    pieces = self_attention_pieces(packed.documents, 28, None)
    # one piece for the prefix's documents (each continues the prompt on its own: the joined piece has no one shift)
    assert Piece(0, slice(4, 14), slice(0, 4), FULL, None) in pieces


def test_rows_that_share_nothing_are_not_packed():
    ids, positions, labels = _rows()
    ids[:, 0] = torch.arange(6)
    assert pack_shared_prefixes(ids, positions, labels) is None


def test_the_packed_forward_gives_each_row_its_own_hidden_states():
    """Every labelled position (and the prompt's) of every row: the unpacked forward's hidden states (fp32)."""
    ids, positions, labels = _rows()
    torch.manual_seed(0)
    model = GPTModel(SPEC).eval()
    packed = pack_shared_prefixes(ids, positions, labels)
    with torch.no_grad():
        whole = model.hidden_states(ids, positions)
        shared = packed.unpack(model.hidden_states(packed.input_ids, packed.position_ids,
                                                   documents=packed.documents))
    for row, end in enumerate([10, 7, 5, 0, 9, 8]):
        assert torch.allclose(shared[:end, row], whole[:end, row], atol=1e-5, rtol=0), row
    assert shared[:, 3].abs().sum() == 0  # a row with nothing to train runs nothing


def _engine(spec=SPEC, shared_prefix=True, **fields) -> Engine:
    return Engine(spec, ParallelConfig(**fields), Grid.single(), micro_batch_size=6, global_batch_size=6,
                  seq_length=10, optim=OptimConfig(lr=1e-3), seed=3,
                  objective=GrpoObjective(GrpoLoss(loss_type="grpo", beta=0.0), shared_prefix=shared_prefix))


def test_a_step_with_shared_prompts_has_the_loss_and_gradients_of_whole_rows():
    from qlm_core.train.objectives.grpo import RolloutBatch

    ids, _, labels = _rows()
    g = torch.Generator().manual_seed(4)
    old = torch.where(labels >= 0, -5.7 + 0.3 * torch.randn(6, 10, generator=g), torch.zeros(()))
    results = {}
    for shared in (True, False):
        e = _engine(shared_prefix=shared)
        assert e.shares_prefixes == shared
        batch = RolloutBatch(ids, labels, old_logps=old, advantages=torch.randn(6, generator=g.manual_seed(5)))
        loss = e.global_loss(e.forward_backward(batch))
        grads = torch.cat([e.optimizer.full_grad(p).flatten() for p in e.chunks[0].parameters()])
        results[shared] = (loss, grads, e.saved_tokens)
    assert results[True][2] == 33 and results[False][2] == 0
    assert abs(results[True][0] - results[False][0]) < 1e-6
    assert torch.allclose(results[True][1], results[False][1], rtol=1e-4, atol=1e-7)


def test_layouts_and_models_that_cannot_share_run_whole_rows():
    from parallel_cases import WINDOWED

    assert not _engine(WINDOWED).shares_prefixes  # sliding windows count positions, not packed indices
