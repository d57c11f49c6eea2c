"""The preference objective of one training step, for the Engine (train/engine.py).

A micro-batch of P pairs is 2P rows: the chosen sequences of its pairs, then their rejected ones in the same order
(data/preference.py), so a pair never crosses a rank or a micro-batch. Per micro-batch, on the last pipeline stage:

    row log-prob     minus the loss head's per-token losses summed over the row's response tokens; under context
                     parallelism each rank holds part of every row, and the parts are summed over the CP group with an
                     identity backward (every CP rank computes the same loss, and each rank's gradient is the
                     loss's gradient with respect to its own part: summed over the ranks, the exact gradient)
    loss             Σ_pairs term / pairs of the global batch  (+ weight · NLL(chosen) over the global batch's chosen
                     tokens), preference_loss.py's terms; the sum over micro-batches and data-parallel ranks is the
                     global batch's loss, as for the language-model loss
    reported loss    the same divided by the CP size (each CP rank holds the whole loss; the engine sums over ranks)

Reference log-probs come per row from the caller (a reference forward of the same micro-batch, or the precomputed
table) before the policy's forward. The pipeline schedule hands the loss function each micro-batch's labels as a
view of the step's labels tensor: the view's row offset says which micro-batch it is.
"""

from __future__ import annotations

import torch

from qlm_core.config import ReferenceModel
from qlm_core.data.preference import chosen_row_mask
from qlm_core.parallel import shape_inference
from qlm_core.parallel.comm import all_reduce, group_size
from qlm_core.parallel.state import Grid
from qlm_core.parallel.tensor import reduce_from_tp
from qlm_core.train.objectives.microbatch import microbatch_index
from qlm_core.train.objectives.preference_loss import PreferenceLossConfig, pair_metric_sums, pair_terms
from qlm_core.train.validate import validate_preference_model

METRIC_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")
ORPO_KEYS = ("log_odds_ratio", "log_odds_chosen")


def validate_preference_engine(spec, preference: PreferenceLossConfig | None, reference: ReferenceModel | None,
                               lora, micro_rows: int) -> None:
    """The Engine's preference arguments (built by workers and tests without a recipe too)."""
    if preference is None:
        if reference is not None:
            raise ValueError("a reference model without a preference loss")
        return
    preference.check()
    validate_preference_model(spec)
    if micro_rows % 2:
        raise ValueError(f"a preference micro-batch holds pairs: {micro_rows} rows is odd")
    if preference.needs_reference and reference is None:
        raise ValueError(f"preference loss {preference.loss_type} needs a reference")
    if not preference.needs_reference and reference is not None:
        raise ValueError(f"preference loss {preference.loss_type} is reference-free, yet a reference was given")
    if reference == "adapters_off" and (lora is None or lora.rank == 0):
        raise ValueError("reference adapters_off needs LoRA")


def row_logps(token_loss: torch.Tensor, labels: torch.Tensor, cp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's labelled tokens [rows] fp32, their count [rows]) over the whole row: this
    rank's part summed over the CP group (forward sum, identity backward)."""
    logps = reduce_from_tp(-token_loss.float().sum(-1), cp_group)
    counts = (labels >= 0).sum(-1).to(logps.dtype)
    return logps, all_reduce(counts, cp_group) if group_size(cp_group) > 1 else counts


class PreferenceStep:
    """The preference loss and metrics over the micro-batches of one step (or one evaluation batch)."""

    def __init__(self, config: PreferenceLossConfig, grid: Grid, micro_rows: int, global_rows: int):
        self.config, self.grid = config, grid
        self.micro_rows, self.global_pairs = micro_rows, global_rows // 2
        self.keys = METRIC_KEYS + (ORPO_KEYS if config.loss_type == "orpo" else ())
        self.nll = config.loss_type == "orpo" or (config.loss_type == "simpo" and config.cpo_alpha > 0) or (
            config.needs_reference and config.rpo_alpha is not None)

    def start(self, labels: torch.Tensor) -> None:
        """This rank's step labels [rows, s_local] (the tensor the micro-batches are views of); the caller then sets
        `reference`, the reference log-probs of its rows [rows] (the DPO family), before the first loss()."""
        self.labels, self.reference = labels, None
        chosen = (labels[chosen_row_mask(labels.shape[0], self.micro_rows // 2).to(labels.device)] >= 0).sum()
        tokens = chosen.to(torch.float32)
        all_reduce(tokens, self.grid.dp_cp_group)  # CP ranks hold parts of the same rows: the sum is the whole
        self.chosen_tokens = max(tokens.item(), 1.0)
        self.sums = torch.zeros(len(self.keys) + 1, device=labels.device, dtype=torch.float64)  # + the NLL sum

    def microbatch_of(self, labels: torch.Tensor) -> int:
        """Which micro-batch `labels` (a view of the step's labels) is."""
        return microbatch_index(self.labels, labels, self.micro_rows)

    def rows(self, index: int) -> slice:
        return slice(index * self.micro_rows, (index + 1) * self.micro_rows)

    def loss(self, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the step loss from the loss head's per-token losses [2P, s_local]."""
        if shape_inference.active():  # the pipeline's placeholder forward: a loss of the right graph, nothing kept
            return token_loss.sum() * 0.0
        index = self.microbatch_of(labels)
        logps, counts = row_logps(token_loss, labels, self.grid.cp_group)
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = counts.chunk(2)
        ref = (None, None)
        if self.config.needs_reference:
            if self.reference is None:
                raise ValueError(f"preference loss {self.config.loss_type} needs reference log-probs")
            ref = self.reference[self.rows(index)].to(logps.device, logps.dtype).chunk(2)
        terms = pair_terms(self.config, chosen, rejected, chosen_tokens, rejected_tokens, *ref)
        loss = terms.losses.sum() / self.global_pairs
        nll_sum = -chosen.detach().sum()
        if terms.nll_weight is not None:
            loss = loss + terms.nll_weight * (-chosen.sum()) / self.chosen_tokens
        sums = pair_metric_sums(terms)
        self.sums += torch.stack([sums[key].double() for key in self.keys] + [nll_sum.double()])
        return loss

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch loss as the engine sums it over ranks (see the module doc)."""
        return loss.detach().float() / group_size(self.grid.cp_group)

    def figures(self) -> dict[str, float]:
        """The step's metrics over the global batch (TRL's names); every rank calls it (collectives)."""
        sums = self.sums.clone()
        all_reduce(sums, self.grid.dp_cp_group)
        sums /= group_size(self.grid.cp_group)  # every CP rank holds the same sums (as TP ranks do)
        if group_size(self.grid.pp_group) > 1:  # only the last stage computed them
            all_reduce(sums, self.grid.pp_group)
        out = {key: (sums[i] / self.global_pairs).item() for i, key in enumerate(self.keys)}
        if self.nll:
            out["nll_loss"] = sums[-1].item() / self.chosen_tokens
        return out


@torch.no_grad()
def reference_row_logps(token_loss: torch.Tensor, labels: torch.Tensor, cp_group) -> torch.Tensor:
    """A reference forward's summed response log-probs per row [rows] (whole rows under CP)."""
    return row_logps(token_loss, labels, cp_group)[0]
