"""hf2mcore's streamed legacy writer (formats/megatron/legacy_stream.py: every source tensor read once, the bytes placed
straight into files saved without them) writes exactly the files torch.save writes from build_shard's tensors."""

import filecmp
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qlm_core.checkpoint.convert import hf_megatron
from qlm_core.checkpoint.formats.megatron import write as megatron_write
from qlm_core.checkpoint.io import storage_fill
from qlm_core.errors import QlmError


def files_of(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def convert_both_ways(monkeypatch, src: Path, out: Path, **kwargs) -> tuple[Path, Path]:
    """(streamed, reference): the same conversion through legacy_stream and through torch.save of every file."""
    streamed, reference = out / "streamed" / "ckpt", out / "reference" / "ckpt"
    hf_megatron.hf_to_mcore(src, streamed, verify=False, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(megatron_write, "STREAMING", False)
        hf_megatron.hf_to_mcore(src, reference, verify=False, **kwargs)
    return streamed, reference


def assert_same_files(a: Path, b: Path):
    assert files_of(a) == files_of(b) and any(p.name == "model_optim_rng.pt" for p in files_of(a))
    for rel in files_of(a):
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel


CASES = {
    "tp2_pp2": ("qwen2", dict(tp=2, pp=2)),
    "tp4_vpp2_tied": ("qwen2_tied", dict(tp=4, pp=2, vpp=2)),
    "uneven_pp3": ("llama3", dict(pp=3, first_stage_layers=2)),
    "tp2_to_bf16": ("qwen2", dict(tp=2, dtype="bf16")),
}


@pytest.mark.parametrize("case", CASES)
def test_streamed_files_are_torch_save_files(hf_models, tmp_path, monkeypatch, case):
    kind, kwargs = CASES[case]
    assert_same_files(*convert_both_ways(monkeypatch, hf_models[kind], tmp_path, **kwargs))


def test_experts_fused_and_bin_sources(moe_models, hf_models, tmp_path, monkeypatch):
    """Routed experts split over EP and expert-TP; transformers-5's fused expert tensors (no byte range per
    expert); a pytorch_model.bin source (no byte ranges at all)."""
    src = moe_models["qwen3_moe"]
    assert_same_files(*convert_both_ways(monkeypatch, src, tmp_path / "ep", tp=2, ep=2, etp=1))
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    state = load_file(str(src / "model.safetensors"))
    for layer in sorted({int(k.split(".")[2]) for k in state if ".mlp.experts." in k}):
        prefix = f"model.layers.{layer}.mlp.experts."
        count = len({k for k in state if k.startswith(prefix) and k.endswith("gate_proj.weight")})
        for part in ("gate_up_proj", "down_proj"):
            names = (["gate_proj", "up_proj"] if part == "gate_up_proj" else ["down_proj"])
            state[prefix + part] = torch.stack([torch.cat([state.pop(f"{prefix}{e}.{n}.weight") for n in names])
                                                for e in range(count)])
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    assert_same_files(*convert_both_ways(monkeypatch, fused, tmp_path / "fused_out", tp=2))
    binary = tmp_path / "bin"
    shutil.copytree(hf_models["qwen2"], binary)
    torch.save(load_file(str(binary / "model.safetensors")), binary / "pytorch_model.bin")
    (binary / "model.safetensors").unlink()
    assert_same_files(*convert_both_ways(monkeypatch, binary, tmp_path / "bin_out", tp=2, pp=2))


def test_without_copy_file_range(hf_models, tmp_path, monkeypatch):
    """Where the kernel refuses copy_file_range (another file system, an old kernel) the bytes are read and
    written instead, with the same result."""
    def refused(*args):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(storage_fill.os, "copy_file_range", refused)
    assert_same_files(*convert_both_ways(monkeypatch, hf_models["qwen2"], tmp_path, tp=2, pp=2))


def test_storage_offsets_place_empty_and_shared_storages(tmp_path):
    """Storages are keyed as torch.save keys them: two empty tensors, a tensor and a view of it, and plain ones
    still give every non-empty storage its offset (not the fallback that writes the file whole)."""
    import torch.serialization as serialization

    from qlm_core.checkpoint.io.storage_fill import storage_offsets

    base = torch.arange(12, dtype=torch.float32)
    state = {"a": torch.empty(0), "b": torch.empty(0, 3), "c": base, "d": base[4:], "e": torch.ones(5)}
    with serialization.skip_data():
        torch.save(state, tmp_path / "f.pt")
    offsets = storage_offsets(tmp_path / "f.pt", state)
    assert offsets is not None and set(offsets) == {base.data_ptr(), state["e"].data_ptr()}
    raw = (tmp_path / "f.pt").read_bytes()
    torch.save(state, tmp_path / "g.pt")
    full = (tmp_path / "g.pt").read_bytes()
    for tensor in (base, state["e"]):
        at = offsets[tensor.data_ptr()]
        assert full[at: at + tensor.nbytes] == tensor.numpy().tobytes() and len(raw) == len(full)


def test_a_failed_copy_fails_the_conversion(hf_models, tmp_path, monkeypatch):
    """The kernel copies run on threads while later files are built: an error of theirs still stops the conversion,
    leaves no output and no copying thread behind."""
    import errno
    import threading

    def failing(self, *args):
        raise OSError(errno.EIO, "input/output error")

    monkeypatch.setattr(storage_fill.RangeCopier, "copy", failing)
    out = tmp_path / "out"
    with pytest.raises(QlmError, match="input/output error"):
        hf_megatron.hf_to_mcore(hf_models["qwen2"], out, tp=2, pp=2, verify=False)
    assert not out.exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("qlm-copy")]
