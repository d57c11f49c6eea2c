"""Multi-token prediction as DeepSeek-V3's release runs it (vLLM's and SGLang's DeepSeek MTP), built from transformers'
own decoder layer: depth k joins enorm(embed(token i + k)) and hnorm(the previous depth's output, depth 1 the decoder's
final norm's), folds them with eh_proj, runs checkpoint layer num_layers + k - 1 as transformers builds a decoder
layer, normalises with shared_head.norm and projects with the output layer. The reference the MTP tests hold qlm's
and megatron-core's multi-token prediction to."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from conftest import load_safetensors_dir


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _shifted(ids: torch.Tensor, k: int) -> torch.Tensor:
    return torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], dim=1)


@torch.no_grad()
def mtp_logits(path: Path, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's logits [b, s, vocab] for `ids` [b, s] (position i of depth k predicts token i + k + 1; the last
    k positions embed token 0 and predict nothing)."""
    config = json.loads((Path(path) / "config.json").read_text())
    layers, depths, eps = config["num_hidden_layers"], config["num_nextn_predict_layers"], config["rms_norm_eps"]
    weights = load_safetensors_dir(path)
    main = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    longer = {"num_hidden_layers": layers + depths}
    if config.get("mlp_layer_types"):  # GLM-4.7-Flash lists each layer's kind: the extra ones are the last's
        longer["mlp_layer_types"] = config["mlp_layer_types"] + config["mlp_layer_types"][-1:] * depths
    hidden = main.model(ids).last_hidden_state
    out = []
    for k in range(1, depths + 1):
        # a fresh model each depth: its decoder is cut down to that depth's layer below
        full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **longer).eval()
        at = f"model.layers.{layers + k - 1}."
        embedded = weights["model.embed_tokens.weight"][_shifted(ids, k)]
        joined = torch.cat([_rms(embedded, weights[at + "enorm.weight"], eps),
                            _rms(hidden, weights[at + "hnorm.weight"], eps)], dim=-1) @ weights[at + "eh_proj.weight"].T
        single = full.model
        single.layers = torch.nn.ModuleList([full.model.layers[layers + k - 1]])
        single.config.num_hidden_layers = 1
        single.norm.weight.copy_(weights[at + "shared_head.norm.weight"])
        hidden = single(inputs_embeds=joined, use_cache=False).last_hidden_state
        out.append(full.lm_head(hidden))
    return out


def mtp_token_losses(path: Path, ids: torch.Tensor, labels: torch.Tensor,
                     padded_vocab: int | None = None) -> list[torch.Tensor]:
    """Each depth's per-token loss [b, s] for input `ids` and next-token `labels` [b, s]: position i of depth k
    predicts labels[i + k]; zero where i + k is past the row. `padded_vocab`: the softmax also over Megatron's
    padding rows (zero logits), as megatron-core's loss takes it."""
    out = []
    for k, logits in enumerate(mtp_logits(path, ids), start=1):
        logits = F.pad(logits, (0, (padded_vocab or logits.shape[-1]) - logits.shape[-1]))
        target = torch.cat([labels[:, k:], torch.full_like(labels[:, :k], -100)], dim=1)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none", ignore_index=-100)
        out.append(loss.view(target.shape))
    return out
