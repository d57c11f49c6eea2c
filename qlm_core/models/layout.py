"""Every HF <-> Megatron-Core name and shard rule, in one place.

Three views of the same weights:
  HF          q_proj / k_proj / v_proj / gate_proj / ... , full tensors, unpadded vocabulary
  global      Megatron names with layers numbered globally, fused tensors (grouped linear_qkv, fc1 = [gate; up]),
              vocabulary padded for the target TP size (this is also torch_dist's view)
  shard       what TP rank t of pipeline stage p (virtual chunk c) holds: Megatron's legacy file content and,
              identically, the state_dict of qlm's model built for (t, p, c). Under expert parallelism the
              routed experts of a shard are those of its EP rank (renumbered locally from 0, as Megatron names
              them) and are split over the expert-TP size `etp` instead of `tp`.

A global tensor is split along one axis. Along that axis it is a concatenation of `Segment`s, each a row range of
one HF tensor or of Megatron's vocabulary padding; a TP shard is a list of ranges of that axis. Every conversion is
"read these ranges from a source", so readers stream: nothing holds more than one output file plus a few slices.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from qlm_core.errors import QlmError
from qlm_core.models.activations import activation_kind
from qlm_core.models.attention_kinds import attention_kind
from qlm_core.models.families import FAMILIES, GATE_UP_DOWN, hf_name
from qlm_core.models.norms import norm_kind
from qlm_core.models.spec import ModelSpec, padded_vocab_size
from qlm_core.models.tensor_layout import COLS, FC1, REPLICATED, ROWS, Segment, TensorLayout, TensorSource

_FIRST_FLAG, _LAST_FLAG = "--num-layers-in-first-pipeline-stage", "--num-layers-in-last-pipeline-stage"

EMBEDDING = "embedding.word_embeddings.weight"
POSITION_EMBEDDING = "embedding.position_embeddings.weight"  # learned absolute positions (first stage)
OUTPUT_LAYER = "output_layer.weight"  # the vocabulary projection, or a reward model's score head
LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
# multi-latent attention's linears besides linear_proj (Megatron-Bridge's MLA LoRA targets)
MLA_LINEARS = ("self_attention.linear_q_proj", "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
               "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj")
# LoRA target name (LoraConfig.target_modules) -> the linear it adapts; in state_dict order. In an MoE layer the MLP
# targets adapt the shared expert's linears (SHARED_EXPERT_LINEARS); routed experts take no adapters. A target the
# layer's attention kind lacks (linear_qkv in multi-latent attention, its own linears elsewhere) adapts nothing.
LORA_TARGETS = {linear.rsplit(".", 1)[1]: linear for linear in (LINEARS[0], *MLA_LINEARS, *LINEARS[1:])}
SHARED_EXPERT_LINEARS = {"mlp.linear_fc1": "mlp.shared_experts.linear_fc1",
                         "mlp.linear_fc2": "mlp.shared_experts.linear_fc2"}
EXPERT_PREFIX = "mlp.experts.local_experts."  # SequentialMLP: `mlp.experts.local_experts.<e>.linear_fc1.weight`

# Transformer-Engine spec fuses the norms into the following linear; torch_dist always uses these names.
TE_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",  # LayerNorm's (OPT)
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
# ... and in multi-latent attention the q and kv latents' norms into the up projections (its input_layernorm stays
# a module of its own under both specs)
MLA_TE_NORM_NAMES = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclass(frozen=True)
class ModelLayout:
    spec: ModelSpec
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    make_vocab_size_divisible_by: int = 128
    padded_vocab: int | None = None  # None: Megatron's rule for this TP size
    ep: int = 1  # expert model parallel size
    etp: int | None = None  # expert tensor parallel size; None: tp
    _stage_counts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # layer -> its entries (layer_entries), built once: every shard of an expert-parallel layout walks every layer
    _entries: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.padded_vocab is None:
            padded = padded_vocab_size(self.spec.vocab_size, self.make_vocab_size_divisible_by, self.tp)
            object.__setattr__(self, "padded_vocab", padded)
        self._validate()
        object.__setattr__(self, "_stage_counts", tuple(self._compute_stage_counts()))

    # ---- validation ------------------------------------------------------------------------------------------------

    def _validate(self):
        s, tp = self.spec, self.tp
        if min(self.tp, self.pp, self.vpp) < 1:
            raise QlmError("tp, pp and vpp must be at least 1", "pass positive sizes")
        if s.num_attention_heads % tp:
            raise QlmError(
                f"--tp {tp} does not divide num_attention_heads {s.num_attention_heads}",
                f"use a TP size that divides {s.num_attention_heads}",
            )
        if s.mla is not None:
            for what, size in (("q_lora_rank", s.mla.q_lora_rank), ("kv_lora_rank + qk_rope_head_dim",
                                                                   s.mla.kv_lora_rank + s.mla.qk_rope_head_dim)):
                if size is not None and size % tp:  # the local spec's column-parallel down projections
                    raise QlmError(f"--tp {tp} does not divide multi-latent attention's {what} {size}",
                                   f"use a TP size that divides {size}")
        elif s.num_query_groups % tp and tp % s.num_query_groups:
            raise QlmError(
                f"--tp {tp} neither divides nor is a multiple of num_query_groups {s.num_query_groups}",
                f"use a TP size that divides {s.num_query_groups} or a multiple of it",
            )
        dense = any(not s.is_moe_layer(i) for i in range(s.num_layers))
        if dense and s.ffn_hidden_size % tp:
            raise QlmError(f"--tp {tp} does not divide ffn_hidden_size {s.ffn_hidden_size}", "choose another TP size")
        if s.moe is not None:
            expert_split = ("--tp" if self.etp == tp else "--etp", self.etp)
            for what, size, split in (("moe_intermediate_size", s.moe.ffn_hidden_size, expert_split),
                                      ("shared_expert_intermediate_size", s.moe.shared_expert_hidden_size,
                                       ("--tp", tp))):
                if size % split[1]:
                    raise QlmError(f"{split[0]} {split[1]} does not divide the MoE {what} {size}",
                                   f"use a size that divides {size}")
            if s.moe.num_experts % self.ep:
                raise QlmError(f"--ep {self.ep} does not divide num_experts {s.moe.num_experts}",
                               f"use an EP size that divides {s.moe.num_experts}")
            if s.linear_bias and self.etp > 1:
                raise QlmError(f"expert biases (gpt-oss's) split over {expert_split[0]} {self.etp}: Megatron-Core adds "
                               "an MoE layer's biases at expert-TP 1 only", "pass --etp 1")
        elif (self.ep, self.etp) != (1, tp):
            raise QlmError(f"--ep {self.ep} / --etp {self.etp} needs a Mixture-of-Experts model", "drop --ep / --etp")
        if self.padded_vocab < s.vocab_size or self.padded_vocab % tp:
            raise QlmError(
                f"padded vocabulary {self.padded_vocab} is smaller than {s.vocab_size} or not divisible by --tp {tp}",
                "check --make-vocab-size-divisible-by",
            )

    @property
    def experts_per_rank(self) -> int:
        return self.spec.moe.num_experts // self.ep if self.spec.moe is not None else 0

    def split_size(self, tensor: TensorLayout) -> int:
        """The number of ranks `tensor` is split over: etp for a routed expert's linear, else tp."""
        return self.etp if tensor.expert else self.tp

    def _compute_stage_counts(self) -> list[int]:
        L, pp, first, last = self.spec.num_layers, self.pp, self.first_stage_layers, self.last_stage_layers
        options = " + ".join(f"{flag} {n}" for flag, n in ((_FIRST_FLAG, first), (_LAST_FLAG, last)) if n is not None)
        both = first is not None and last is not None
        if pp == 1:
            if first is not None or last is not None:
                raise QlmError(f"{options} need{'' if both else 's'} --pp > 1 (one stage holds all {L} layers)",
                               "drop those options or raise --pp")
            counts = [L]
        else:
            if any(n is not None and n < 1 for n in (first, last)):
                raise QlmError(f"{options}: a pipeline stage needs at least one layer", "pass sizes of 1 or more")
            fixed = (first or 0) + (last or 0)
            middle = pp - (first is not None) - (last is not None)
            rest = L - fixed
            if pp > L:
                divisors = [d for d in range(2, L + 1) if L % d == 0]
                raise QlmError(f"--pp {pp} is more pipeline stages than the model's {L} layers (each stage needs one)",
                               f"use a --pp of at most {L}" + (f", e.g. one that divides {L}: "
                                                               f"{', '.join(map(str, divisors))}" if divisors else ""))
            if first is None and last is None:
                if L % pp:
                    raise QlmError(
                        f"{L} layers cannot be split over {pp} pipeline stages",
                        f"use a --pp that divides {L}, or {_FIRST_FLAG} / {_LAST_FLAG} so the rest divides evenly")
            elif middle == 0 and rest != 0:  # two stages, both sizes given (Megatron accepts them when they sum up)
                raise QlmError(f"{options} hold {fixed} layers, but the model has {L} and --pp {pp} has no other stage",
                               f"make them add up to {L}, or set only one of them")
            elif rest < middle:
                raise QlmError(
                    f"{options} leave{'' if both else 's'} {max(rest, 0)} of the {L} layers for {middle} "
                    f"other pipeline stage{'s' if middle > 1 else ''}",
                    f"they must add up to at most {L - middle}, so that each other stage gets a layer")
            elif middle and rest % middle:
                if first is None or last is None:
                    valid = [n for n in range(1, L) if L - n >= middle and (L - n) % middle == 0]
                    flag = _FIRST_FLAG if first is not None else _LAST_FLAG
                    hint = f"valid {flag} values at --pp {pp}: {', '.join(map(str, valid[:8])) or 'none'}"
                else:
                    hint = f"{L} minus their sum must be a multiple of {middle}"
                raise QlmError(f"{options} leave{'' if both else 's'} {rest} of the {L} layers, which do "
                               f"not divide evenly over the {middle} other pipeline stages", hint)
            counts = ([first] if first is not None else []) + ([rest // middle] * middle if middle else [])
            counts += [last] if last is not None else []
        if any(c % self.vpp for c in counts) or any(c < self.vpp for c in counts):
            raise QlmError(
                f"stage sizes {counts} are not divisible into {self.vpp} virtual pipeline chunks",
                "choose --vpp dividing every stage's layer count"
                + (" (or first/last stage sizes that --vpp divides)" if first is not None or last is not None else ""),
            )
        return counts

    # ---- pipeline --------------------------------------------------------------------------------------------------

    @property
    def stage_layer_counts(self) -> tuple[int, ...]:
        return self._stage_counts

    def chunk_layers(self, pp_rank: int, chunk: int) -> range:
        """Global layer indices held by virtual chunk `chunk` of stage `pp_rank` (chunk-major order, as Megatron)."""
        per_chunk = [c // self.vpp for c in self._stage_counts]
        start = chunk * sum(per_chunk) + sum(per_chunk[:pp_rank])
        return range(start, start + per_chunk[pp_rank])

    def is_first(self, pp_rank: int, chunk: int) -> bool:
        return pp_rank == 0 and chunk == 0

    def is_last(self, pp_rank: int, chunk: int) -> bool:
        return pp_rank == self.pp - 1 and chunk == self.vpp - 1

    # ---- tensors ---------------------------------------------------------------------------------------------------

    def embedding(self) -> TensorLayout:
        return self._family_names(self._vocab_tensor(EMBEDDING, "model.embed_tokens.weight", True))

    def position_embedding(self) -> TensorLayout | None:
        """Learned absolute positions [max_position_embeddings + the family's offset, h], whole on every TP rank
        (OPT's HF tensor keeps its two rows before position 0); None for other position schemes."""
        if self.spec.position != "learned_absolute":
            return None
        rows = self.spec.max_position_embeddings + FAMILIES[self.spec.model_type].position_offset
        return self._family_names(TensorLayout(POSITION_EMBEDDING, (rows, self.spec.hidden_size), REPLICATED,
                                               (Segment(0, rows, "model.embed_positions.weight"),)))

    def embedding_norms(self) -> list[tuple[str, TensorLayout]]:
        """(name, tensor) of the norm after the word embedding (BLOOM's; Megatron-DeepSpeed's
        `embedding.word_embeddings.norm.<tensor>`), none without one."""
        if not self.spec.embedding_norm:
            return []
        return [(tensor.name, self._family_names(tensor))
                for _, tensor in _norm_entries(self.spec, "embedding.", "word_embeddings.norm", "model.embed_norm")]

    def _family_names(self, tensor: TensorLayout | None) -> TensorLayout | None:
        """`tensor` with its segments' HF names in the family's own spelling (families.hf_name)."""
        if tensor is None or not FAMILIES[self.spec.model_type].hf_names:
            return tensor
        return replace(tensor, segments=tuple(
            seg if seg.hf_name is None else replace(seg, hf_name=hf_name(self.spec.model_type, seg.hf_name))
            for seg in tensor.segments))

    def output_layer(self) -> TensorLayout:
        if self.spec.head == "score":  # one row, whole on every TP rank (qlm's extension of Megatron's names)
            h = self.spec.hidden_size
            return TensorLayout(OUTPUT_LAYER, (1, h), REPLICATED, (Segment(0, 1, "score.weight"),))
        if self.spec.tie_word_embeddings:  # a copy of the embedding (a last stage without it keeps its own)
            return self._family_names(
                self._vocab_tensor(OUTPUT_LAYER, "model.embed_tokens.weight", False, stored_as=EMBEDDING))
        return self._vocab_tensor(OUTPUT_LAYER, "lm_head.weight", True)

    def final_norms(self) -> list[tuple[str, TensorLayout]]:
        """(name, tensor) of the final norm's tensors (`decoder.final_layernorm.<tensor>`)."""
        return [(tensor.name, self._family_names(tensor))
                for _, tensor in _norm_entries(self.spec, "decoder.", "final_layernorm", "model.norm")]

    def _vocab_tensor(self, name, hf_name, primary, stored_as=None) -> TensorLayout:
        v, p, h = self.spec.vocab_size, self.padded_vocab, self.spec.hidden_size
        segments = (Segment(0, v, hf_name),) + ((Segment(v, p, None, 0),) if p > v else ())
        return TensorLayout(name, (p, h), ROWS, segments, hf_primary=primary, stored_as=stored_as)

    def layer_entries(self, layer: int) -> list[tuple[str, TensorLayout | None]]:
        """(local-spec suffix, global tensor) of one layer in Megatron-Core's state_dict order; a None tensor is
        the `_extra_state` that follows each linear's parameters (suffix `<linear>._extra_state`)."""
        if layer not in self._entries:
            self._entries[layer] = tuple((suffix, self._family_names(tensor))
                                         for suffix, tensor in self._layer_entries(layer))
        return list(self._entries[layer])

    def _layer_entries(self, layer: int) -> list[tuple[str, TensorLayout | None]]:
        """A decoder layer's entries; `layer` past the decoder's: a multi-token prediction layer's transformer
        layer, as HF numbers it (its global names renamed by mtp_entries)."""
        s = self.spec
        h = s.hidden_size
        hf = f"model.layers.{layer}."
        name = f"decoder.layers.{layer}."
        gated = activation_kind(s).gated
        family = FAMILIES[s.model_type]
        post_attention, post_mlp = family.post_norms or ("post_self_attn_layernorm", "post_mlp_layernorm")
        out: list[tuple[str, TensorLayout | None]] = [
            *_norm_entries(s, name, "input_layernorm", hf + "input_layernorm"),
            *attention_kind(s).layer_entries(s, layer),
            *(_norm_entries(s, name, "post_self_attn_layernorm", hf + post_attention) if s.post_norms else []),
            *_norm_entries(s, name, "pre_mlp_layernorm", hf + family.pre_mlp_norm),
        ]
        after = _norm_entries(s, name, "post_mlp_layernorm", hf + post_mlp) if s.post_norms else []
        if not s.is_moe_layer(layer):
            return out + _mlp_entries(name, "mlp.", s.ffn_hidden_size, h, hf + "mlp.", _GATE_UP_DOWN, gated,
                                      fused=family.fused_gate_up, bias=s.linear_bias) + after
        moe, moe_hf = s.moe, hf + family.moe_block
        experts = s.moe.num_experts
        router = moe_hf + family.router_name
        out.append(("mlp.router.weight", TensorLayout(name + "mlp.router.weight", (experts, h), REPLICATED,
                                                      (Segment(0, experts, router + "weight"),))))
        if s.linear_bias:  # Megatron's router bias under add_bias_linear (gpt-oss's)
            out.append(("mlp.router.bias", TensorLayout(name + "mlp.router.bias", (experts,), REPLICATED,
                                                        (Segment(0, experts, router + "bias"),))))
        if moe.expert_bias:  # a buffer (no _extra_state); HF: DeepSeek-V3's name for it (ERNIE's: [1, E])
            out.append(("mlp.router.expert_bias", TensorLayout(
                name + "mlp.router.expert_bias", (experts,), REPLICATED,
                (Segment(0, experts, moe_hf + family.expert_bias_name),), dtype=torch.float32, buffer=True,
                hf_leading=family.expert_bias_leading)))
        projections = family.expert_projections
        for e in range(experts):
            out += _mlp_entries(name, f"{EXPERT_PREFIX}{e}.", moe.ffn_hidden_size, h, f"{moe_hf}experts.{e}.",
                                projections, gated, expert=True, bias=s.linear_bias)
        if moe.shared_expert_hidden_size:
            out += _mlp_entries(name, "mlp.shared_experts.", moe.shared_expert_hidden_size, h,
                                moe_hf + family.shared_expert_block, _GATE_UP_DOWN, gated)
        if moe.shared_expert_gate:
            out.append(("mlp.shared_experts.gate_weight", TensorLayout(
                name + "mlp.shared_experts.gate_weight", (1, h), REPLICATED,
                (Segment(0, 1, moe_hf + "shared_expert_gate.weight"),))))
        return out + after

    def mtp_entries(self, depth: int) -> list[tuple[str, TensorLayout | None]]:
        """(suffix below `mtp.layers.<depth>.`, global tensor) of multi-token prediction layer `depth`, in
        Megatron-Core's state_dict order: enorm, hnorm, eh_proj ([h, 2h], its input the normed embedding then the
        normed hidden state, split by rows as a column-parallel linear), transformer_layer.<a decoder layer's
        entries>, final_layernorm. HF holds it as decoder layer num_layers + depth (DeepSeek-V3's release), the
        last norm as `shared_head.norm`."""
        key = ("mtp", depth)
        if key not in self._entries:
            self._entries[key] = tuple(self._mtp_entries(depth))
        return list(self._entries[key])

    def _mtp_entries(self, depth: int) -> list[tuple[str, TensorLayout | None]]:
        s, layer = self.spec, self.spec.num_layers + depth
        h, hf, name = s.hidden_size, f"model.layers.{layer}.", f"mtp.layers.{depth}."
        out = [*_norm_entries(s, name, "enorm", hf + "enorm"), *_norm_entries(s, name, "hnorm", hf + "hnorm"),
               ("eh_proj.weight", TensorLayout(name + "eh_proj.weight", (h, 2 * h), ROWS,
                                               (Segment(0, h, hf + "eh_proj.weight"),))),
               ("eh_proj._extra_state", None)]
        decoder, inner = f"decoder.layers.{layer}.", f"{name}transformer_layer."
        for suffix, tensor in self.layer_entries(layer):
            out.append(("transformer_layer." + suffix,
                        None if tensor is None else replace(tensor, name=inner + tensor.name[len(decoder):])))
        return out + _norm_entries(s, name, "final_layernorm", hf + "shared_head.norm")

    def layer_tensors(self, layer: int) -> list[TensorLayout]:
        return [tensor for _, tensor in self.layer_entries(layer) if tensor is not None]

    def layer_linears(self, layer: int) -> list[str]:
        """The linears of one layer (local-spec module paths), each of which has an `_extra_state`."""
        return [suffix[: -len("._extra_state")] for suffix, tensor in self.layer_entries(layer) if tensor is None]

    @cached_property
    def global_tensors(self) -> list[TensorLayout]:
        """Every distinct global tensor once (the output layer only when it is not tied)."""
        tensors = [self.embedding(), *(tensor for _, tensor in self.embedding_norms()),
                   *filter(None, [self.position_embedding()])]
        for layer in range(self.spec.num_layers):
            tensors += self.layer_tensors(layer)
        tensors += [tensor for _, tensor in self.final_norms()]
        for depth in range(self.spec.mtp_num_layers):
            tensors += [tensor for _, tensor in self.mtp_entries(depth) if tensor is not None]
        if not self.spec.tie_word_embeddings:
            tensors.append(self.output_layer())
        return tensors

    def _layer_parts(self, layer: int) -> tuple[list, list[list], list]:
        """layer_entries(layer) split for selecting an EP rank's experts quickly (an expert-parallel conversion
        walks every layer for each of its shards): the entries before the routed experts, each routed expert's
        (suffixes below `<EXPERT_PREFIX><e>.`), and the entries after them."""
        key = ("parts", layer)
        if key not in self._entries:
            before, experts, after = [], {}, []
            for suffix, tensor in self.layer_entries(layer):
                if suffix.startswith(EXPERT_PREFIX):
                    expert, rest = suffix[len(EXPERT_PREFIX):].split(".", 1)
                    experts.setdefault(int(expert), []).append((rest, tensor))
                else:
                    (after if experts else before).append((suffix, tensor))
            self._entries[key] = (before, [experts[e] for e in sorted(experts)], after)
        return self._entries[key]

    def local_expert_suffix(self, suffix: str, ep_rank: int) -> str | None:
        """A layer entry's suffix as EP rank `ep_rank` names it: a routed expert's with its local index, None for
        another rank's expert; other suffixes unchanged."""
        if not suffix.startswith(EXPERT_PREFIX):
            return suffix
        expert, rest = suffix[len(EXPERT_PREFIX):].split(".", 1)
        local = int(expert) - ep_rank * self.experts_per_rank
        return f"{EXPERT_PREFIX}{local}.{rest}" if 0 <= local < self.experts_per_rank else None

    def shard_entries(self, pp_rank: int, chunk: int = 0, ep_rank: int = 0) -> list[tuple[str, TensorLayout | None]]:
        """(local name, global tensor) in the order of the model's state_dict; None marks an `_extra_state`.
        `ep_rank`: whose routed experts (all of them when ep is 1)."""
        entries: list[tuple[str, TensorLayout | None]] = []
        first, last = self.is_first(pp_rank, chunk), self.is_last(pp_rank, chunk)
        if first or (last and self.spec.mtp_num_layers):  # multi-token prediction embeds on the last stage too
            entries.append(("embedding.word_embeddings.weight", self.embedding()))
        if first:
            entries += self.embedding_norms()
        if first and self.position_embedding() is not None:
            entries.append((POSITION_EMBEDDING, self.position_embedding()))
        for local, layer in enumerate(self.chunk_layers(pp_rank, chunk)):
            name = f"decoder.layers.{local}."
            before, experts, after = self._layer_parts(layer)
            entries += [(name + suffix, tensor) for suffix, tensor in before]
            mine = ep_rank * self.experts_per_rank  # this EP rank's first routed expert
            for index, expert in enumerate(experts[mine: mine + self.experts_per_rank]):
                entries += [(f"{name}{EXPERT_PREFIX}{index}.{rest}", tensor) for rest, tensor in expert]
            entries += [(name + suffix, tensor) for suffix, tensor in after]
        if last:
            entries += self.final_norms()
            for depth in range(self.spec.mtp_num_layers):
                for suffix, tensor in self.mtp_entries(depth):
                    inner = suffix.removeprefix("transformer_layer.")
                    mine = self.local_expert_suffix(inner, ep_rank)
                    if mine is not None:
                        entries.append((f"mtp.layers.{depth}.{suffix[:len(suffix) - len(inner)]}{mine}", tensor))
            if not (self.spec.tie_word_embeddings and first):
                entries.append((OUTPUT_LAYER, self.output_layer()))
            entries.append(("output_layer._extra_state", None))
        return entries

    # ---- LoRA adapters ---------------------------------------------------------------------------------------------

    def lora_tensors(self, layer: int, rank: int, targets) -> list[TensorLayout]:
        """lora_A and lora_B of each targeted linear of `layer` (names `<linear>.lora_A.weight`), in state_dict
        order. Column-parallel linears (qkv, fc1): A [r, in] replicated, B [out, r] split like the weight's rows.
        Row-parallel linears (proj, fc2): A [r, in] split like the weight's columns, B [out, r] replicated."""
        unknown = set(targets) - set(LORA_TARGETS)
        if unknown:
            raise QlmError(f"unknown LoRA target modules {sorted(unknown)}", f"choose from {', '.join(LORA_TARGETS)}")
        weights = {t.name: t for t in self.layer_tensors(layer)}
        out = []
        for target in LORA_TARGETS:
            linear = self.lora_linear(layer, target)
            if target in targets and linear is not None:
                out += _lora_pair(weights[f"decoder.layers.{layer}.{linear}.weight"], rank)
        return out

    def lora_linear(self, layer: int, target: str) -> str | None:
        """The linear (module path in the layer) a LoRA target adapts in `layer`: in an MoE layer the MLP targets
        adapt the shared expert's linears, and nothing when it has none."""
        linear = LORA_TARGETS[target]
        if linear.startswith("self_attention.") and linear not in self._attention_linears(layer):
            return None  # not one of this attention kind's linears (or not with these sizes: q_proj / q's low rank)
        if self.spec.is_moe_layer(layer) and linear in SHARED_EXPERT_LINEARS:
            return SHARED_EXPERT_LINEARS[linear] if self.spec.moe.shared_expert_hidden_size else None
        return linear

    def _attention_linears(self, layer: int) -> set[str]:
        return {linear for linear in self.layer_linears(layer) if linear.startswith("self_attention.")}

    def lora_shard_entries(self, pp_rank: int, chunk: int, rank: int, targets) -> list[tuple[str, TensorLayout]]:
        """(local name, global tensor) of the adapters of one chunk, in the order of its state_dict."""
        entries = []
        for local, layer in enumerate(self.chunk_layers(pp_rank, chunk)):
            for tensor in self.lora_tensors(layer, rank, targets):
                suffix = tensor.name.split(f"decoder.layers.{layer}.", 1)[1]
                entries.append((f"decoder.layers.{local}.{suffix}", tensor))
        return entries

    def stored_tensors(self, pp_rank: int, chunk: int, lora=None, ep_rank: int = 0) -> list[tuple[str, TensorLayout]]:
        """(local name, global tensor) of every tensor a chunk's checkpoint entry holds: its weights (no
        `_extra_state`) and, when `lora` (anything with .rank and .target_modules) has rank > 0, its adapters."""
        entries = [(name, tensor) for name, tensor in self.shard_entries(pp_rank, chunk, ep_rank)
                   if tensor is not None]
        if lora is not None and lora.rank > 0:
            entries += self.lora_shard_entries(pp_rank, chunk, lora.rank, lora.target_modules)
        return entries

    # ---- HF view ---------------------------------------------------------------------------------------------------

    @cached_property
    def hf_tensors(self) -> dict[str, list[tuple[TensorLayout, Segment]]]:
        """HF name -> the (global tensor, segment) pieces it is made of, in HF order."""
        pieces = hf_pieces(t for t in self.global_tensors if t.hf_primary)
        for copy, original in hf_copies(self.spec).items():
            pieces[copy] = pieces[original]
        return pieces

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        return pieces_shape(self.hf_tensors[hf_name])


def hf_copies(spec: ModelSpec) -> dict[str, str]:
    """HF tensors written as copies of others (and never read; optional in a source): each multi-token prediction
    layer's `embed_tokens` and `shared_head.head`, the shared embedding and output layer, as DeepSeek-V3's release
    holds them."""
    head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    out = {}
    for layer in range(spec.num_layers, spec.num_layers + spec.mtp_num_layers):
        out[f"model.layers.{layer}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"model.layers.{layer}.shared_head.head.weight"] = head
    return out


def hf_pieces(tensors) -> dict[str, list[tuple[TensorLayout, Segment]]]:
    """HF name -> the (global tensor, segment) pieces of `tensors` it is made of, in HF order."""
    pieces: dict[str, list[tuple[TensorLayout, Segment]]] = {}
    for tensor in tensors:
        for seg in tensor.segments:
            if seg.hf_name is not None:
                pieces.setdefault(seg.hf_name, []).append((tensor, seg))
    for parts in pieces.values():
        parts.sort(key=lambda p: p[1].hf_start)
    return pieces


def pieces_shape(parts: list[tuple[TensorLayout, Segment]]) -> tuple[int, ...]:
    tensor = parts[0][0]
    shape = list(tensor.shape)
    shape[tensor.axis] = sum(seg.stop - seg.start for _, seg in parts)
    return (*tensor.hf_leading, *shape)


_GATE_UP_DOWN = GATE_UP_DOWN


def _norm_entries(spec: ModelSpec, name: str, module: str, hf_module: str) -> list[tuple[str, TensorLayout]]:
    """A norm over hidden_size (module `module` of `name`): each of the norm kind's tensors, replicated."""
    h = spec.hidden_size
    return [(f"{module}.{tensor}", TensorLayout(f"{name}{module}.{tensor}", (h,), REPLICATED,
                                                (Segment(0, h, f"{hf_module}.{tensor}"),)))
            for tensor in norm_kind(spec).tensors]


def _mlp_entries(name: str, module: str, ffn: int, h: int, hf: str, projections: tuple[str, str, str],
                 gated: bool, expert: bool = False, fused: bool = False, bias: bool = False):
    """An MLP's entries (module `module` of layer `name`): a gated one's linear_fc1 = [gate; up] (FC1), a plain
    one's = up (split by rows); linear_fc2 = down. `fused`: HF holds [gate; up] as one `gate_up_proj` (GLM).
    `bias` (OPT's MLP, gpt-oss's experts): fc1's bias split like its rows, fc2's whole on every rank."""
    gate, up, down = (f"{hf}{proj}.weight" for proj in projections)
    fc1, fc2 = f"{module}linear_fc1", f"{module}linear_fc2"
    gate_up = (Segment(0, ffn, f"{hf}gate_up_proj.weight"), Segment(ffn, 2 * ffn, f"{hf}gate_up_proj.weight", ffn)) \
        if fused else (Segment(0, ffn, gate), Segment(ffn, 2 * ffn, up))
    fc1_tensor = (TensorLayout(name + fc1 + ".weight", (2 * ffn, h), FC1, gate_up, expert=expert) if gated
                  else TensorLayout(name + fc1 + ".weight", (ffn, h), ROWS, (Segment(0, ffn, up),), expert=expert))
    if bias and fused:
        raise QlmError("biases on a fused gate_up_proj", "qlm's fused dense MLPs (GLM's) have no biases")
    gate_bias, up_bias, down_bias = (weight[: -len("weight")] + "bias" for weight in (gate, up, down))
    fc1_bias = [(fc1 + ".bias", TensorLayout(name + fc1 + ".bias", (2 * ffn,), FC1, (
        Segment(0, ffn, gate_bias), Segment(ffn, 2 * ffn, up_bias)), expert=expert) if gated else TensorLayout(
        name + fc1 + ".bias", (ffn,), ROWS, (Segment(0, ffn, up_bias),), expert=expert))] if bias else []
    fc2_bias = [(fc2 + ".bias", TensorLayout(name + fc2 + ".bias", (h,), REPLICATED, (Segment(0, h, down_bias),),
                                              expert=expert))] if bias else []
    return [
        (fc1 + ".weight", fc1_tensor),
        *fc1_bias,
        (fc1 + "._extra_state", None),
        (fc2 + ".weight", TensorLayout(name + fc2 + ".weight", (h, ffn), COLS, (Segment(0, ffn, down),),
                                        expert=expert)),
        *fc2_bias,
        (fc2 + "._extra_state", None),
    ]


def _lora_pair(weight: TensorLayout, rank: int) -> tuple[TensorLayout, TensorLayout]:
    """A and B of the adapter of `weight`. HF names follow PEFT: `...q_proj.weight` -> `...q_proj.lora_A.weight`.
    The replicated factor of a fused weight is the same tensor for each HF projection it holds (q, k and v share
    linear_qkv's A): its segments all cover [0, extent) and point at each projection's copy."""
    prefix = weight.name[: -len("weight")]
    out_features, in_features = weight.shape

    def renamed(factor):
        return tuple(replace(s, hf_name=s.hf_name[: -len("weight")] + f"lora_{factor}.weight") for s in weight.segments)

    def copies(factor, extent):
        names = dict.fromkeys(s.hf_name[: -len("weight")] + f"lora_{factor}.weight" for s in weight.segments)
        return tuple(Segment(0, extent, name) for name in names)

    if weight.split == COLS:
        a = TensorLayout(prefix + "lora_A.weight", (rank, in_features), COLS, renamed("A"))
        b = TensorLayout(prefix + "lora_B.weight", (out_features, rank), REPLICATED, copies("B", out_features))
    else:
        a = TensorLayout(prefix + "lora_A.weight", (rank, in_features), REPLICATED, copies("A", rank))
        b = TensorLayout(prefix + "lora_B.weight", (out_features, rank), weight.split, renamed("B"))
    return a, b


def _range_shape(tensor: TensorLayout, length: int) -> list[int]:
    shape = list(tensor.shape)
    shape[tensor.axis] = length
    return shape


def _read_padded_into(source: TensorSource, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor):
    """Entries [start, stop) of `tensor` along its axis into `out`; zeros where they are vocabulary padding."""
    real = min(stop, tensor.real_extent)
    if start < real:
        source.read_into(tensor, start, real, out.narrow(tensor.axis, 0, real - start))
    if stop > max(start, real):
        out.narrow(tensor.axis, max(start, real) - start, stop - max(start, real)).zero_()


def held_dtype(tensor: TensorLayout, source: TensorSource, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype `tensor` is read and written in: its own fixed one, else `dtype`, else the source's."""
    return tensor.dtype or dtype or source.stored_dtype(tensor)


def read_range(source: TensorSource, tensor: TensorLayout, start: int, stop: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Entries [start, stop) of `tensor` along its axis (zeros past the real vocabulary)."""
    out = torch.empty(_range_shape(tensor, stop - start), dtype=held_dtype(tensor, source, dtype))
    _read_padded_into(source, tensor, start, stop, out)
    return out


def read_shard_tensor(tensor: TensorLayout, tp: int, rank: int, source: TensorSource,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """TP rank `rank`'s shard of `tensor`: its ranges read straight into one buffer, zeros where they are
    vocabulary padding."""
    out = torch.empty(tensor.shard_shape(tp), dtype=held_dtype(tensor, source, dtype))
    read_shard_into(tensor, tp, rank, source, out)
    return out


def read_from_parts(tensor: TensorLayout, split: int, part: Callable[[int], torch.Tensor], start: int, stop: int,
                    out: torch.Tensor) -> None:
    """Global entries [start, stop) of `tensor` along its axis into `out`, put together from its `split` TP parts
    (`part(rank)`: TP rank `rank`'s shard, asked for only when it holds some of the range; a replicated tensor's
    from part 0): the inverse of read_shard_into, for every reader of TP-split tensors."""
    axis = tensor.axis
    for rank in range(1 if tensor.split == REPLICATED else split):
        offset = 0
        for a, b in tensor.tp_ranges(split, rank):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                out.narrow(axis, lo - start, hi - lo).copy_(part(rank).narrow(axis, offset + lo - a, hi - lo))
            offset += b - a


def read_shard_into(tensor: TensorLayout, tp: int, rank: int, source: TensorSource, out: torch.Tensor) -> None:
    """read_shard_tensor into an existing buffer of the shard's shape."""
    offset = 0
    for start, stop in tensor.tp_ranges(tp, rank):
        _read_padded_into(source, tensor, start, stop, out.narrow(tensor.axis, offset, stop - start))
        offset += stop - start


def build_shard(layout: ModelLayout, tp_rank: int, pp_rank: int, chunk: int, source: TensorSource,
                dtype: torch.dtype | None = None, ep_rank: int = 0,
                etp_rank: int | None = None) -> dict[str, torch.Tensor | None]:
    """One shard's state_dict (= a Megatron legacy `model`/`modelN` entry = qlm's model state_dict). `ep_rank`,
    `etp_rank` (default tp_rank): which routed experts, and which expert-TP part of them."""
    etp_rank = tp_rank if etp_rank is None else etp_rank
    return {
        name: None if tensor is None else read_shard_tensor(
            tensor, layout.split_size(tensor), etp_rank if tensor.expert else tp_rank, source, dtype)
        for name, tensor in layout.shard_entries(pp_rank, chunk, ep_rank)
    }


@torch.no_grad()
def fill_shard(layout: ModelLayout, tp_rank: int, pp_rank: int, chunk: int, source: TensorSource,
               state: dict[str, torch.Tensor | None], ep_rank: int = 0, etp_rank: int | None = None) -> None:
    """build_shard into a shard's existing tensors (`state`: a model's state_dict(keep_vars=True)), in place."""
    etp_rank = tp_rank if etp_rank is None else etp_rank
    for name, tensor in layout.shard_entries(pp_rank, chunk, ep_rank):
        if tensor is not None:
            read_shard_into(tensor, layout.split_size(tensor), etp_rank if tensor.expert else tp_rank, source,
                            state[name])


def assemble_hf_tensor(layout: ModelLayout, hf_name: str, source: TensorSource,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """One full HF tensor, in `dtype` (default: the dtype the source stores)."""
    return assemble_pieces(layout.hf_tensors[hf_name], source, dtype)


def assemble_pieces(parts: list[tuple[TensorLayout, Segment]], source: TensorSource,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The HF tensor made of `parts` (one entry of hf_pieces), read from `source`."""
    out = torch.empty(pieces_shape(parts), dtype=held_dtype(parts[0][0], source, dtype))
    held = out.view(out.shape[len(parts[0][0].hf_leading):])  # without HF's leading axes of 1
    offset = 0
    for tensor, seg in parts:
        source.read_into(tensor, seg.start, seg.stop, held.narrow(tensor.axis, offset, seg.stop - seg.start))
        offset += seg.stop - seg.start
    return out


class HFTensorSource:
    """Global Megatron tensors read from HF tensors through the segments of the layout. `hf` offers
    dtype(name) and read_into(name, axis, start, stop, out)."""

    def __init__(self, hf):
        self.hf = hf

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return self.hf.dtype(next(s.hf_name for s in tensor.segments if s.hf_name is not None))

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor):
        for seg in tensor.segments:
            lo, hi = max(start, seg.start), min(stop, seg.stop)
            if lo < hi:
                if seg.hf_name is None:
                    raise AssertionError("vocabulary padding is never read")
                shift = seg.hf_start - seg.start
                into = out.narrow(tensor.axis, lo - start, hi - lo)
                if tensor.hf_leading:  # HF's tensor has leading axes of 1 (ERNIE's [1, E] router bias)
                    if (lo, hi) != (0, tensor.shape[tensor.axis]):
                        raise AssertionError("a tensor with leading HF axes is read whole")
                    self.hf.read_into(seg.hf_name, 0, 0, 1, into.view(*tensor.hf_leading, *into.shape))
                    continue
                self.hf.read_into(seg.hf_name, tensor.axis, lo + shift, hi + shift, into)


# TEGroupedMLP keeps expert e's weights (and, with add_bias_linear, biases) as `mlp.experts.linear_fc1.weight<e>`
# (SequentialMLP: local_experts.<e>.)
_TE_GROUPED_EXPERT = re.compile(r"(.*\bmlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)")


def normalize_megatron_name(local_name: str) -> str | None:
    """Map a Megatron state_dict key to the local-spec name qlm uses; None for entries that carry no weights."""
    if local_name.endswith("_extra_state"):
        return None
    grouped = _TE_GROUPED_EXPERT.fullmatch(local_name)
    if grouped is not None:
        return f"{grouped.group(1)}local_experts.{grouped.group(4)}.{grouped.group(2)}.{grouped.group(3)}"
    if re.search(r"\bmlp\.experts\.weight[12]$", local_name):
        raise QlmError(f"checkpoint tensor {local_name} is a legacy GroupedMLP weight (--moe-grouped-gemm with the "
                       "grouped_gemm package)", "re-save the model with SequentialMLP or TEGroupedMLP experts")
    for te, local in {**TE_NORM_NAMES, **MLA_TE_NORM_NAMES}.items():
        if local_name.endswith(te):
            return local_name[: -len(te)] + local
    return local_name


def without_absent_mtp(spec: ModelSpec, holds: Callable[[str], bool]) -> tuple[ModelSpec, str | None]:
    """`spec` less the multi-token prediction layers its config counts but the weights (`holds(hf_name)`) lack, as
    transformers saves DeepSeek-V3-class models; with the note that says so (None when nothing changed)."""
    if not spec.mtp_num_layers or holds(f"model.layers.{spec.num_layers}.eh_proj.weight"):
        return spec, None
    return spec.replace(mtp_num_layers=0), (
        f"config.json counts {spec.mtp_num_layers} multi-token prediction layer(s) but the weights hold none (as "
        "transformers saves the model): read without them")


# convert's uneven-split flags as a recipe names them (qlm profile has only the recipe's keys for them)
UNEVEN_SPLIT_KEYS = {_FIRST_FLAG: "parallel.num_layers_in_first_pipeline_stage",
                     _LAST_FLAG: "parallel.num_layers_in_last_pipeline_stage"}
# convert's and profile's flags, as a recipe names them
_RECIPE_KEYS = {**UNEVEN_SPLIT_KEYS, "--tp": "parallel.tp", "--pp": "parallel.pp", "--vpp": "parallel.vpp",
                "--ep": "parallel.ep", "--etp": "parallel.etp"}


def recipe_layout(spec: ModelSpec, parallel) -> ModelLayout:
    """The layout of a recipe's [parallel] (a ParallelConfig); its errors name the recipe's keys."""
    try:
        return ModelLayout(spec, parallel.tp, parallel.pp, parallel.vpp, parallel.num_layers_in_first_pipeline_stage,
                           parallel.num_layers_in_last_pipeline_stage, ep=getattr(parallel, "ep", 1),
                           etp=getattr(parallel, "etp", None))
    except QlmError as exc:
        raise exc.renamed(_RECIPE_KEYS) from None
