"""--verify: re-read a written checkpoint, compare it with its source tensor by tensor, and compare logits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from qlm_core.models.build import RankCoords, build_rank_model
from qlm_core.models.gpt import GPTModel
from qlm_core.models.hf_experts import HFFiles
from qlm_core.models.layout import ModelLayout, TensorSource

AUTO_VERIFY_MAX_PARAMS = 2_000_000_000  # two fp32 copies of the model must fit in host memory


@dataclass
class VerifyReport:
    tensors_checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    logits_max_abs_diff: float | None = None
    logits_tolerance: float | None = None
    nan_counts: dict[str, int] = field(default_factory=dict)  # source tensors holding NaN (copied bit for bit)

    @property
    def ok(self) -> bool:
        logits_ok = self.logits_max_abs_diff is None or self.logits_max_abs_diff <= self.logits_tolerance
        return not self.mismatched and logits_ok

    def warnings(self) -> list[str]:
        """Warning lines: NaN in the source (compared bit for bit, so the check still passes)."""
        if not self.nan_counts:
            return []
        name, count = next(iter(self.nan_counts.items()))
        more = len(self.nan_counts) - 1
        return [f"the source holds NaN: {name} has {count} NaN values"
                + (f" ({more} more tensors hold NaN too)" if more else "") + "; they were copied as they are"]

    def summary(self) -> str:
        text = f"{self.tensors_checked - len(self.mismatched)}/{self.tensors_checked} tensors bit-exact"
        if self.mismatched:
            text += f" (differ: {', '.join(self.mismatched[:3])}{'...' if len(self.mismatched) > 3 else ''})"
        if self.logits_max_abs_diff is not None:
            text += f"; logits max |diff| {self.logits_max_abs_diff:.3g} (tolerance {self.logits_tolerance:.3g})"
        return text


def compare_tensors(report: VerifyReport, source: tuple[ModelLayout, TensorSource],
                    written: tuple[ModelLayout, TensorSource], dtype: torch.dtype):
    """Every HF tensor (as the HF files hold it: gpt-oss's experts packed) rebuilt from the written checkpoint must
    equal the source's, cast to the written dtype."""
    (src_layout, src), (out_layout, out) = source, written
    src_files, out_files = HFFiles(src_layout), HFFiles(out_layout)
    for name in src_files.shapes:
        expected = src_files.assemble(name, src, dtype)
        actual = out_files.assemble(name, out)
        report.tensors_checked += 1
        if expected.is_floating_point():
            nans = int(expected.isnan().sum())
            if nans:
                report.nan_counts.setdefault(name, nans)
        if not bit_equal(actual, expected):
            report.mismatched.append(name)


def scan_nan(report: VerifyReport, source: tuple[ModelLayout, TensorSource]):
    """The source's NaN counts per HF tensor into `report` (its warnings name them), without a written side to
    compare: what a conversion that is not verified still looks for."""
    layout, src = source
    files = HFFiles(layout)
    for name in files.shapes:
        tensor = files.assemble(name, src)
        if tensor.is_floating_point() and (nans := int(tensor.isnan().sum())):
            report.nan_counts.setdefault(name, nans)


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: NaN equals the same NaN (torch.equal says NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    as_int = _SAME_SIZE_INTS[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def fixed_input(vocab_size: int, max_len: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (2, min(24, max_len)), generator=generator)


def qlm_model(layout: ModelLayout, source: TensorSource, weight_dtype: torch.dtype) -> GPTModel:
    """qlm's single-process model (fp32 compute) over weights rounded to `weight_dtype`."""
    single = ModelLayout(layout.spec, make_vocab_size_divisible_by=layout.make_vocab_size_divisible_by)
    return build_rank_model(single, RankCoords(), source, read_dtype=weight_dtype).eval()


def load_hf_model(path: Path, weight_dtype: torch.dtype):
    """transformers' model in fp32 compute, weights rounded to `weight_dtype`: its causal LM, or its sequence
    classifier where config.json names one (a reward model)."""
    import transformers

    architecture = (transformers.AutoConfig.from_pretrained(path).architectures or [""])[0]
    auto = (transformers.AutoModelForSequenceClassification if architecture.endswith("ForSequenceClassification")
            else transformers.AutoModelForCausalLM)
    try:
        model = auto.from_pretrained(path, dtype=torch.float32)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = auto.from_pretrained(path, torch_dtype=torch.float32)
    return model.to(weight_dtype).float().eval()


@torch.no_grad()
def compare_logits(report: VerifyReport, reference, candidate, spec):
    """reference / candidate: callables input_ids -> logits [b, s, vocab]."""
    ids = fixed_input(spec.vocab_size, spec.max_position_embeddings)
    ref, out = reference(ids), candidate(ids)
    # NaN/inf logits (NaN or inf weights in the source) agree where both sides hold the same value
    same = (ref == out) | (ref.isnan() & out.isnan())
    diff = (ref - out).abs().masked_fill(same, 0).max().item()
    report.logits_max_abs_diff = float("inf") if diff != diff else diff
    finite = ref[ref.isfinite()]
    report.logits_tolerance = 1e-4 * max(1.0, finite.abs().max().item() if finite.numel() else 1.0)


def hf_logits_fn(path: Path, weight_dtype: torch.dtype):
    """A sequence classifier scores every position with its own `score` (what qlm's model returns), not only the
    last non-pad token its forward pools."""
    model = load_hf_model(path, weight_dtype)
    if hasattr(model, "score"):
        return lambda ids: model.score(model.base_model(ids).last_hidden_state)
    return lambda ids: model(ids).logits


def qlm_logits_fn(layout: ModelLayout, source: TensorSource, weight_dtype: torch.dtype):
    model = qlm_model(layout, source, weight_dtype)
    return lambda ids: model(ids)
