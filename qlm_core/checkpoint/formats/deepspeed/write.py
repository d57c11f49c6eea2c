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
from typing import NamedTuple

import torch

from qlm_core.checkpoint.formats.deepspeed.checkpoint import LATEST, MODEL_FILE, TIED_OUTPUT
from qlm_core.checkpoint.formats.megatron.legacy import fast_torch_save
from qlm_core.errors import QlmError
from qlm_core.models.hf_experts import HFFiles, hf_packed_experts
from qlm_core.models.layout import ModelLayout, TensorSource
from qlm_core.models.spec import ModelSpec

DS_FORMAT_VERSION = "0.19.8"  # the DeepSpeed release whose layout this writes; its engines require a non-empty value


class ModuleNames(NamedTuple):
    """What DeepSpeed's model states list of a transformers module: its parameters in registration order (the
    order of param_shapes and of the flat fp32 partitions) and its persistent buffers."""

    files: HFFiles  # the layout's tensors as the module holds them
    params: list[str]
    buffers: list[str]


def module_names(layout: ModelLayout) -> ModuleNames:
    """transformers' model of the spec, built on the meta device, names the module: fused experts where it fuses
    them (transformers >= 5), its parameter order, which of the layout's tensors are buffers (DeepSeek's correction
    bias). Tensors transformers' model lacks (multi-token prediction layers) follow its parameters; a spec
    transformers has no model for (no HF config, or a family this transformers lacks) keeps the layout's names and
    order."""
    model = _meta_model(layout.spec)
    if model is None:
        files = HFFiles(layout)
        return ModuleNames(files, list(files.shapes), [])
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    buffers = {name for name, _ in model.named_buffers()}
    files = HFFiles(layout, state_dict=any(name in order for name in hf_packed_experts(layout.spec).shapes))
    ours = set(files.shapes) | ({TIED_OUTPUT} if layout.spec.tie_word_embeddings else set())
    lacking = [name for name in order if name not in ours]
    if lacking:
        raise QlmError(f"transformers' {layout.spec.model_type} model holds {', '.join(lacking[:3])}, which this "
                       "checkpoint lacks", "write a Hugging Face or Megatron checkpoint instead")
    params = sorted((n for n in files.shapes if n not in buffers), key=lambda name: order.get(name, len(order)))
    return ModuleNames(files, params, [n for n in files.shapes if n in buffers])


def _meta_model(spec: ModelSpec):
    """transformers' model of `spec` on the meta device, or None where it has none."""
    try:
        config = spec.to_hf_config()
    except QlmError:
        return None
    import transformers

    try:  # the spec's own pad token (GLM's config class otherwise pads with an id past a small vocabulary)
        hf_config = transformers.AutoConfig.for_model(**{**config, "pad_token_id": config.get("pad_token_id")})
    except (KeyError, ValueError):  # a model type this transformers does not know
        return None
    auto = transformers.AutoModelForSequenceClassification if spec.head == "score" \
        else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(hf_config)


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
    files, names, buffers = module_names(layout)
    tied = layout.spec.tie_word_embeddings
    embedding = embedding_name(layout)  # the family's name (OPT: model.decoder.embed_tokens)
    steps = len(names) + len(buffers) + (partitions if fp32_master else 0)
    tag_dir = root / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    module: dict[str, torch.Tensor] = OrderedDict()
    for i, name in enumerate(names + buffers):
        progress(i, steps, name)
        module[name] = files.assemble(name, source, dtype)
    if tied:
        module[TIED_OUTPUT] = module[embedding]
    stage = 2 if fp32_master else 0
    state = {
        "module": module,
        "buffer_names": buffers,
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
                               lambda r: progress(len(names) + len(buffers) + r, steps,
                                                  optimizer_file_name(r, dtype)))
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
