"""A real full disk: a small tmpfs mounted for the case (needs root; setup fails without it), the command writes
into it, the check unmounts it. Unlike the monkeypatched faults of the other files, these meet the exceptions torch
and safetensors really raise."""

import subprocess
from pathlib import Path

from battery.case import Case

TAG = "full:"


def _mount(root: Path, size: str) -> Path:
    disk = root / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True,
                   capture_output=True)
    return disk


def _unmount(root: Path):
    subprocess.run(["umount", str(root / "disk")], check=False, capture_output=True)


def _empty_disk(root, out):
    left = [p.name for p in (root / "disk").iterdir()]
    return f"left on the disk: {left}" if left else None


def _old_kept(name):
    def check(root, out):
        old = root / "disk" / name / "keep.txt"
        return None if old.is_file() and old.read_text() == "old" else "the old output was lost"
    return check


def _old_output(disk: Path, name: str) -> Path:
    (disk / name).mkdir()
    (disk / name / "keep.txt").write_text("old")
    return disk / name


def _run_kept_complete(root, out):
    ckpt = root / "disk" / "run" / "checkpoints"
    partial = [p.name for p in ckpt.iterdir() if "partial" in p.name] if ckpt.is_dir() else []
    if partial:
        return f"partial checkpoint left: {partial}"
    return None if "No space left on device" in out.stderr else "the cause is not named"


CASES = [
    Case("3 output", f"{TAG} hf2mcore onto a full 512k disk", lambda root, fx: [
        "convert", "hf2mcore", "--hf", fx.hf(), "--out", _mount(root, "512k") / "out"],
        cleanup=_unmount, check=(_empty_disk)),
    Case("3 output", f"{TAG} hf2mcore torch_dist onto a full disk", lambda root, fx: [
        "convert", "hf2mcore", "--hf", fx.hf(), "--out", _mount(root, "384k") / "out", "--format", "torch_dist"],
        cleanup=_unmount, check=(_empty_disk)),
    Case("3 output", f"{TAG} mcore2hf (safetensors) onto a full disk", lambda root, fx: [
        "convert", "mcore2hf", "--mcore", fx.megatron(), "--out", _mount(root, "256k") / "out"],
        cleanup=_unmount, check=(_empty_disk)),
    Case("3 output", f"{TAG} mcore2mcore --force over an old output on a full disk keeps the old one",
         lambda root, fx: ["convert", "mcore2mcore", "--mcore", fx.megatron(), "--tp", "1", "--pp", "1", "--force",
                           "--out", _old_output(_mount(root, "512k"), "out")],
         cleanup=_unmount, check=(_old_kept("out"))),
    Case("3 output", f"{TAG} train: the first checkpoint does not fit (2 MiB disk)", lambda root, fx: [
        "train", fx.recipe(), "--output", _mount(root, "2m") / "run"],
        cleanup=_unmount, check=(_run_kept_complete)),
    Case("3 output", f"{TAG} train torch_dist: the first checkpoint does not fit", lambda root, fx: [
        "train", fx.recipe(), "--output", _mount(root, "2m") / "run", "--set", "checkpoint.format=\"torch_dist\""],
        cleanup=_unmount, check=(_run_kept_complete)),
    Case("3 output", f"{TAG} data preprocess onto a full disk", lambda root, fx: [
        "data", "preprocess", "--input", _corpus(root), "--tokenizer", fx.tokenizer(),
        "--output", _mount(root, "64k") / "corpus"],
        cleanup=_unmount, check=(_empty_disk)),
]


def _corpus(root: Path) -> Path:
    path = root / "corpus.txt"
    path.write_text("\n\n".join(f"the quick brown fox {i} jumps over the lazy dog" * 8 for i in range(4000)))
    return path
