"""The example configs and the generated config reference.

Each example loads and validates, its parallel layout fits the model it names and the world size it
documents, and the 32B examples (Qwen2.5 and Qwen3) and the mixture-of-experts ones (Qwen3-30B-A3B, Qwen3-235B-A22B)
are the paper's run field by field. docs/config.md's config reference is what
tools/config_reference.py generates, and lists every field.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import typing
from pathlib import Path

import pytest
import yaml
from convert_helpers import tool_module

from megatron_dapo.config import Config, ConfigError, load_config
from megatron_dapo.launch.slurm import sbatch_command
from megatron_dapo.model.arch import ModelArch
from megatron_dapo.model.parallel import check_layout
from megatron_dapo.model.tiny import TINY_QWEN2
from megatron_dapo.trainer import check_distributed

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

# The shape fields of each model's config.json on the Hugging Face Hub (public facts).
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"]}
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-06,
}
# Qwen3-MoE: every layer a MoE layer (decoder_sparse_step 1, no mlp_only_layers); intermediate_size is a dense layer's
_QWEN3_MOE = {
    **_QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}
ARCHS = {
    "Qwen/Qwen2.5-1.5B-Instruct": {
        **_QWEN2,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
    },
    "Qwen/Qwen2.5-7B": {
        **_QWEN2,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
    },
    "Qwen/Qwen2.5-32B": {
        **_QWEN2,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
    },
    "tiny-qwen2": {**_QWEN2, **TINY_QWEN2, "vocab_size": 300},  # the demo's model (build_tiny_qwen2)
    # Qwen3 states head_dim: 128 in both, where hidden / heads is 128 for the 8B but 80 for the 32B
    "Qwen/Qwen3-8B": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
    "Qwen/Qwen3-32B": {
        **_QWEN3,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
    "Qwen/Qwen3-30B-A3B": {
        **_QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
    },
    "Qwen/Qwen3-235B-A22B": {
        **_QWEN3_MOE,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
    },
}
MOE_EXAMPLES = {  # example -> (model, world size, experts' data parallel, experts per rank per MoE layer)
    "dapo_math_qwen3_30b_a3b.yaml": ("Qwen/Qwen3-30B-A3B", 32, 2, 16),
    "dapo_math_qwen3_235b_a22b.yaml": ("Qwen/Qwen3-235B-A22B", 256, 2, 2),
}

# Yu et al. 2025 (arXiv 2503.14476) section 4.1, and the released verl recipe where the paper is silent.
PAPER_32B = {
    "algorithm.group_size": 16,
    "algorithm.eps_low": 0.2,
    "algorithm.eps_high": 0.28,
    "algorithm.dual_clip_c": None,
    "algorithm.tis_cap": None,
    "algorithm.loss_agg_mode": "token-mean",
    "algorithm.dynamic_sampling": True,
    "algorithm.overlong_punishment": True,
    "algorithm.overlong_buffer_len": 4096,
    "algorithm.overlong_penalty_factor": 1.0,
    "algorithm.overlong_filter": False,
    "rollout.max_response_length": 16384 + 4096,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "data.max_prompt_length": 2048,  # verl recipe
    "sampler.train_batch_size": 512,
    "sampler.gen_batch_size": 3 * 512,  # verl recipe
    "sampler.max_gen_batches": 10,  # verl recipe
    "sampler.mode": "stream",  # the paper: sample until the batch is full, on-policy
    "optim.lr": 1e-6,
    "optim.warmup_steps": 20 * 16,  # 20 rollout steps of 16 optimizer steps; the field counts optimizer steps
    "optim.weight_decay": 0.1,  # verl recipe
    "optim.clip_grad": 1.0,  # verl recipe
    "optim.mini_batch_size": 512,
    "eval.k": 32,
    "eval.temperature": 1.0,
    "eval.top_p": 0.7,
    # the layout this project runs it with
    "parallel.tp": 8,
    "parallel.pp": 2,
    "parallel.cp": 1,
    "parallel.vpp": None,
    "rollout.tp": 8,
    "model.dtype": "bf16",
    "model.recompute": "full",
    "train.max_tokens_per_microbatch": 2048 + 20480,  # one sequence of the longest
}


def header(path: Path) -> dict[str, str]:
    """The '# model: NAME' and '# world_size: N' lines of an example's opening comment block."""
    found = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if m := re.fullmatch(r"# (model|world_size): (\S+)", line.strip()):
            found[m[1]] = m[2]
    return found


def get(cfg: Config, key: str):
    return functools.reduce(getattr, key.split("."), cfg)


def test_the_examples_are_these():
    names = [p.name for p in EXAMPLES]
    assert names == sorted(
        [
            "tiny_cpu.yaml",
            "gsm8k_qwen2.5_1.5b.yaml",
            "dapo_math_qwen2.5_7b.yaml",
            "dapo_math_qwen2.5_32b.yaml",
            "dapo_math_qwen3_8b.yaml",
            "dapo_math_qwen3_32b.yaml",
            "dapo_math_qwen3_30b_a3b.yaml",
            "dapo_math_qwen3_235b_a22b.yaml",
            "seed_notes_qwen2.5_7b.yaml",
            "grpo_kl_ablation.yaml",
            "gspo_math_qwen3_8b.yaml",
            "cispo_math_qwen3_8b.yaml",
        ]
    )


@pytest.mark.parametrize(
    "name, objective",
    [
        ("gspo", {"policy_loss": "gspo", "gspo_eps_low": 3e-4, "gspo_eps_high": 4e-4,
                  "loss_agg_mode": "seq-mean-token-mean"}),
        ("cispo", {"policy_loss": "cispo", "eps_low_is": None, "eps_high_is": 4.0, "loss_agg_mode": "token-mean"}),
    ],
)  # fmt: skip
def test_the_objective_examples_change_only_the_objective(name, objective):
    """GSPO's and CISPO's examples are the Qwen3-8B DAPO example with the papers' objective settings (GSPO's clip
    range and per-response mean; CISPO's cap of 5 and no lower bound) and nothing else changed."""
    dapo = dataclasses.asdict(load_config(REPO / "examples" / "dapo_math_qwen3_8b.yaml"))
    other = dataclasses.asdict(load_config(REPO / "examples" / f"{name}_math_qwen3_8b.yaml"))
    assert {k: other["algorithm"][k] for k in objective} == objective
    for tree in (dapo, other):
        tree["trainer"].pop("run_dir")
        for k in objective:
            tree["algorithm"].pop(k)
    assert other == dapo


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_fits_its_model_and_world_size(path):
    cfg = load_config(path)
    h = header(path)
    assert set(h) == {"model", "world_size"}, f"{path.name}: the comment block needs '# model:' and '# world_size:'"
    arch = ModelArch.from_hf_config(ARCHS[h["model"]], h["model"])
    world_size = int(h["world_size"])
    layout = check_layout(arch, cfg.parallel, cfg.model, world_size)
    # the trainer's own start-up check: whole engines in the world, equal DP shares of a mini-batch
    engine_tp = cfg.rollout.tp or cfg.parallel.tp
    check_distributed(cfg, world_size, layout.dp, engine_tp)
    # vLLM splits whole attention heads over an engine's ranks, and whole KV heads, each on tp / kv ranks when the
    # engine has more ranks than KV heads (vllm/model_executor/models/qwen3_moe.py, layers/linear.py's replicas)
    kv = arch.num_key_value_heads
    assert arch.num_attention_heads % engine_tp == 0
    assert kv % engine_tp == 0 if kv >= engine_tp else engine_tp % kv == 0
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    assert longest <= arch.max_position_embeddings
    assert longest <= cfg.train.max_tokens_per_microbatch  # the memory plan covers the longest sequence


@pytest.mark.parametrize("name, model", [("qwen2.5_32b", "Qwen/Qwen2.5-32B"), ("qwen3_32b", "Qwen/Qwen3-32B")])
def test_32b_example_is_the_papers_run(name, model):
    path = REPO / "examples" / f"dapo_math_{name}.yaml"
    cfg = load_config(path)
    assert {key: get(cfg, key) for key in PAPER_32B} == PAPER_32B
    assert cfg.sampler.train_batch_size * cfg.algorithm.group_size // cfg.optim.mini_batch_size == 16  # updates
    assert header(path)["model"] == model
    arch = ModelArch.from_hf_config(ARCHS[model])
    assert header(path)["world_size"] == "128"  # 16 nodes x 8 GPUs
    assert check_layout(arch, cfg.parallel, cfg.model, 128).dp == 8


PAPER_ALGORITHM = {k: v for k, v in PAPER_32B.items() if k.split(".")[0] not in ("parallel", "rollout", "model")}
"""The paper's algorithm and data values, without the 32B layout (rollout's sampling values are the paper's too)."""


@pytest.mark.parametrize("name", sorted(MOE_EXAMPLES))
def test_moe_example_is_the_papers_run_on_an_expert_parallel_layout(name):
    path = REPO / "examples" / name
    cfg, h = load_config(path), header(path)
    model, world, edp, experts_per_rank = MOE_EXAMPLES[name]
    assert {key: get(cfg, key) for key in PAPER_ALGORITHM} == PAPER_ALGORITHM
    sampling = {k: get(cfg, k) for k in ("rollout.max_response_length", "rollout.temperature", "rollout.top_p")}
    assert sampling == {k: PAPER_32B[k] for k in sampling}
    assert (h["model"], int(h["world_size"])) == (model, world)
    arch = ModelArch.from_hf_config(ARCHS[model], model)
    layout = check_layout(arch, cfg.parallel, cfg.model, world)
    assert (layout.edp, arch.num_experts // layout.ep) == (edp, experts_per_rank)
    assert cfg.model.router_replay == "r3" and cfg.model.recompute == "full" and cfg.parallel.sequence_parallel
    assert cfg.model.moe_aux_loss_coeff == 0.0  # as the peers' MoE RL recipes (config/model.py)
    # the header's launch line, rendered as `launch slurm --print-only` renders it
    assert world % 8 == 0 and f"--nodes {world // 8} " in path.read_text()
    variables, command = sbatch_command(f"examples/{name}", [], cfg, world // 8, 8, [], REPO)
    assert variables["CONFIG"] == f"examples/{name}" and f"--nodes={world // 8}" in command


def test_the_moe_shapes_of_the_flop_and_memory_models_are_the_published_configs():
    """model/perf.py's SHAPES (what tools/estimate_step_time.py --shape and model/memory.py read) against the
    config.json fields above."""
    from megatron_dapo.model.perf import shape_arch

    for shape, model in (("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B"), ("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B")):
        published = ModelArch.from_hf_config(ARCHS[model], model)
        assert shape_arch(shape, 40960) == published


def _keys(node: dict, prefix: str = "") -> list[str]:
    """Every key of a nested mapping, sections and leaves, dotted."""
    keys = []
    for key, value in node.items():
        keys.append(f"{prefix}{key}")
        if isinstance(value, dict):
            keys += _keys(value, f"{prefix}{key}.")
    return keys


def test_a_typo_in_any_key_of_an_example_is_an_error(tmp_path):
    path = REPO / "examples" / "dapo_math_qwen2.5_32b.yaml"  # the example that sets the most keys
    data = yaml.safe_load(path.read_text())
    for key in _keys(data):
        *sections, name = key.split(".")
        bad = copy.deepcopy(data)
        node = functools.reduce(dict.__getitem__, sections, bad)
        node[name + "x"] = node.pop(name)
        f = tmp_path / path.name
        f.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match=re.escape(f"unknown config key '{key}x'; did you mean '{key}'?")):
            load_config(f)


def _fields(cls: type, prefix: str = "") -> list[str]:
    """Every leaf field of the config tree, dotted."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        sub = hints[f.name]
        keys += _fields(sub, f"{prefix}{f.name}.") if dataclasses.is_dataclass(sub) else [f"{prefix}{f.name}"]
    return keys


def test_docs_config_reference_is_current_and_complete():
    tool = tool_module("config_reference")
    assert tool.DEFAULT_TARGET == REPO / "docs" / "config.md"
    page = tool.DEFAULT_TARGET.read_text()
    regenerated = tool.replace_between_markers(page, tool.render())
    assert regenerated == page, (
        "docs/config.md's config reference is stale: python tools/config_reference.py --write docs/config.md"
    )
    missing = [key for key in _fields(Config) if f"| `{key}` |" not in page]
    assert not missing


def test_readme_links_the_config_reference_and_no_longer_holds_it():
    readme = (REPO / "README.md").read_text()
    assert "(docs/config.md)" in readme
    tool = tool_module("config_reference")
    assert tool.BEGIN not in readme and tool.END not in readme


def test_reference_write_replaces_only_the_marked_text(tmp_path):
    tool = tool_module("config_reference")
    f = tmp_path / "config.md"
    f.write_text(f"# Title\n\n{tool.BEGIN}\nstale\n{tool.END}\n\n## After\n")
    tool.main(["--write", str(f)])
    assert f.read_text() == f"# Title\n\n{tool.BEGIN}\n{tool.render()}{tool.END}\n\n## After\n"
    f.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="config-reference:begin"):
        tool.main(["--write", str(f)])


def test_reference_write_without_a_file_targets_docs_config_md(tmp_path, monkeypatch):
    tool = tool_module("config_reference")
    f = tmp_path / "config.md"
    f.write_text(f"{tool.BEGIN}\nstale\n{tool.END}\n")
    monkeypatch.setattr(tool, "DEFAULT_TARGET", f)
    tool.main(["--write"])
    assert f.read_text() == f"{tool.BEGIN}\n{tool.render()}{tool.END}\n"
