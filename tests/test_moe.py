"""Qwen3-MoE on Megatron-Core against transformers in float64: logprobs (packed and padded rows, both token
dispatchers, both router normalisations), one DAPO train step, expert parallelism (EP 2, TP 2 x EP 2) and pipeline
stages against one process, the router's auxiliary losses, and routing replay (R3's given routes, R2's recorded
ones, replayed again inside activation recompute's backward).

The model (tests/megatron_helpers.py tiny_hf_model('qwen3_moe')): 4 layers, the second dense, 8 distinct experts a
MoE layer, top 2 renormalised, a router whose rows come in near-tied pairs (model/tiny.py). The float64 reference
(tests/dapo_reference.py) routes through Float64Router, written out in the test. Every run is a job of the test run's
torchrun launches (tests/conftest.py megatron_runs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dapo_reference import (
    LOSS,
    SEQ,
    TEMPERATURE,
    Float64Router,
    assert_matches_float64,
    assert_same,
    budget,
    dapo_float64,
)
from megatron_helpers import Job, hf_response_logprobs, random_batch, result, save_case, tiny_hf_model

from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.model.arch import ArchError, ModelArch
from megatron_dapo.model.parallel import LayoutError, check_layout

LAYERS = 4  # MoE, dense, MoE, MoE: two pipeline stages of two layers, one of them holding the dense one
VOCAB = 250
R3 = "model.router_replay=r3"


def moe_model(norm_topk_prob: bool = True):
    return tiny_hf_model("qwen3_moe", seed=7, vocab_size=VOCAB, layers=LAYERS, norm_topk_prob=norm_topk_prob)


def given_routes(batch: list[dict], arch: ModelArch, seed: int = 3) -> list[dict]:
    """The batch with "routes": for each sample, position (but the last) and MoE layer, two distinct experts drawn
    at random: routes the model's own router would almost never pick, so replaying them changes every output."""
    g = torch.Generator().manual_seed(seed)
    for b in batch:
        n = len(b["prompt"]) + len(b["response"]) - 1
        draw = torch.rand(n, len(arch.moe_layers), arch.num_experts, generator=g)
        b["routes"] = draw.argsort(-1)[..., : arch.num_experts_per_tok].to(torch.uint8)
    return batch


@pytest.fixture(scope="module")
def model():
    return moe_model()


@pytest.fixture(scope="module")
def arch(model) -> ModelArch:
    return ModelArch.from_hf_config(model.config.to_dict())


@pytest.fixture(scope="module")
def batch(arch):
    return given_routes(random_batch(8, SEQ, VOCAB), arch)


def megatron_jobs(root: Path) -> dict[str, Job]:
    """Every Megatron run of this file (tests/conftest.py megatron_runs runs them)."""
    model = moe_model()
    arch = ModelArch.from_hf_config(model.config.to_dict())
    case = save_case(model, given_routes(random_batch(8, SEQ, VOCAB), arch), root / "case")
    logprob_case = save_case(model, random_batch(6, 14, VOCAB, seed=5), root / "case-logprobs")
    no_norm = save_case(moe_model(norm_topk_prob=False), random_batch(6, 14, VOCAB, seed=5), root / "case-no-norm")

    def train(nproc: int, *overrides: str, slow: bool = False) -> Job:
        return Job(nproc, case, ("--mode", "train", *LOSS, *overrides), slow or nproc > 1)

    def logprobs(on: Path, *overrides: str) -> Job:
        return Job(1, on, ("--mode", "logprobs", "--temperature", "0.7", *overrides))

    aux = ("model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001")
    return {
        "logprobs": logprobs(logprob_case),
        "logprobs-padded-allgather": logprobs(
            logprob_case, "train.packed_sequences=false", "model.moe_token_dispatcher=allgather"
        ),
        "logprobs-no-norm": logprobs(no_norm),
        "logprobs-fp64-router": logprobs(logprob_case, "model.moe_router_dtype=fp64"),
        "ref": train(1, budget(8)),
        "r3": train(1, budget(4), R3),  # two micro-batches, each with its own samples' routes
        "r3-recompute": train(1, budget(4), R3, "model.recompute=full"),
        "r2": train(1, budget(8), "model.router_replay=r2"),
        "aux": train(1, budget(8), *aux),
        "dp2": train(2, budget(8), "parallel.use_distributed_optimizer=false"),
        "ep2": train(2, budget(8), "parallel.ep=2", "parallel.use_distributed_optimizer=false"),
        "ep2-distopt": train(2, budget(8), "parallel.ep=2"),
        "ep2-r3": train(2, budget(4), "parallel.ep=2", "parallel.use_distributed_optimizer=false", R3),
        "pp2-r3": train(2, budget(4), "parallel.pp=2", R3),
        # with R2: the routes recorded under sequence parallel (each TP rank routes its share of the positions) are
        # gathered, then sliced again for the replayed step; the experts split over the same two ranks (Megatron's
        # MoE parallel folding: EP inside TP, etp 1)
        "tp2-ep2": train(
            2,
            budget(8),
            "parallel.tp=2",
            "parallel.ep=2",
            "parallel.use_distributed_optimizer=false",
            "model.router_replay=r2",
        ),  # fmt: skip
    }


def own_routes(model, b: dict) -> torch.Tensor:
    """[n - 1, moe layers, k] long: the experts the float64 router picks at each position but the last."""
    hf = model.double() if next(model.parameters()).dtype != torch.float64 else model
    routers = Float64Router.install(hf)
    with torch.no_grad():
        hf_response_logprobs(hf, b, TEMPERATURE)
    n = len(b["prompt"]) + len(b["response"]) - 1
    picks = []
    for r in routers:
        logits = r.logits[-1]
        picks.append(torch.topk(torch.softmax(logits, -1), r.gate.top_k, dim=-1).indices[:n])
    return torch.stack(picks, dim=1)


@pytest.mark.parametrize(
    "name, norm", [("logprobs", True), ("logprobs-padded-allgather", True), ("logprobs-no-norm", False)]
)
def test_logprobs_match_float64_transformers(ran, name, norm):
    """Packed rows with the alltoall dispatcher, padded rows with allgather, a router without renormalisation
    (norm_topk_prob false: Megatron's pre-softmax routing), and the router in float64 (model.moe_router_dtype):
    transformers' logprobs and entropies in float64."""
    import copy

    hf = copy.deepcopy(moe_model(norm_topk_prob=norm)).double()
    Float64Router.install(hf)
    got = result(ran, name)
    batch = random_batch(6, 14, VOCAB, seed=5)
    with torch.no_grad():
        for g, b in zip(got["logprobs"], batch):
            logp, entropy = hf_response_logprobs(hf, b, 0.7)
            torch.testing.assert_close(g["logp"].double(), logp, rtol=0, atol=1e-5)
            torch.testing.assert_close(g["entropy"].double(), entropy, rtol=0, atol=1e-5)


def test_the_routers_near_ties_and_experts_matter(model, arch):
    """What the other tests rely on: experts that differ (a swapped pair changes the output), a dense layer among
    the MoE ones, and near ties: pairs of experts whose logits differ by far more than float32 rounding but
    little enough that bfloat16 flips some of them."""
    assert arch.moe_layers == (0, 2, 3) and arch.num_experts == 8 and arch.num_experts_per_tok == 2
    layer = model.model.layers[0].mlp
    assert not torch.equal(layer.experts.gate_up_proj[0], layer.experts.gate_up_proj[1])
    w = layer.gate.weight.detach().double()
    gap = (w[:4] - w[4:]).norm(dim=-1) / w[:4].norm(dim=-1)
    assert (gap > 1e-4).all() and (gap < 0.05).all(), gap


def test_one_step_matches_float64_transformers(model, batch, arch, ran):
    """One DAPO step through every expert and the router: loss, clip counts, and every gradient and updated weight
    (the router's and each expert's included) against the float64 step."""
    want = dapo_float64(model, batch)
    got = result(ran, "ref")
    assert_matches_float64(want, got, arch, "moe")
    m = got["metrics"]
    assert m["moe/load_imbalance"] >= 1.0 and "moe/router_agreement" not in m  # nothing replayed
    assert m["moe/load_balancing_loss"] > 0 and m["moe/z_loss"] > 0


def test_auxiliary_losses_reach_the_gradient(model, batch, arch, ran):
    """model.moe_aux_loss_coeff and moe_z_loss_coeff: the step's gradient is that of the DAPO loss plus Megatron's
    load-balancing loss and z-loss over the mini-batch's tokens, as written out in float64 (a coefficient left
    scaled by the token count, or dropped, fails)."""
    want = dapo_float64(model, batch, aux=(0.01, 0.001))
    plain = dapo_float64(model, batch)
    router = "decoder.layers.0.mlp.router.weight"
    assert (want["grads"][router] - plain["grads"][router]).abs().max() > 1e-3 * plain["grads"][router].abs().max()
    got = result(ran, "aux")
    m = got["metrics"]
    m["actor/loss"] = want["loss"]  # Megatron reports the DAPO loss alone; the rest must match
    assert_matches_float64(want, got, arch, "aux")


def test_r3_replays_given_routes_in_every_pass(model, batch, arch, ran):
    """model.router_replay=r3: the samples' routes (drawn at random, not the router's) replayed in the old-logprob
    and train passes, two micro-batches each with its own samples' routes: the step is the float64 step through
    exactly those experts. The agreement metric is the share of positions where the router's own top 2 is the
    replayed pair (here about 1 in 28)."""
    want = dapo_float64(model, batch, replay=True)
    got = result(ran, "r3")
    assert_matches_float64(want, got, arch, "r3")
    same = sum(
        int((own_routes(model, b).sort(-1).values == b["routes"].long().sort(-1).values).all(-1).sum()) for b in batch
    )
    positions = sum((len(b["prompt"]) + len(b["response"]) - 1) * len(arch.moe_layers) for b in batch)
    assert got["metrics"]["moe/router_agreement"] == pytest.approx(same / positions, abs=1e-12)
    assert same / positions < 0.2


def test_r3_replays_inside_activation_recompute(ran):
    """model.recompute=full runs each layer's forward again inside backward: it must replay the same routes there
    (in micro-batch order), so the step equals the one without recompute."""
    assert_same(result(ran, "r3"), result(ran, "r3-recompute"), "r3 with full recompute")


def test_r2_records_the_routers_choice_and_replays_it(model, batch, arch, ran):
    """model.router_replay=r2: the old-logprob pass records what the routers pick (the float64 router's top 2 at
    every position and layer), the step replays it (the same step as routing by itself, every replayed pair agreeing
    at first), and a second update replays the same recorded routes under weights the first one moved, where some
    of them are no longer the router's own."""
    got = result(ran, "r2")
    for routes, b in zip(got["routes"], batch):
        assert routes.dtype == torch.uint8
        torch.testing.assert_close(routes.long().sort(-1).values, own_routes(model, b).sort(-1).values)
    assert_matches_float64(dapo_float64(model, batch), got, arch, "r2")
    assert got["metrics"]["moe/router_agreement"] == 1.0
    assert 0.5 < got["metrics2"]["moe/router_agreement"] < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2", "ep2"])
def test_expert_parallel_step_equals_one_process(model, batch, arch, ran, name):
    """EP 2 (each rank 4 experts, the tokens exchanged all-to-all, the experts' gradients reduced over their own
    data-parallel group of 1 and the dense ones over 2, the distributed optimizer sharding each part over its own
    group) and plain DP 2: the step of one process, and the float64 one."""
    got = result(ran, name)
    assert got["experts_held"] == ([0, 1, 2, 3] if name == "ep2" else list(range(8)))  # data-parallel rank 0's
    assert_same(result(ran, "ref"), got, name)
    assert_matches_float64(dapo_float64(model, batch), got, arch, name)


@pytest.mark.slow
def test_distributed_optimizer_shards_experts_and_dense_parts_over_their_own_groups(ran):
    """EP 2 with the distributed optimizer (the dense parameters' state sharded over data parallel 2, the experts'
    over their data-parallel group of 1): the weights after the step are the one-process ones (the main grads of a
    sharded buffer are only reduced on the shard that owns them, so they are not compared)."""
    ref, got = result(ran, "ref"), result(ran, "ep2-distopt")
    assert got["weights"].keys() == ref["weights"].keys()
    for name, t in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], t, rtol=1e-5, atol=1e-6, msg=name)
    assert got["metrics"]["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2-r3", "pp2-r3"])
def test_replay_under_expert_and_pipeline_parallel(ran, name):
    """R3 with the routes sliced as the tokens are: EP 2 (each rank its samples' routes) and PP 2 (each stage its
    own MoE layers' routes) give the one-process replayed step."""
    assert_same(result(ran, "r3"), result(ran, name), name)


@pytest.mark.slow
def test_tensor_times_expert_parallel_equals_one_process(model, batch, arch, ran):
    """TP 2 x EP 2 folded onto 2 processes (the dense layers split over TP with sequence parallel, the experts split
    over the same two ranks, each whole on its EP rank: Megatron's MoE parallel folding, as the 30B-A3B recipes run),
    replaying the routes its old-logprob pass recorded (R2): the one-process step, every replayed pair the router's
    own."""
    got = result(ran, "tp2-ep2")
    assert got["metrics"]["moe/router_agreement"] == 1.0
    assert_same(result(ran, "ref"), got, "tp2 x ep2")
    assert_matches_float64(dapo_float64(model, batch), got, arch, "tp2 x ep2")


# ---------------------------------------------------------------- the architecture, the layout, the weight maps


def moe_config(**changes) -> dict:
    import json

    return {**json.loads(moe_model().config.to_json_string()), **changes}


def test_arch_reads_the_moe_fields():
    """num_experts (saved by transformers 5 as num_local_experts), the top k, the experts' width, the router's
    renormalisation, and which layers hold experts: transformers' rule, (i + 1) % decoder_sparse_step == 0 unless
    in mlp_only_layers."""
    arch = ModelArch.from_hf_config(moe_config())
    assert (arch.family, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (
        "qwen3_moe", 8, 2, 32
    )  # fmt: skip
    assert arch.norm_topk_prob and arch.qk_layernorm and arch.head_dim == 32 and arch.moe_layers == (0, 2, 3)
    sparse = ModelArch.from_hf_config(moe_config(decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4))
    assert sparse.moe_layers == (1,) and sparse.num_experts == 4
    assert not ModelArch.from_hf_config(moe_config(norm_topk_prob=False)).norm_topk_prob
    assert ModelArch.from_hf_config(moe_config(router_aux_loss_coef=0.02)).router_aux_loss_coef == 0.02


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"shared_expert_intermediate_size": 64}, "field 'shared_expert_intermediate_size'=64 is not supported"),
        ({"scoring_func": "sigmoid"}, "field 'scoring_func'='sigmoid' is not supported"),
        ({"routed_scaling_factor": 2.5}, "field 'routed_scaling_factor'=2.5 is not supported"),
        ({"num_experts_per_tok": 9}, "field 'num_experts_per_tok'=9 exceeds num_experts=8"),
        ({"num_experts_per_tok": 0}, "field 'num_experts_per_tok'=0; expected an integer >= 1"),
        ({"mlp_only_layers": [4]}, "field 'mlp_only_layers'=[4]; expected a list of layer indices 0..3"),
        ({"decoder_sparse_step": 5}, "leave no MoE layer"),
        ({"moe_intermediate_size": None}, "field 'moe_intermediate_size'=None"),
    ],
)
def test_arch_refuses_what_it_cannot_build(changes, needle):
    config = moe_config(**changes)
    if changes.get("num_experts_per_tok") == 9:
        config.pop("num_experts", None)
    with pytest.raises(ArchError) as e:
        ModelArch.from_hf_config(config, "moe/config.json")
    assert str(e.value).startswith("moe/config.json: ") and needle in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "par, world, model_fields, needle",
    [
        (ParallelConfig(ep=3), 3, {}, "parallel.ep=3 must divide the model's 8 experts"),
        (ParallelConfig(ep=4), 2, {}, "world size 2 is not a multiple of parallel.etp x parallel.ep x parallel.pp"),
        (ParallelConfig(etp=2), 2, {}, "parallel.etp=2 must divide parallel.tp=1"),
        (ParallelConfig(pp=2), 2, {"moe_token_dispatcher": "allgather"}, "'allgather' cannot run with parallel.pp=2"),
    ],
)
def test_impossible_expert_layouts_fail_fast(arch, par, world, model_fields, needle):
    with pytest.raises(LayoutError) as e:
        check_layout(arch, par, ModelConfig(**model_fields), world)
    assert needle in str(e.value)


def test_expert_layouts_count_the_experts_data_parallel(arch):
    """Megatron's expert groups: etp x ep x edp x pp = world, beside tp x cp x dp x pp."""
    layout = check_layout(arch, ParallelConfig(tp=2, ep=2), ModelConfig(), 8)
    assert (layout.dp, layout.ep, layout.etp, layout.edp) == (4, 2, 1, 4)
    layout = check_layout(arch, ParallelConfig(tp=2, etp=2, ep=4, pp=2), ModelConfig(), 16)
    assert (layout.dp, layout.edp) == (4, 1)
    dense = ModelArch.from_hf_config(json_config(tiny_hf_model("qwen2")))
    with pytest.raises(LayoutError, match="parallel.ep=2 needs a mixture-of-experts model; this one is dense"):
        check_layout(dense, ParallelConfig(ep=2), ModelConfig(), 2)


def json_config(model) -> dict:
    import json

    return json.loads(model.config.to_json_string())


def test_conversion_round_trips_bit_exact(tmp_path, model, arch):
    """HF -> Megatron -> HF: the router as mlp.router, each expert's cat(gate, up) as its fc1 and down as its fc2,
    and back under the checkpoint's per-expert names, bit for bit; transformers' fused in-memory experts and the
    per-expert checkpoint it saves give the same Megatron tensors."""
    from safetensors.torch import load_file

    from megatron_dapo.convert.layouts import hf_to_megatron, megatron_names, megatron_shape, megatron_to_hf

    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")  # experts one by one
    assert "model.layers.0.mlp.experts.5.gate_proj.weight" in saved
    fused = hf_to_megatron(model.state_dict(), arch)
    per_expert = hf_to_megatron(saved, arch)
    assert list(fused) == list(per_expert) == megatron_names(arch)
    for name, t in fused.items():
        assert torch.equal(t, per_expert[name]), name
        assert tuple(t.shape) == megatron_shape(name, arch), name
    back = {n: t for name, full in fused.items() for n, t in megatron_to_hf(name, full, arch)}
    assert back.keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(back[name], t), name
    e5 = fused["decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert torch.equal(e5, torch.cat([saved["model.layers.2.mlp.experts.5.gate_proj.weight"],
                                      saved["model.layers.2.mlp.experts.5.up_proj.weight"]]))  # fmt: skip


def test_returned_routes_keep_each_finished_requests_moe_layers():
    """The GPU's routes source (vLLM's routed_experts output, every hidden layer): each finished request's MoE
    layers' columns, in the route dtype; an aborted request (vLLM returns none) has no positions; a finished one
    without routed_experts is a clear error."""
    from types import SimpleNamespace

    import numpy as np

    from megatron_dapo.rollout.vllm_routes import ReturnedRoutes

    routes = ReturnedRoutes((0, 2, 3), num_experts=8, topk=2)
    full = np.arange(5 * 4 * 2).reshape(5, 4, 2) % 8  # 5 positions, 4 hidden layers (layer 1 dense), top 2
    routes.finished("a-1", SimpleNamespace(routed_experts=full))
    got = routes.take("a-1")
    assert got.dtype == torch.uint8 and torch.equal(got.long(), torch.as_tensor(full)[:, [0, 2, 3]])
    assert routes.take("never-finished").shape == (0, 3, 2) and routes.pending() == 0
    with pytest.raises(RuntimeError, match="no routed_experts"):
        routes.finished("b-2", SimpleNamespace(routed_experts=None))
