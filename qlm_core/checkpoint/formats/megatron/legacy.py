"""Megatron-LM legacy `torch` checkpoints: latest_checkpointed_iteration.txt, iter_%07d/ or release/,
mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt holding args, checkpoint_version, iteration and model / model0, model1, ...

Expert parallelism (`_EEE`, present when expert_model_parallel_size > 1): Megatron writes from the ranks whose
expert-data-parallel rank is 0; each file holds the dense TP shard TT and the routed experts of EP rank EEE
(numbered locally), split over the expert-TP size etp and holding etp part TT % etp (with etp dividing TP, the
writer's etp rank always is). A reader takes dense shard TT from any file named TT and expert part k of EP rank e
from any file of e whose TT % etp is k.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from pathlib import Path

import torch

from qlm_core.checkpoint.formats.hf.checkpoint import read_config
from qlm_core.checkpoint.formats.megatron.args import dtype_from_args, spec_from_args
from qlm_core.checkpoint.formats.megatron.lora_args import adapter_args
from qlm_core.checkpoint.formats.megatron.trainer_state import OPTIMIZER_KEY
from qlm_core.checkpoint.io.safe_load import safe_torch_load
from qlm_core.checkpoint.io.text import read_text_file
from qlm_core.errors import QlmError
from qlm_core.models.families import FAMILIES
from qlm_core.models.layout import ModelLayout, TensorLayout, normalize_megatron_name, read_from_parts
from qlm_core.models.spec import ModelSpec
from qlm_core.models.tensor_layout import REPLICATED

LATEST_FILE = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
HF_SIDE_DIR = "hf"  # config + tokenizer of the source HF model, kept so the way back is lossless
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def megatron_spec(root: Path, args) -> ModelSpec:
    """A Megatron checkpoint's architecture: the HF config kept beside it (exact), else its args. The args say
    whether the weights hold multi-token prediction layers (a config.json may count some its weights lack, as
    transformers saves them)."""
    side = root / HF_SIDE_DIR / "config.json"
    if side.exists():
        spec = ModelSpec.from_hf_config(read_config(side))
        if FAMILIES[spec.model_type].mtp_key:
            spec = spec.replace(mtp_num_layers=int(getattr(args, "mtp_num_layers", None) or 0))
        return spec
    return spec_from_args(args)


def iteration_dir_name(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def shard_dir_name(tp_rank: int, pp_rank: int, pp: int, ep: int = 0, ep_size: int = 1) -> str:
    """Megatron's rank folder: `_PPP` when pp > 1, then `_EEE` (the EP rank) when ep_size > 1."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
            + (f"_{ep:03d}" if ep_size > 1 else ""))


def check_legacy_experts(tp: int, etp: int):
    """Legacy rank folders name only the TP and EP ranks: an expert-TP size that does not divide TP would give two
    ranks holding different expert parts the same folder."""
    if tp % etp:
        raise QlmError(f"expert TP size {etp} does not divide TP {tp}: legacy `torch` rank folders cannot tell its "
                       "expert parts apart", "use an etp dividing tp, or the torch_dist format")


def legacy_shard_ranks(tp: int, ep: int = 1, etp: int | None = None) -> list[tuple[int, int]]:
    """(TP rank, EP rank) of every rank folder of one pipeline stage; the folder's experts are etp part
    tp_rank % etp. These are the ranks i = (dp_rank·cp + cp_rank)·tp + tp_rank below max(tp, ep·etp): those
    of expert-data-parallel rank 0 (Megatron's writers) and, when ep·etp < tp, the remaining dense TP shards."""
    etp = tp if etp is None else etp
    check_legacy_experts(tp, etp)
    return sorted({(i % tp, i // etp % ep) for i in range(max(tp, ep * etp))})


def legacy_writer(stage_index: int, tp: int, ep: int = 1, etp: int | None = None) -> tuple[int, int] | None:
    """(TP rank, EP rank) of the folder that rank i = stage_index of a pipeline stage writes, None: no folder."""
    etp = tp if etp is None else etp
    check_legacy_experts(tp, etp)
    if stage_index >= max(tp, ep * etp):
        return None
    return stage_index % tp, stage_index // etp % ep


def resolve_iteration_dir(root: Path, iteration: int | None = None) -> tuple[Path, int | None]:
    """The directory holding the rank folders, and its iteration (None for `release`)."""
    if iteration is not None:
        path = root / iteration_dir_name(iteration)
        if not path.is_dir():
            raise QlmError(f"{root} has no iteration {iteration}", f"choose one of {list_iterations(root) or 'none'}")
        return path, iteration
    latest = root / LATEST_FILE
    if latest.exists():
        text = read_text_file(latest, "fix the file (an iteration number or 'release') or pass --iteration").strip()
        if text == "release":
            path, found = root / "release", None
        elif text.isdigit():
            path, found = root / iteration_dir_name(int(text)), int(text)
        else:
            raise QlmError(f"{latest} holds {text!r}", "it must hold an iteration number or 'release'")
        if not path.is_dir():
            raise QlmError(f"{latest} points at {path.name}, which does not exist", "fix the file or pass --iteration")
        return path, found
    if any(_RANK_DIR.match(p.name) for p in root.iterdir()):
        match = re.match(r"iter_(\d+)", root.name)
        return root, int(match.group(1)) if match else None
    raise QlmError(f"{root} has no {LATEST_FILE}", "point at a Megatron checkpoint directory or pass --iteration")


def list_iterations(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p.name == "release" or p.name.startswith("iter_")))


def is_mcore_torch_dir(iteration_dir: Path) -> bool:
    return any(_RANK_DIR.match(p.name) for p in iteration_dir.iterdir() if p.is_dir())


class MegatronTorchCheckpoint:
    """A legacy-format checkpoint opened for lazy (mmap) reads of any global tensor range."""

    ckpt_format = "torch"

    def __init__(self, root: str | Path, iteration: int | None = None, spec: ModelSpec | None = None,
                 view: str = "model"):
        """`view`: "model" reads the weights; "master", "exp_avg" or "exp_avg_sq" read the per-parameter optimizer
        states qlm's trainer stores beside them (OPTIMIZER_KEY), laid out exactly like the weights."""
        self.view = view
        self.root = Path(root)
        if not self.root.is_dir():
            raise QlmError(f"{self.root} is not a directory", "point at a Megatron checkpoint directory")
        self.dir, self.iteration = resolve_iteration_dir(self.root, iteration)
        self._named = self._find_files()
        self._set_rank_files(None)
        self._states: dict[Path, dict] = {}
        self._chunks: dict[tuple[Path, int], dict] = {}
        some_file = min(self.files)
        state = self._state(*some_file)
        if "args" not in state:
            raise QlmError(f"{self.files[some_file]} has no args", "qlm needs Megatron's args to know the architecture")
        self.args = state["args"]
        self._set_rank_files(self.args)
        self._check_no_extra_ranks()
        self.tp = max(1 + max(t for t, _ in self.files), getattr(self.args, "tensor_model_parallel_size", 1) or 1)
        self.pp = max(1 + max(p for _, p in self.files), getattr(self.args, "pipeline_model_parallel_size", 1) or 1)
        self.ep = max(1 + max(e for _, _, e in self.rank_files),
                      getattr(self.args, "expert_model_parallel_size", 1) or 1)
        self.etp = getattr(self.args, "expert_tensor_parallel_size", None) or self.tp
        missing = [(t, p) for t in range(self.tp) for p in range(self.pp) if (t, p) not in self.files]
        if missing:
            names = ", ".join(shard_dir_name(t, p, self.pp, t // self.etp % self.ep, self.ep)
                              for t, p in missing[:4]) + (", ..." if len(missing) > 4 else "")
            found_tp, found_pp = 1 + max(t for t, _ in self.files), 1 + max(p for _, p in self.files)
            if (found_tp, found_pp) != (self.tp, self.pp) and len(self.files) == found_tp * found_pp:
                raise QlmError(f"{self.dir} holds rank folders for TP {found_tp} PP {found_pp} but its args say "
                               f"TP {self.tp} PP {self.pp} (no {names})",
                               "copy the complete checkpoint, or fix tensor/pipeline_model_parallel_size in the args")
            raise QlmError(f"{self.dir} lacks rank files {names}", "copy the complete checkpoint")
        first = self._state(0, 0)
        self.chunk_keys = sorted((k for k in first if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
        if not self.chunk_keys:
            raise QlmError(f"{self.files[(0, 0)]} has no model weights", "is it an optimizer-only file?")
        self.vpp = len(self.chunk_keys)
        self.spec = spec or self._spec()
        self.dtype = dtype_from_args(self.args)
        self.layout = self._layout()
        self._expert_files = self._find_expert_files()
        self.lora = adapter_args(self.args, self.chunk_state(0, 0, 0))  # None unless it holds LoRA adapters
        self._index = self._build_index()
        self._whole: set[str] = set()  # split tensors every TP file holds whole (_check_shapes)
        self._check_shapes()

    # ---- discovery -------------------------------------------------------------------------------------------------

    def _check_no_extra_ranks(self):
        """A rank folder beyond the sizes the args give (a stray copy, another run's) is named, not read as a
        larger layout: its tensors would be mistaken for more layers or experts. The checkpoint's args and the
        run_config.yaml that Megatron-Bridge saved beside it give the sizes it was saved with; --config describes the
        model, not how it was saved: the folders decide."""
        where = getattr(self, "args_from", "checkpoint")
        if where == "--config":
            return
        args = self.args
        sizes = {"tensor_model_parallel_size": 0, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 2}
        for key, position in sizes.items():
            wanted = getattr(args, key, None)
            if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1:
                continue
            extra = sorted(file.parent.name for ranks, file in self.rank_files.items() if ranks[position] >= wanted)
            if extra:
                given = "its args give" if where == "checkpoint" else f"{where} gives"
                raise QlmError(f"{self.dir} holds {', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}, beyond "
                               f"the {key} = {wanted} {given}", "remove the stray rank folders (or copy the "
                               "checkpoint again)")

    def _find_files(self) -> dict[tuple[int, ...], Path]:
        """(TT, then the folder name's 3-digit numbers) -> its model_optim_rng.pt."""
        files = {}
        for sub in self.dir.iterdir():
            match = _RANK_DIR.match(sub.name)
            if match and sub.is_dir():
                file = sub / SHARD_FILE
                if not file.exists():
                    raise QlmError(f"{file} is missing", "copy the complete checkpoint")
                files[tuple(int(g) for g in match.groups() if g is not None)] = file
        if not files:
            raise QlmError(f"{self.dir} has no mp_rank_* folders", "point at a legacy (torch) Megatron checkpoint")
        return files

    def _set_rank_files(self, args):
        """rank_files: (TP, PP, EP rank) -> file; files: (TP, PP) -> a file holding that dense shard (the lowest
        EP rank's). One 3-digit number in a folder name is the EP rank when the args (None: not read yet) say
        EP > 1 without PP, else the PP rank."""
        ep = (getattr(args, "expert_model_parallel_size", 1) or 1) if args is not None else 1
        pp = (getattr(args, "pipeline_model_parallel_size", 1) or 1) if args is not None else 1
        one_is_ep = ep > 1 and pp == 1
        self.rank_files: dict[tuple[int, int, int], Path] = {}
        for numbers, file in sorted(self._named.items()):
            t, rest = numbers[0], numbers[1:]
            p, e = (0, rest[0]) if one_is_ep and len(rest) == 1 else ((*rest, 0, 0)[:2])
            self.rank_files[(t, p, e)] = file
        self.files: dict[tuple[int, int], Path] = {}
        for (t, p, _), file in sorted(self.rank_files.items()):
            self.files.setdefault((t, p), file)

    def _find_expert_files(self) -> dict[tuple[int, int, int], Path]:
        """(PP, EP rank, expert-TP part) -> a file holding that part of those experts; any absent one is named."""
        if self.spec.moe is None:
            return {}
        check_legacy_experts(self.tp, self.etp)
        found: dict[tuple[int, int, int], Path] = {}
        for (t, p, e), file in sorted(self.rank_files.items()):
            found.setdefault((p, e, t % self.etp), file)
        for p in range(self.pp):
            for e in range(self.ep):
                for k in range(self.etp):
                    if (p, e, k) not in found:
                        name = shard_dir_name(k, p, self.pp, e, self.ep)
                        raise QlmError(f"{self.dir} lacks {name}/{SHARD_FILE} (the experts of EP rank {e}, expert-TP "
                                       f"part {k})", "copy the complete checkpoint")
        return found

    def _file(self, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> Path:
        return self.files[(tp_rank, pp_rank)] if ep_rank is None else self.rank_files[(tp_rank, pp_rank, ep_rank)]

    def _state(self, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> dict:
        """One rank file's contents: the dense shard's file (`ep_rank` None) or folder TT_PPP_EEE."""
        return self._load(self._file(tp_rank, pp_rank, ep_rank))

    def _load(self, file: Path) -> dict:
        if file not in self._states:
            self._states[file] = safe_torch_load(file, mmap=True)
        return self._states[file]

    def _spec(self) -> ModelSpec:
        return megatron_spec(self.root, self.args)

    def extra_state(self, key: str, tp_rank: int = 0, pp_rank: int = 0):
        """A top-level entry other than the weights (e.g. qlm's optimizer or train state), or None."""
        return self._state(tp_rank, pp_rank).get(key)

    def chunk_state(self, tp_rank: int, pp_rank: int, chunk: int,
                    ep_rank: int | None = None) -> dict[str, torch.Tensor]:
        """One chunk's tensors under local-spec names (TE norm names mapped, _extra_state dropped); `ep_rank` as
        in _state."""
        return self._file_chunk(self._file(tp_rank, pp_rank, ep_rank), chunk)

    def _file_chunk(self, file: Path, chunk: int) -> dict[str, torch.Tensor]:
        key = (file, chunk)
        if key not in self._chunks:
            state = self._load(file)
            if self.view == "model":
                raw = state[self.chunk_keys[chunk]]
            elif OPTIMIZER_KEY in state:
                raw = state[OPTIMIZER_KEY][self.view][chunk]
            else:
                raise QlmError(f"{file} holds no optimizer state",
                               "it was not written by qlm's trainer (or was saved without the optimizer)")
            self._chunks[key] = {
                local: value for name, value in raw.items() if (local := normalize_megatron_name(name)) is not None
            }
        return self._chunks[key]

    def _layer_counts(self) -> list[int]:
        counts = []
        for pp_rank in range(self.pp):
            total = 0
            for chunk in range(self.vpp):
                layers = {int(m.group(1)) for k in self.chunk_state(0, pp_rank, chunk)
                          if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
                total += len(layers)
            counts.append(total)
        return counts

    def _architecture_source(self) -> str:
        """What the architecture was read from, for errors: the args, hf/config.json, --config or a
        run_config.yaml."""
        if getattr(self, "args_from", "checkpoint") != "checkpoint":
            return self.args_from
        side = self.root / HF_SIDE_DIR / "config.json"
        return str(side) if side.exists() else "the args"

    def _layout(self) -> ModelLayout:
        counts = self._layer_counts()
        if sum(counts) != self.spec.num_layers:
            where = self._architecture_source()
            raise QlmError(
                f"the rank files hold {sum(counts)} layers but {where} say{'' if where == 'the args' else 's'} "
                f"{self.spec.num_layers} (num_layers)",
                f"fix num_layers in {where} if the files are whole, else copy the complete checkpoint",
            )
        embed = self.chunk_state(0, 0, 0).get("embedding.word_embeddings.weight")
        padded = embed.shape[0] * self.tp if embed is not None else getattr(self.args, "padded_vocab_size", None)
        if padded is None:
            raise QlmError(f"{self.files[(0, 0)]} has no embedding.word_embeddings.weight", "is it a GPT checkpoint?")
        if padded < self.spec.vocab_size:
            where = self._architecture_source()
            raise QlmError(f"{where} says vocab_size {self.spec.vocab_size} but the stored embedding has {padded} rows "
                           f"(tp {self.tp})", f"fix vocab_size in {where}, or copy the complete checkpoint")
        divisible = getattr(self.args, "make_vocab_size_divisible_by", 128) or 128
        candidates = [(None, None), (counts[0], None), (None, counts[-1]), (counts[0], counts[-1])]
        # a dense model's args may still carry expert sizes of Megatron's defaults: they do not apply
        experts = {"ep": self.ep, "etp": self.etp} if self.spec.moe is not None else {}
        refused = None  # a layout no split can make (experts, vocabulary, heads): that is the error, not the split
        for first, last in candidates if self.pp > 1 else [(None, None)]:
            try:
                layout = ModelLayout(self.spec, self.tp, self.pp, self.vpp, first, last, divisible, padded,
                                     **experts)
            except QlmError as exc:
                refused = refused or exc
                continue
            if list(layout.stage_layer_counts) == counts:
                return layout
        if refused is not None and not any(w in refused.problem for w in ("layers", "pipeline", "stage")):
            where = self._architecture_source()
            raise QlmError(f"{self.dir} at tp {self.tp} pp {self.pp} ep {self.ep} (as its rank folders and {where} "
                           f"say): {refused.problem}", refused.fix) from None
        raise QlmError(f"unsupported pipeline split {counts}", "qlm reads even splits with uneven first/last stages")

    def _build_index(self) -> dict[str, tuple[int, int, str, TensorLayout, int]]:
        """Global name -> (PP rank, chunk, local name, tensor, EP rank holding it)."""
        index = {}
        for pp_rank in range(self.pp):
            for chunk in range(self.vpp):
                for ep_rank in range(self.ep):
                    for local, tensor in self.layout.stored_tensors(pp_rank, chunk, self.lora, ep_rank):
                        if tensor.name not in index:
                            index[tensor.name] = (pp_rank, chunk, local, tensor, ep_rank)
        return index

    def _check_shapes(self):
        """Every stored shard must have the shape the architecture implies, and no stored tensor may lie outside
        it: args (or hf/config.json) that disagree with the weights are named here, before anything is read or
        written (a tensor the architecture has no place for would be dropped silently)."""
        side = self.root / HF_SIDE_DIR / "config.json"
        described_by = str(side) if side.exists() else "the args"
        for (_, pp_rank, ep_rank), file in sorted(self.rank_files.items()):
            for chunk in range(self.vpp):
                state = self._file_chunk(file, chunk)
                entries = self.layout.stored_tensors(pp_rank, chunk, self.lora, ep_rank)
                check_no_leftovers(file, state, {local for local, _ in entries}, described_by)
                for local, tensor in entries:
                    stored = state.get(local)
                    if stored is None:  # a LoRA run's adapters-only file; else read_into names it
                        continue
                    expected = tensor.shard_shape(self.layout.split_size(tensor))
                    if tuple(stored.shape) == tensor.shape and tensor.name.endswith(_DUPLICATED):
                        self._whole.add(tensor.name)  # Transformer Engine's duplicated down projections
                        continue
                    if tuple(stored.shape) != tuple(expected):
                        raise QlmError(
                                f"{file}: {local} is {list(stored.shape)} but "
                                f"{described_by} {'imply' if described_by == 'the args' else 'implies'} "
                                f"{list(expected)} at TP {self.tp}",
                                f"{_wrong_arg(tensor.name)} in {described_by} does not match the weights: "
                                "fix it (or restore the checkpoint's hf/config.json)")

    @property
    def holds_base(self) -> bool:
        """False for a LoRA run's checkpoint, which holds only the adapters."""
        return "embedding.word_embeddings.weight" in self.chunk_state(0, 0, 0)

    # ---- reads -----------------------------------------------------------------------------------------------------

    def _shard(self, file: Path, chunk: int, local: str) -> torch.Tensor:
        state = self._file_chunk(file, chunk)
        if local not in state:
            raise QlmError(f"{file} lacks {local}", "the checkpoint is incomplete")
        return state[local]

    def _part_file(self, tensor: TensorLayout, part: int, pp_rank: int, ep_rank: int) -> Path:
        """The file holding split part `part` of `tensor`: a routed expert's etp part, else TP shard `part`."""
        return self._expert_files[(pp_rank, ep_rank, part)] if tensor.expert else self.files[(part, pp_rank)]

    # ---- TensorSource (layout.py): ranges of global tensors, assembled from the TP shards -------------------------

    def _locate(self, tensor: TensorLayout) -> tuple[int, int, str, TensorLayout, int]:
        return self._index[tensor.stored_name]

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        pp_rank, chunk, local, source, ep_rank = self._locate(tensor)
        return self._shard(self._part_file(source, 0, pp_rank, ep_rank), chunk, local).dtype

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor):
        pp_rank, chunk, local, source, ep_rank = self._locate(tensor)
        if source.name in self._whole:  # every TP file holds it whole: read TP rank 0's
            source = dataclasses.replace(source, split=REPLICATED)
        read_from_parts(source, self.layout.split_size(source),
                        lambda rank: self._shard(self._part_file(source, rank, pp_rank, ep_rank), chunk, local),
                        start, stop, out)


# multi-latent attention's down projections: column-parallel under the local spec, but duplicated (whole on every TP
# rank) under the Transformer Engine spec, whose legacy files qlm reads too
_DUPLICATED = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def _leftover_setting(local: str) -> str:
    """The architecture setting that says a stored tensor cannot exist."""
    if local.endswith("linear_qkv.bias"):
        return "add_qkv_bias"
    if local.startswith("output_layer."):
        return "share_embeddings_and_output_weights (untie_embeddings_and_output_weights, tie_word_embeddings)"
    if "q_layernorm" in local or "k_layernorm" in local:
        return "qk_layernorm"
    if ".shared_experts." in local:
        return "moe_shared_expert_intermediate_size / moe_shared_expert_gate"
    if "expert_bias" in local:
        return "moe_router_enable_expert_bias"
    if local.endswith("core_attention.softmax_offset"):
        return "softmax_type (learnable: attention sinks)"
    if ".mlp.experts." in local or ".mlp.router." in local:
        return "num_moe_experts / moe_layer_freq"
    if local.endswith(".bias"):
        return "add_bias_linear"
    if ".layers." in local:
        return "num_layers"
    return "the architecture"


def check_no_leftovers(where: Path | str, stored, expected: set[str], described_by: str):
    """Every tensor of a stored chunk must be one the architecture has: a leftover would be dropped silently by
    every conversion, export and `model.load` (and --verify, comparing what the layout reads, would not see it)."""
    extra = sorted(name for name in stored if name not in expected)
    if extra:
        setting = _leftover_setting(extra[0])
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise QlmError(f"{where} holds {extra[0]}{more}, which {described_by} says this model does not have "
                       f"({setting})", f"fix {setting.split(' ')[0]} in {described_by} to match the weights, or pass "
                       "--config with the model's HF config")


def _wrong_arg(name: str) -> str:
    """The architecture setting a mis-shaped tensor points at."""
    if ".mlp.experts." in name or ".mlp.router." in name:
        return "num_experts / moe_ffn_hidden_size (moe_intermediate_size)"
    if ".shared_experts." in name:
        return "moe_shared_expert_intermediate_size"
    if ".linear_fc" in name or ".mlp." in name:
        return "ffn_hidden_size (intermediate_size)"
    if ".linear_qkv" in name or ".linear_proj" in name:
        return "num_attention_heads / num_query_groups / kv_channels or hidden_size"
    if "embedding" in name or "output_layer" in name:
        return "padded_vocab_size / hidden_size"
    return "hidden_size"


@contextmanager
def without_crc32():
    """torch.save without the zip CRC32 pass, which costs about as much as writing the bytes (torch.load does not
    need it); where the switch does not exist (older torch) saves are unchanged."""
    try:  # imported here: torch does not import it by itself, and an attribute lookup would miss it until then
        import torch.utils.serialization.config as config
    except ImportError:
        config = None
    save_config = getattr(config, "save", None)
    if save_config is None or not hasattr(save_config, "compute_crc32"):
        yield
        return
    previous = save_config.compute_crc32
    save_config.compute_crc32 = False
    try:
        yield
    finally:
        save_config.compute_crc32 = previous


def fast_torch_save(obj, path: Path):
    with without_crc32():
        torch.save(obj, path)


def write_shard_file(path: Path, chunks: list[dict], args, iteration: int | None, extra: dict | None = None,
                     tensor_bytes: bool = True) -> dict:
    """One mp_rank folder's model_optim_rng.pt: `model`, or `model0`, `model1`, ... with virtual pipelining, and
    any `extra` top-level entries (qlm's optimizer state, scheduler, RNG, data position). `tensor_bytes` False:
    the tensors' bytes are left as holes for the caller to write (legacy_stream.py). Returns what was saved."""
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0, **(extra or {})}
    if len(chunks) == 1:
        state["model"] = chunks[0]
    else:
        state.update({f"model{i}": chunk for i, chunk in enumerate(chunks)})
    path.parent.mkdir(parents=True, exist_ok=True)
    if tensor_bytes:
        fast_torch_save(state, path)
    else:
        with without_crc32(), torch.serialization.skip_data():
            torch.save(state, path)
    return state


def write_latest(root: Path, iteration: int | None):
    (root / LATEST_FILE).write_text("release" if iteration is None else str(iteration))
