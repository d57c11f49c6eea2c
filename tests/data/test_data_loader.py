"""Global batches: data-parallel ranks split each global batch, resume from consumed_samples, collate to tensors."""

import numpy as np
import pytest
import torch

from qlm_core.data.loader import GlobalBatchSampler, collate
from qlm_core.errors import QlmError


def batches(sampler, count):
    iterator = iter(sampler)
    return [next(iterator) for _ in range(count)]


def test_ranks_take_contiguous_shares_of_each_global_batch():
    dp, B = 4, 8
    per_rank = [batches(GlobalBatchSampler(100, B, dp_rank=d, dp_size=dp), 5) for d in range(dp)]
    for b in range(5):
        rows = [i for d in range(dp) for i in per_rank[d][b]]
        assert rows == list(range(b * B, (b + 1) * B))
        assert all(len(per_rank[d][b]) == B // dp for d in range(dp))


def test_resume_from_consumed_samples_is_exact():
    for shuffle in (False, True):
        whole = batches(GlobalBatchSampler(30, 6, dp_rank=1, dp_size=2, shuffle=shuffle, seed=3), 12)
        resumed = batches(GlobalBatchSampler(30, 6, dp_rank=1, dp_size=2, consumed_samples=7 * 6, shuffle=shuffle,
                                             seed=3), 5)
        assert resumed == whole[7:]


def test_epochs_wrap_and_reshuffle_when_asked():
    plain = [i for b in batches(GlobalBatchSampler(10, 5), 4) for i in b]
    assert plain == list(range(10)) * 2
    shuffled = [i for b in batches(GlobalBatchSampler(10, 5, shuffle=True, seed=1), 4) for i in b]
    assert sorted(shuffled[:10]) == sorted(shuffled[10:]) == list(range(10))
    assert shuffled[:10] != shuffled[10:] and shuffled[:10] != list(range(10))
    finite = GlobalBatchSampler(10, 4, cycle=False)
    assert len(finite) == 2 and list(finite) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_bad_layouts_are_user_errors():
    with pytest.raises(QlmError, match="not divisible by the data-parallel size 4"):
        GlobalBatchSampler(100, 6, dp_size=4)
    with pytest.raises(QlmError, match="empty"):
        GlobalBatchSampler(0, 4)


def test_collate_stacks_and_keeps_missing_fields_none():
    items = [dict(input_ids=np.arange(4) + i, labels=np.arange(4), position_ids=None, segment_ids=None)
             for i in range(3)]
    input_ids, labels, positions, segments = collate(items)
    assert labels.shape == input_ids.shape == (3, 4) and input_ids.dtype == torch.long
    assert positions is None and segments is None
    assert torch.equal(input_ids[2], torch.arange(4) + 2)
    packed = [dict(input_ids=np.zeros(4, np.uint16), labels=np.zeros(4), position_ids=np.arange(4),
                   segment_ids=np.zeros(4)) for _ in range(2)]
    *_, positions, segments = collate(packed)
    assert positions.shape == segments.shape == (2, 4) and segments.dtype == torch.long


def test_works_as_a_dataloader_batch_sampler():
    dataset = [dict(input_ids=np.full(3, i), labels=np.full(3, i), position_ids=None, segment_ids=None)
               for i in range(20)]
    sampler = GlobalBatchSampler(len(dataset), 8, dp_rank=1, dp_size=2, cycle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    firsts = [batch[0][:, 0].tolist() for batch in loader]
    assert firsts == [[4, 5, 6, 7], [12, 13, 14, 15]]
