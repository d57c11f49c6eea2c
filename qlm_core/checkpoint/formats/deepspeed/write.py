"""Write a DeepSpeed checkpoint of an HF-named module: ROOT/latest + ROOT/<tag>/mp_rank_00_model_states.pt, which a
DeepSpeed engine (ZeRO 0-2) loads with load_checkpoint(ROOT, load_module_only=True), plus, by default, the fp32
master weights as ZeRO-2 optimizer partitions ([bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt) so that
DeepSpeed's zero_to_fp32 (and qlm's ds2hf) rebuild them. The partitions carry no Adam moments: an engine must load
the module only. See deepspeed.py for the layout."""

from __future__ import annotations

import itertools
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from qlm_core.checkpoint.formats.deepspeed.checkpoint import LATEST, MODEL_FILE, TIED_OUTPUT
from qlm_core.checkpoint.formats.megatron.legacy import fast_torch_save
from qlm_core.errors import QlmError
from qlm_core.models.hf_experts import HFFiles
from qlm_core.models.layout import ModelLayout, TensorSource

DS_FORMAT_VERSION = "0.19.8"  # the DeepSpeed release whose layout this writes; its engines require a non-empty value


def module_names(layout: ModelLayout, files: HFFiles) -> list[str]:
    """`files`' tensors (the layout's, as a transformers state_dict holds them) in the registration order of
    transformers' model of the spec (what DeepSpeed's param_shapes lists, and the order its flat fp32 partitions
    follow), built on the meta device; a spec transformers has no config for keeps the layout's order."""
    try:
        config = layout.spec.to_hf_config()
    except QlmError:
        return list(files.shapes)
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    auto = transformers.AutoModelForSequenceClassification if layout.spec.head == "score" \
        else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        order = {name: i for i, (name, _) in enumerate(auto.from_config(hf_config).named_parameters())}
    return sorted(files.shapes, key=lambda name: order.get(name, len(order)))


def embedding_name(layout: ModelLayout) -> str:
    return layout.embedding().segments[0].hf_name


def check_tag(tag: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", tag or "") or tag in (".", ".."):
        raise QlmError(f"--tag {tag!r} is not a plain directory name", "use a name like global_step0")
    return tag


def optimizer_file_name(rank: int, dtype: torch.dtype) -> str:
    return f"{'bf16_' if dtype == torch.bfloat16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _ds_config(dtype: torch.dtype, stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16}}


def write_deepspeed(root: Path, layout: ModelLayout, source: TensorSource, dtype: torch.dtype, tag: str,
                    global_steps: int = 0, fp32_master: bool = True, partitions: int = 1,
                    progress: Callable[[int, int, str], None] = lambda *_: None):
    """The module in `dtype` (HF names, the tied output layer sharing the embedding's storage as in a transformers
    state_dict), then the fp32 masters split into `partitions` equal ZeRO-2 slices, one file at a time."""
    files = HFFiles(layout, state_dict=True)  # transformers' state_dict: MoE experts packed
    names = module_names(layout, files)
    tied = layout.spec.tie_word_embeddings
    embedding = embedding_name(layout)  # the family's name (OPT: model.decoder.embed_tokens)
    steps = len(names) + (partitions if fp32_master else 0)
    tag_dir = root / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    module: dict[str, torch.Tensor] = OrderedDict()
    for i, name in enumerate(names):
        progress(i, steps, name)
        module[name] = files.assemble(name, source, dtype)
    if tied:
        module[TIED_OUTPUT] = module[embedding]
    stage = 2 if fp32_master else 0
    state = {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [OrderedDict((name, module[name].shape) for name in names)],
        "frozen_param_shapes": OrderedDict() if fp32_master else None,
        "shared_params": {TIED_OUTPUT: embedding} if tied else {},
        "frozen_param_fragments": OrderedDict() if fp32_master else None,
        "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
        "skipped_steps": 0, "global_steps": global_steps, "global_samples": 0,
        "dp_world_size": partitions, "mp_world_size": 1,
        "ds_config": _ds_config(dtype, stage), "ds_version": DS_FORMAT_VERSION,
    }
    fast_torch_save(state, tag_dir / MODEL_FILE)
    shapes = [(name, module[name].shape) for name in names]
    del module, state
    if fp32_master:
        _write_fp32_partitions(tag_dir, files, source, shapes, dtype, partitions,
                               lambda r: progress(len(names) + r, steps, optimizer_file_name(r, dtype)))
    progress(steps, steps, "done")
    (root / LATEST).write_text(tag)


def _write_fp32_partitions(tag_dir: Path, files: HFFiles, source: TensorSource, shapes, dtype: torch.dtype,
                           partitions: int, progress: Callable[[int], None]):
    """Rank r's file holds entries [r*size, (r+1)*size) of the params flattened one after another (zero padding at
    the end). Each file is filled from the params it overlaps; a param spanning two files is read twice."""
    total = sum(math.prod(shape) for _, shape in shapes)
    size = math.ceil(total / partitions)
    starts = [0]
    for _, shape in shapes:
        starts.append(starts[-1] + math.prod(shape))
    for rank in range(partitions):
        progress(rank)
        lo, hi = rank * size, (rank + 1) * size
        flat = torch.zeros(size, dtype=torch.float32)
        for (name, _), (start, stop) in zip(shapes, itertools.pairwise(starts), strict=True):
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                tensor = files.assemble(name, source, torch.float32).reshape(-1)
                flat[a - lo:b - lo] = tensor[a - start:b - start]
        optimizer = {
            "zero_stage": 2, "partition_count": [partitions], "single_partition_of_fp32_groups": [flat],
            "group_paddings": [size * partitions - total if rank == partitions - 1 else 0],
            "param_alignment_paddings": [[0] * len(shapes)], "ds_version": DS_FORMAT_VERSION,
        }
        fast_torch_save({"optimizer_state_dict": optimizer, "ds_config": _ds_config(dtype, 2),
                         "ds_version": DS_FORMAT_VERSION}, tag_dir / optimizer_file_name(rank, dtype))
        del flat
