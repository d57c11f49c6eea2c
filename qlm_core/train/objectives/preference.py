"""Preference pairs, the DPO family (preference_loss.py's terms over preference_step.py's micro-batches), with the
reference the loss needs: "frozen" (a frozen copy of the starting weights, sharded as the policy's TP/PP shards, with
a pipeline schedule of its own), "adapters_off" (the policy with its LoRA adapters switched off) or "precomputed"
(Batch.reference_logps, from reference_table.py, which reference_logps() fills before the first step). Micro- and
global batch sizes count rows, two per pair."""

from __future__ import annotations

import torch

from qlm_core.config import ReferenceModel
from qlm_core.parallel import shape_inference
from qlm_core.train.lora import adapters_disabled
from qlm_core.train.objectives.frozen import frozen_chunks
from qlm_core.train.objectives.preference_loss import PreferenceLossConfig
from qlm_core.train.objectives.preference_step import (
    PreferenceStep,
    reference_row_logps,
    validate_preference_engine,
)


class PreferenceObjective:
    def __init__(self, config: PreferenceLossConfig, reference: ReferenceModel | None):
        self.config, self.reference = config, reference
        self.reference_chunks = None
        self.reference_runner = None
        self._recording = False  # reference_logps(): the policy's forward records its rows' log-probs

    def bind(self, engine, weights) -> None:
        validate_preference_engine(engine.spec, self.config, self.reference, engine.lora, engine.micro_batch_size)
        self.engine = engine
        self.step = PreferenceStep(self.config, engine.grid, engine.micro_batch_size, engine.global_batch_size)
        if self.reference == "frozen":
            self.reference_chunks = frozen_chunks(engine, weights)
        if self.reference in ("frozen", "adapters_off"):
            # the reference forward has a schedule of its own: torch's schedule re-infers its shapes (one more
            # forward) each time it switches between evaluation and training
            chunks = self.reference_chunks if self.reference == "frozen" else engine.chunks
            self.reference_runner = engine.make_runner(chunks, self._reference_loss_fn(chunks))

    # ---- one step ----------------------------------------------------------------------------------------------

    def start(self, batch, inputs, labels: torch.Tensor, tokens: float) -> None:
        self.step.start(labels)
        self.step.reference = self._reference_logps(batch, inputs, labels)

    def loss(self, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._recording:
            return self._record(token_loss, labels)
        return self.step.loss(token_loss, labels)

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        return self.step.reported(loss)

    def figures(self) -> dict[str, float]:
        """TRL's rewards/... and logps/... metrics of the last forward (every rank calls it: collectives)."""
        return self.step.figures()

    # ---- the reference -----------------------------------------------------------------------------------------

    def _record(self, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Record a micro-batch's reference log-probs per row (in self._reference_rows)."""
        with torch.no_grad():
            logps = reference_row_logps(token_loss, labels, self.engine.grid.cp_group)
            if not shape_inference.active():  # not the pipeline's placeholder forward
                self._reference_rows[self.step.rows(self.step.microbatch_of(labels))] = logps
        return logps.sum()

    def _reference_loss_fn(self, chunks):
        def record(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self._record(chunks[-1].loss(hidden, labels), labels)
        return record

    @torch.no_grad()
    def _reference_logps(self, batch, inputs, labels) -> torch.Tensor | None:
        """The reference log-probs of this rank's rows [rows] (on the last stage; None for reference-free losses)."""
        if not self.config.needs_reference:
            return None
        engine = self.engine
        if self.reference == "precomputed":
            if batch.reference_logps is None:
                raise ValueError("the engine's reference is precomputed, but the batch has no reference_logps")
            return batch.reference_logps.to(engine.grid.device)
        self._reference_rows = torch.zeros(labels.shape[0], device=engine.grid.device)
        if self.reference == "frozen":
            engine.forward_backward_chunks(self.reference_chunks, self.reference_runner,
                                           self._reference_loss_fn(self.reference_chunks), inputs, labels,
                                           backward=False)
        else:  # the policy with its adapters switched off
            with adapters_disabled(engine.chunks):
                engine.forward_backward_chunks(engine.chunks, self.reference_runner,
                                               self._reference_loss_fn(engine.chunks), inputs, labels,
                                               backward=False)
        return self._reference_rows

    @torch.no_grad()
    def reference_logps(self, batch) -> torch.Tensor:
        """The reference log-probs of this rank's rows of a preference batch [rows], forward only (for
        precompute_reference: the starting weights, before any step); valid on the last pipeline stage."""
        engine = self.engine
        engine.optimizer.wait_param_gather()
        inputs, labels = engine.local_inputs(batch)
        self.step.start(labels)
        self._reference_rows = torch.zeros(labels.shape[0], device=engine.grid.device)
        self._recording = True
        try:
            engine.forward_backward_chunks(engine.chunks, engine.runner, engine.loss_fn, inputs, labels,
                                           backward=False)
        finally:
            self._recording = False
        return self._reference_rows
