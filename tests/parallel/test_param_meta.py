"""Parameter marks (parallel/param_meta.py) and the training back-end interface (parallel/optimizer_api.py)."""

import torch
from parallel_cases import SPEC
from torch import nn

from qlm_core.models.gpt import GPTModel
from qlm_core.parallel.fsdp import FullyShardedState
from qlm_core.parallel.optimizer import DistributedOptimizer
from qlm_core.parallel.optimizer_api import TrainingOptimizer
from qlm_core.parallel.param_meta import ParamMeta, copy_meta, counts_in_grad_norm, mark, meta_of


def test_unmarked_parameter_has_the_default_meta():
    assert meta_of(nn.Parameter(torch.zeros(2))) == ParamMeta()


def test_mark_sets_only_the_named_flags_and_returns_the_param():
    param = nn.Parameter(torch.zeros(2))
    assert mark(param, shared_embedding=True) is param
    mark(param, tied_copy=True)
    assert meta_of(param) == ParamMeta(shared_embedding=True, tied_copy=True)


def test_copy_meta_carries_every_flag():
    source, target = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    mark(source, tp_split=True, sequence_parallel=True, shared_embedding=True, tied_copy=True)
    copy_meta(source, target)
    assert meta_of(target) == meta_of(source) == ParamMeta(True, True, True, True)


def test_grad_norm_counts_each_element_once():
    split, replicated, tied = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    mark(split, tp_split=True)
    mark(tied, tp_split=True, shared_embedding=True, tied_copy=True)
    assert [counts_in_grad_norm(p, 0) for p in (split, replicated, tied)] == [True, True, False]
    assert [counts_in_grad_norm(p, 1) for p in (split, replicated, tied)] == [True, False, False]


def test_model_marks_split_and_replicated_parameters():
    model = GPTModel(SPEC.replace(num_layers=1))
    split = {name for name, p in model.named_parameters() if meta_of(p).tp_split}
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in split
    assert "decoder.layers.0.mlp.linear_fc2.weight" in split
    assert "embedding.word_embeddings.weight" in split
    assert not any(name.endswith("layernorm.weight") for name in split)
    assert not any(meta_of(p).sequence_parallel for p in model.parameters())  # no TP group: nothing to sum


def test_both_back_ends_implement_the_training_optimizer():
    for backend in (DistributedOptimizer, FullyShardedState):
        assert TrainingOptimizer in backend.__mro__  # declared, not only structurally alike
        for method in ("zero_grad", "finish_grad_sync", "clip_grad_norm", "step", "set_lr", "wait_param_gather",
                       "full_grad", "full_param_states", "load_full_param_states"):
            assert getattr(backend, method) is not getattr(TrainingOptimizer, method), (backend, method)
