"""qlm's MoE and Qwen3 checkpoints load into REAL megatron-core 0.16.1 (local spec, SequentialMLP experts, the
allgather dispatcher, the gated shared expert, q/k layernorm): legacy files written at TP2 x PP2 with strict
load_state_dict (every key and shape), torch_dist written at TP1 through dist_checkpointing at TP2 x PP2 (strict:
no key missing or left over); megatron-core's logits equal transformers'. Expert parallel legacy files (EP2 at TP2,
expert-TP 1 and 2, sequence parallel): every global rank loads the mp_rank_TT_EEE folder qlm named for
megatron-core's own TP and EP ranks, strictly, and holds the HF experts qlm says it does. One torchrun launch (4
gloo ranks)."""

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from conftest import QWEN3_MOE_KINDS, launch_torchrun

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install '.[test]')")
pytestmark = [pytest.mark.peer, pytest.mark.distributed,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

# ERNIE 4.5 MoE's router (softmax scores chosen with a correction bias) is not one megatron-core builds: its softmax
# router refuses an expert bias
CASES = {f"{kind}_{fmt}": (kind, fmt) for kind in QWEN3_MOE_KINDS if kind != "ernie4_5_moe"
         for fmt in ("torch", "torch_dist")}
# legacy EP at TP2 on the 4 ranks: expert-TP 1 (expert-data-parallel 2: qlm writes 2 folders, each read by 2 ranks)
# and expert-TP 2 (one folder per rank); the shared expert and the attention stay TP-split
EP_CASES = {"qwen2_moe_torch_ep2_etp1": ("qwen2_moe", dict(tp=2, ep=2, etp=1)),
            "qwen3_moe_torch_ep2_etp2": ("qwen3_moe", dict(tp=2, ep=2, etp=2))}
# a sigmoid router with expert biases (aux-loss-free balancing; no transformers family has it): qlm's own logits
BIAS_CASES = {f"qwen3_moe_bias_{fmt}": fmt for fmt in ("torch", "torch_dist")}
RANKS = 4


class _BiasedSource:
    """`base`'s weights, and for each router's expert bias values large enough to change the routing."""

    def __init__(self, base):
        self.base = base

    def stored_dtype(self, tensor):
        return torch.float32 if tensor.buffer else self.base.stored_dtype(tensor)

    def read_into(self, tensor, start, stop, out):
        if not tensor.buffer:
            return self.base.read_into(tensor, start, stop, out)
        layer = int(tensor.name.split(".")[2])
        bias = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(layer)) * 0.3
        out.copy_(bias[start:stop])


def write_biased(hf_dir: Path, out: Path, fmt: str, ids: torch.Tensor, **layout) -> torch.Tensor:
    """The HF model with a sigmoid router and expert biases, written by qlm at `layout`; qlm's logits of `ids`."""
    import dataclasses

    from qlm_core.checkpoint.convert.verify import qlm_logits_fn
    from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
    from qlm_core.checkpoint.formats.megatron.args import make_args
    from qlm_core.checkpoint.formats.megatron.write import write_megatron
    from qlm_core.checkpoint.io.progress import no_progress
    from qlm_core.models.layout import HFTensorSource, ModelLayout

    hf = HFCheckpoint(hf_dir)
    spec = hf.spec.replace(moe=dataclasses.replace(hf.spec.moe, score_function="sigmoid", expert_bias=True))
    source = _BiasedSource(HFTensorSource(hf))
    written = ModelLayout(spec, **layout)
    write_megatron(fmt, out, written, source, torch.float32, make_args(written, torch.float32, ckpt_format=fmt), None,
                   no_progress)
    with torch.no_grad():
        logits = qlm_logits_fn(ModelLayout(spec), source, torch.float32)(ids)
        unbiased = qlm_logits_fn(ModelLayout(hf.spec), HFTensorSource(hf), torch.float32)(ids)
    assert (logits - unbiased).abs().max() > 1e-2  # the router and its biases change the outputs
    return logits


@pytest.fixture(scope="module")
def peer_run(moe_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_peer")
    cases = []
    every = {name: (kind, fmt, None) for name, (kind, fmt) in CASES.items()}
    every |= {name: (kind, "torch", layout) for name, (kind, layout) in EP_CASES.items()}
    for i, (name, (kind, fmt, ep_layout)) in enumerate(every.items()):
        layout = ep_layout or (dict(tp=2, pp=2) if fmt == "torch" else dict(tp=1))
        if kind == "gpt_oss":  # megatron-core adds expert biases at expert-TP 1 only
            layout["etp"] = 1
        hf_to_mcore(moe_models[kind], tmp / name, **layout, format=fmt, verify=False)
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(i))
        model = transformers.AutoModelForCausalLM.from_pretrained(moe_models[kind], dtype=torch.float32).eval()
        with torch.no_grad():
            torch.save(model(ids).logits, tmp / f"{name}.expected.pt")
        torch.save(ids, tmp / f"{name}.ids.pt")
        cases.append({"ckpt": str(tmp / name), "format": fmt, "tp": 2, "pp": 2, "ids": str(tmp / f"{name}.ids.pt"),
                      "expected": str(tmp / f"{name}.expected.pt"), "result": str(tmp / f"{name}.json")})
        if kind == "gpt_oss":
            cases[-1]["etp"] = 1
        if ep_layout:  # megatron-core wants sequence parallelism for MoE under TP
            cases[-1] |= {"sequence_parallel": True, "ranks": str(tmp / f"{name}.rank{{rank}}.pt")}
    for i, (name, fmt) in enumerate(BIAS_CASES.items()):
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(100 + i))
        layout = dict(tp=2, pp=2) if fmt == "torch" else dict(tp=1)
        torch.save(write_biased(moe_models["qwen3_moe"], tmp / name, fmt, ids, **layout), tmp / f"{name}.expected.pt")
        torch.save(ids, tmp / f"{name}.ids.pt")
        cases.append({"ckpt": str(tmp / name), "format": fmt, "tp": 2, "pp": 2, "ids": str(tmp / f"{name}.ids.pt"),
                      "expected": str(tmp / f"{name}.expected.pt"), "result": str(tmp / f"{name}.json")})
    (tmp / "cases.json").write_text(json.dumps(cases))
    worker = Path(__file__).parents[1] / "peers" / "megatron_moe_worker.py"
    proc = launch_torchrun(worker, RANKS, tmp / "cases.json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp


@pytest.mark.parametrize("name", CASES)
def test_megatron_core_loads_qlm_moe_checkpoints_and_gives_transformers_logits(peer_run, name):
    result = json.loads((peer_run / f"{name}.json").read_text())
    assert result["shape"] == [2, 16, 512]  # megatron's padding at TP2 (qlm wrote 512 at TP2, 384 at TP1)
    assert result["max_abs_diff"] <= 1e-4, result


@pytest.mark.parametrize("name", EP_CASES)
def test_megatron_core_loads_qlm_expert_parallel_legacy_files_for_its_own_ranks(peer_run, moe_models, name):
    """Each of megatron-core's 4 ranks (its parallel_state at TP2 x EP2, expert-TP 1 or 2) opens the folder qlm
    named for its TP and EP ranks: the keys and shapes of its state_dict() are exactly the file's, the strict load
    passes, and its local expert l is HF expert ep_rank * E_local + l (its expert-TP part); logits as transformers'."""
    kind, layout = EP_CASES[name]
    tp, ep, etp = layout["tp"], layout["ep"], layout["etp"]
    hf = {}
    for file in sorted(moe_models[kind].glob("*.safetensors")):
        hf |= safetensors.torch.load_file(file)
    experts = transformers.AutoConfig.from_pretrained(moe_models[kind]).num_experts
    local_count = experts // ep
    seen = set()
    for rank in range(RANKS):
        report = torch.load(peer_run / f"{name}.rank{rank}.pt", weights_only=True)
        tp_rank, ep_rank, etp_rank = report["tp_rank"], report["ep_rank"], report["etp_rank"]
        assert report["folder"] == f"mp_rank_{tp_rank:02d}_{ep_rank:03d}", report["folder"]
        assert etp_rank == tp_rank % etp and report["sequence_parallel"]
        assert report["keys"] > 0 and report["differ"] == [], (rank, report["differ"][:8])
        seen.add(report["folder"])
        checked = 0
        for key, value in report["experts"].items():
            layer, local, proj = key.split(".")[2], int(key.split(".")[6]), key.split(".")[7]
            prefix = f"model.layers.{layer}.mlp.experts.{ep_rank * local_count + local}"
            if proj == "linear_fc1":
                gate, up = (hf[f"{prefix}.{part}.weight"].chunk(etp)[etp_rank] for part in ("gate_proj", "up_proj"))
                want = torch.cat([gate, up])
            else:
                want = hf[f"{prefix}.down_proj.weight"].chunk(etp, dim=1)[etp_rank]
            assert torch.equal(value, want), (rank, key, prefix)
            checked += 1
        moe_layers = sum(1 for k in hf if k.endswith(".mlp.experts.0.down_proj.weight"))
        assert checked == 2 * local_count * moe_layers
    # the ranks opened every folder qlm wrote, and no other: at expert-TP 1 the two of expert-data-parallel rank 0
    # (mp_rank_00_000, mp_rank_01_001), each read by two ranks; at expert-TP 2 one per rank
    written = {d.name for d in (peer_run / name / "release").iterdir() if d.name.startswith("mp_rank_")}
    assert seen == written and len(written) == (2 if etp == 1 else tp * ep), (seen, written)
    result = json.loads((peer_run / f"{name}.json").read_text())
    assert result["shape"] == [2, 16, 512]
    assert result["max_abs_diff"] <= 1e-4, result


@pytest.mark.parametrize("name", BIAS_CASES)
def test_megatron_core_loads_qlm_expert_biases_and_gives_qlms_logits(peer_run, name):
    """megatron-core with moe_router_enable_expert_bias (from the args qlm wrote) loads the routers' expert_bias
    strictly and routes by it: its logits are qlm's, which the biases move away from the unbiased model's."""
    result = json.loads((peer_run / f"{name}.json").read_text())
    assert result["max_abs_diff"] <= 1e-4, result
