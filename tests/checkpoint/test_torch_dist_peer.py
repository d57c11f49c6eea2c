"""torch_dist checkpoints written by `qlm convert hf2mcore --format torch_dist` load into REAL megatron-core at a TP/PP
other than the one they were converted at (strict: no key missing or left over) and give transformers' logits; the
checkpoints megatron-core then saves itself read back into qlm bit-exactly. One torchrun launch (4 gloo ranks)."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import LLAMA3_ROPE, launch_torchrun, make_hf_model
from helpers import RECIPE, assert_clean_failure, assert_same_hf, qlm_train

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from qlm_core.checkpoint.formats.megatron.format import open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import MegatronTorchCheckpoint
from qlm_core.checkpoint.formats.megatron.torch_dist import TorchDistCheckpoint
from qlm_core.checkpoint.io.safe_load import safe_torch_load

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install '.[test]')")
pytestmark = [pytest.mark.peer, pytest.mark.distributed,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

# name: (model, layout qlm writes at); megatron-core loads each at TP2 x PP2 with its own vocabulary padding (512).
CASES = {
    "qwen2_tp1pp1": ("qwen2", dict(tp=1, pp=1)),
    "qwen2_tied_tp1pp1": ("qwen2_tied", dict(tp=1, pp=1)),
    "llama31_tp4": ("llama31", dict(tp=4)),
}


@pytest.fixture(scope="module")
def peer_run(hf_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist_peer")
    rope = {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}  # what megatron-core hard-codes
    make_hf_model(tmp / "llama31", "llama3", rope_scaling=rope, max_position_embeddings=16384)
    models = {**hf_models, "llama31": tmp / "llama31"}
    cases = []
    for i, (name, (kind, layout)) in enumerate(CASES.items()):
        hf_to_mcore(models[kind], tmp / name, **layout, format="torch_dist", verify=False)
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(i))
        model = transformers.AutoModelForCausalLM.from_pretrained(models[kind], dtype=torch.float32).eval()
        with torch.no_grad():
            torch.save(model(ids).logits, tmp / f"{name}.expected.pt")
        torch.save(ids, tmp / f"{name}.ids.pt")
        cases.append({"ckpt": str(tmp / name), "ids": str(tmp / f"{name}.ids.pt"), "tp": 2, "pp": 2,
                      "expected": str(tmp / f"{name}.expected.pt"), "result": str(tmp / f"{name}.json"),
                      "resave": str(tmp / f"{name}.megatron")})
    cases.append(trainer_case(tmp))
    (tmp / "cases.json").write_text(json.dumps(cases))
    worker = Path(__file__).parents[1] / "peers" / "megatron_dist_worker.py"
    proc = launch_torchrun(worker, 4, tmp / "cases.json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, models


def trainer_case(tmp: Path) -> dict:
    """A torch_dist checkpoint written by `qlm train` at TP2 (every rank its own chunks, Adam states beside the
    weights), to be loaded at TP2 x PP2 the way Megatron-LM does (extra keys ignored); expected: transformers'
    logits on qlm's HF export of the same checkpoint."""
    run = tmp / "trainer"
    qlm_train(RECIPE, "--output", run, "--set", f"data.cache_dir={tmp / 'cache'}", "--set", "parallel.tp=2",
              "--set", "train.train_iters=2", "--set", "checkpoint.format=torch_dist")
    mcore_to_hf(run / "checkpoints", tmp / "trainer.hf", verify=False)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(7))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "trainer.hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save(model(ids).logits, tmp / "trainer.expected.pt")
    torch.save(ids, tmp / "trainer.ids.pt")
    return {"ckpt": str(run / "checkpoints"), "ids": str(tmp / "trainer.ids.pt"), "tp": 2, "pp": 2,
            "expected": str(tmp / "trainer.expected.pt"), "result": str(tmp / "trainer.json"),
            "resave": str(tmp / "trainer.megatron"), "strict": "assume_ok_unexpected"}


def test_megatron_core_loads_a_torch_dist_checkpoint_of_qlm_train(peer_run):
    tmp, _ = peer_run
    result = json.loads((tmp / "trainer.json").read_text())
    assert result["shape"] == [2, 16, 512]
    assert result["max_abs_diff"] <= 1e-4, result
    # and what megatron-core saved of that model reads back as the same weights
    assert mcore_to_hf(tmp / "trainer.megatron", tmp / "trainer.megatron.hf", verify=True).verify.ok
    assert_same_hf(tmp / "trainer.hf", tmp / "trainer.megatron.hf")


@pytest.mark.parametrize("name", CASES)
def test_megatron_core_loads_qlm_torch_dist_at_another_layout(peer_run, name):
    tmp, _ = peer_run
    result = json.loads((tmp / f"{name}.json").read_text())
    assert result["shape"] == [2, 16, 512]  # megatron's own padding at TP2 (qlm wrote 384 or 512)
    assert result["max_abs_diff"] <= 1e-4, result


@pytest.mark.parametrize("name", CASES)
def test_qlm_reads_megatron_cores_own_torch_dist(peer_run, name, tmp_path):
    tmp, models = peer_run
    kind = CASES[name][0]
    saved = tmp / f"{name}.megatron"
    ckpt = open_megatron(saved)
    assert isinstance(ckpt, TorchDistCheckpoint) and ckpt.iteration == 7 and (ckpt.tp, ckpt.pp) == (2, 2)
    assert len(list((saved / "iter_0000007").glob("__*_*.distcp"))) >= 4  # one or more per saving rank
    assert mcore_to_hf(saved, tmp_path / "hf", verify=True).verify.ok
    assert_same_hf(models[kind], tmp_path / "hf")
    mcore_to_mcore(saved, tmp_path / "torch", tp=2, pp=2, format="torch", verify=True)
    hf_to_mcore(models[kind], tmp_path / "direct", tp=2, pp=2, make_vocab_size_divisible_by=128)
    for file in sorted((tmp_path / "direct/release").rglob("model_optim_rng.pt")):
        ours = safe_torch_load(tmp_path / "torch/iter_0000007" / file.relative_to(tmp_path / "direct/release"))
        direct = safe_torch_load(file)
        for key, tensor in direct["model"].items():
            assert (tensor is None and ours["model"][key] is None) or torch.equal(tensor, ours["model"][key]), key
    assert MegatronTorchCheckpoint(tmp_path / "torch").iteration == 7


def test_missing_rank_file_of_a_megatron_checkpoint(peer_run, run_qlm, tmp_path):
    import shutil

    tmp, _ = peer_run
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp / "qwen2_tp1pp1.megatron", damaged)
    victim = max((damaged / "iter_0000007").glob("__*_*.distcp"))
    victim.unlink()
    out = tmp_path / "hf"
    assert_clean_failure(run_qlm("convert", "mcore2hf", "--mcore", damaged, "--out", out), out, victim.name)
