"""The config tree: the paper's defaults, YAML + dotted overrides, and clear errors."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from megatron_dapo import config as config_module
from megatron_dapo.config import Config, ConfigError, load_config, to_yaml


def test_defaults_are_the_papers():
    cfg = load_config()
    a = cfg.algorithm
    assert (a.eps_low, a.eps_high, a.group_size) == (0.2, 0.28, 16)
    assert a.loss_agg_mode == "token-mean" and a.dynamic_sampling and a.dual_clip_c is None
    assert (cfg.rollout.max_response_length, a.overlong_buffer_len, a.overlong_penalty_factor) == (20480, 4096, 1.0)
    assert cfg.rollout.max_response_length - a.overlong_buffer_len == 16384
    assert cfg.sampler.train_batch_size == 512
    assert not cfg.sampler.skip  # prompt memory changes which prompts are sampled: off in the paper's recipe
    o = cfg.optim
    assert (o.lr, o.warmup_steps, o.weight_decay, o.clip_grad) == (
        1e-6,
        20 * 16,
        0.1,
        1.0,
    )  # warm-up: 20 rollout steps x 16 updates
    # 512 prompts x 16 responses in mini-batches of 512 responses: 16 optimizer steps per rollout step
    assert cfg.sampler.train_batch_size * a.group_size // o.mini_batch_size == 16


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "algorithm:\n  eps_high: 0.3\n  group_size: 8\nsampler:\n  train_batch_size: 4\ndata:\n  train_files: [a.jsonl]\n"
    )
    cfg = load_config(f, ["algorithm.eps_high=0.35", "optim.mini_batch_size=8", "data.val_files=[v.parquet]"])
    assert cfg.algorithm.eps_high == 0.35  # the command line wins over the file
    assert cfg.algorithm.group_size == 8 and cfg.sampler.train_batch_size == 4
    assert cfg.data.train_files == ["a.jsonl"] and cfg.data.val_files == ["v.parquet"]
    assert cfg.algorithm.eps_low == 0.2  # untouched fields keep the defaults
    assert isinstance(cfg, Config)


def test_yaml_round_trip(tmp_path):
    cfg = load_config(overrides=["algorithm.dual_clip_c=10", "algorithm.tis_cap=2.0"])
    f = tmp_path / "dump.yaml"
    f.write_text(to_yaml(cfg))
    assert load_config(f) == cfg


@pytest.mark.parametrize(
    "yaml_text, needle",
    [
        (
            "algorithm:\n  eps_hgih: 0.3\n",
            "unknown config key 'algorithm.eps_hgih'; did you mean 'algorithm.eps_high'?",
        ),
        ("algoritm:\n  eps_high: 0.3\n", "unknown config key 'algoritm'; did you mean 'algorithm'?"),
        ("algorithm: 3\n", "'algorithm' is a section; expected a mapping"),
        ("algorithm:\n  group_size: many\n", "algorithm.group_size"),
        ("algorithm:\n  eps_low: -0.1\n", "algorithm.eps_low=-0.1: expected a value in [0, 1)"),
        ("algorithm:\n  group_size: 1\n", "algorithm.group_size=1: expected an integer >= 2"),
        ("algorithm:\n  overlong_buffer_len: 30000\n", "algorithm.overlong_buffer_len=30000"),
        ("algorithm:\n  loss_agg_mode: mean\n", "algorithm.loss_agg_mode='mean': expected one of"),
        ("sampler:\n  mode: greedy\n", "sampler.mode='greedy'"),
        ("optim:\n  mini_batch_size: 500\n", "a divisor of sampler.train_batch_size x algorithm.group_size = 8192"),
        ("- a\n- b\n", "expected a mapping at the top level"),
        ("algorithm: [unclosed\n", "is not valid YAML"),
    ],
)
def test_bad_yaml_is_a_clear_error(tmp_path, yaml_text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("algorithm.eps_hihg=0.3", "command-line override: unknown config key 'algorithm.eps_hihg'; did you mean"),
        ("algorithm.eps_high", "expected KEY=VALUE"),
        ("algorithm.eps_high=-1", "algorithm.eps_high=-1.0: expected a value >= 0"),
        ("algorithm.dual_clip_c=0.5", "algorithm.dual_clip_c=0.5: expected a value > 1"),
        ("rollout.max_response_length=1024", "algorithm.overlong_buffer_len=4096: expected an integer in [1, "),
        ("algorithm.group_size=abc", "algorithm.group_size"),
        ("reward.verifier=sympy", "reward.verifier='sympy'"),
        ("sampler.max_gen_batches=-1", "sampler.max_gen_batches=-1"),
        ("sampler.skip_target=0", "sampler.skip_target=0.0: expected a fraction in (0, 1]"),
        ("sampler.skip_min_explore=1.5", "sampler.skip_min_explore=1.5: expected a value in (0, 1]"),
        ("sampler.skip_adapt=0", "sampler.skip_adapt=0.0: expected a value in (0, 1]"),
        ("sampler.skip_max_consecutive=-1", "sampler.skip_max_consecutive=-1: expected an integer >= 0"),
        ("rollout.quantization=int4", "rollout.quantization='int4': expected one of ('none', 'fp8')"),
        ("rollout.quantization_tis_cap=0", "rollout.quantization_tis_cap=0.0: expected a value > 0, or null"),
    ],
)
def test_bad_override_is_a_clear_error(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert needle in str(e.value)


def test_fp8_rollouts_turn_truncated_is_on_unless_told_otherwise():
    assert load_config().tis_cap() is None  # the paper: no rollout correction
    assert load_config(overrides=["rollout.quantization=fp8"]).tis_cap() == 2.0
    assert load_config(overrides=["rollout.quantization=fp8", "rollout.quantization_tis_cap=3"]).tis_cap() == 3.0
    assert load_config(overrides=["rollout.quantization=fp8", "algorithm.tis_cap=1.5"]).tis_cap() == 1.5
    assert load_config(overrides=["rollout.quantization_tis_cap=3"]).tis_cap() is None  # only with FP8
    # FP8 rollouts and partial rollout need a correction: FP8's default cap is one
    load_config(overrides=["sampler.partial_rollout=true", "rollout.quantization=fp8"])
    for needs in ("sampler.partial_rollout=true", "rollout.quantization=fp8"):
        with pytest.raises(ConfigError, match=f"algorithm.tis_cap=None: expected a correction .* with {needs}"):
            load_config(overrides=[needs, "rollout.quantization_tis_cap=null"])
        with pytest.raises(ConfigError, match=f"algorithm.rollout_correction='none': expected a correction .*{needs}"):
            load_config(overrides=[needs, "algorithm.rollout_correction=none"])
        load_config(overrides=[needs, "rollout.quantization_tis_cap=null", "algorithm.rollout_correction=icepop"])


def test_the_rollout_correction_in_force_and_its_bounds():
    """null: token_tis with a cap in force, else none; each mode with its own bounds; the *_tis modes need a cap."""

    def correction(*overrides):
        return tuple(load_config(overrides=list(overrides)).rollout_correction())

    assert correction() == ("none", None, None)  # the paper: no rollout correction
    assert correction("algorithm.tis_cap=1.5") == ("token_tis", None, 1.5)
    assert correction("rollout.quantization=fp8") == ("token_tis", None, 2.0)
    assert correction("algorithm.rollout_correction=seq_tis", "algorithm.tis_cap=3") == ("seq_tis", None, 3.0)
    assert correction("algorithm.rollout_correction=token_mask") == ("token_mask", 0.5, 2.0)
    assert correction("algorithm.rollout_correction=seq_mask", "algorithm.rollout_mask_high=1.5") == (
        "seq_mask", 0.5, 1.5)  # fmt: skip
    assert correction("algorithm.rollout_correction=icepop") == ("icepop", 0.5, 5.0)
    assert correction("algorithm.rollout_correction=none", "algorithm.tis_cap=2") == ("none", None, None)
    with pytest.raises(ConfigError, match="algorithm.tis_cap=None: expected a cap > 0 .*rollout_correction=seq_tis"):
        load_config(overrides=["algorithm.rollout_correction=seq_tis"])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algorithm.policy_loss=ppo"], "algorithm.policy_loss='ppo': expected one of ('dapo', 'gspo', "),
        (["algorithm.rollout_correction=clip"], "algorithm.rollout_correction='clip': expected one of ("),
        (
            ["algorithm.policy_loss=gspo", "algorithm.loss_impl=fused"],
            "algorithm.loss_impl='fused': expected 'auto' or 'reference' with policy_loss='gspo'",
        ),
        (
            ["algorithm.policy_loss=cispo", "algorithm.dual_clip_c=3"],
            "algorithm.dual_clip_c=3.0: expected null with policy_loss='cispo'",
        ),
        (["algorithm.icepop_high=0.4"], "algorithm.icepop_high=0.4: expected a ratio above algorithm.icepop_low=0.5"),
        (["algorithm.rollout_mask_low=-1"], "algorithm.rollout_mask_low=-1.0: expected a ratio >= 0"),
        (["algorithm.gspo_eps_low=1"], "algorithm.gspo_eps_low=1.0: expected a value in [0, 1)"),
        (["algorithm.eps_low_is=2"], "algorithm.eps_low_is=2.0: expected a value in [0, 1], or null"),
        (["parallel.cp=2", "algorithm.policy_loss=gspo"], "parallel.cp=2: expected 1 with algorithm.policy_loss=gspo"),
        (
            ["parallel.cp=2", "algorithm.loss_agg_mode=seq-mean-token-mean", "algorithm.policy_loss=gspo_token"],
            "parallel.cp=2: expected 1 with algorithm.loss_agg_mode=seq-mean-token-mean and policy_loss=gspo_token",
        ),
    ],
)
def test_objective_and_correction_settings_that_cannot_run_are_refused(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert needle in str(e.value)


def test_each_objective_reads_its_own_bounds():
    assert load_config().algorithm.clip_bounds() == (0.2, 0.28)
    assert load_config(overrides=["algorithm.policy_loss=gspo"]).algorithm.clip_bounds() == (3e-4, 4e-4)
    assert load_config(overrides=["algorithm.policy_loss=gspo_token"]).algorithm.clip_bounds() == (3e-4, 4e-4)
    assert load_config(overrides=["algorithm.policy_loss=cispo"]).algorithm.clip_bounds() == (None, 4.0)


def test_engines_run_in_lockstep_unless_async_already_depends_on_timing():
    assert load_config().lockstep()  # colocated: reproducible
    async_ = ["pipeline.mode=async", "sampler.partial_rollout=true", "algorithm.tis_cap=2"]
    assert load_config(overrides=[*async_, "sampler.max_staleness=0"]).lockstep()  # eta 0: the colocated steps
    assert not load_config(overrides=async_).lockstep()  # eta 1 (the default)
    assert load_config(overrides=[*async_, "sampler.lockstep=true"]).lockstep()
    assert not load_config(overrides=["sampler.lockstep=false"]).lockstep()
    with pytest.raises(ConfigError, match="sampler.lockstep"):
        load_config(overrides=["sampler.lockstep=sometimes"])


def test_the_excess_overlong_shape_s_soft_maximum():
    cfg = load_config(overrides=["algorithm.overlong_shape=excess"])
    assert cfg.overlong_soft_max() == 20480 - 4096  # where the paper's ramp starts
    assert (
        load_config(
            overrides=["algorithm.overlong_shape=excess", "algorithm.overlong_soft_max=8000"]
        ).overlong_soft_max()
        == 8000
    )
    with pytest.raises(
        ConfigError, match=r"algorithm.overlong_soft_max=20480: expected a soft maximum in \[1, rollout"
    ):
        load_config(overrides=["algorithm.overlong_shape=excess", "algorithm.overlong_soft_max=20480"])
    with pytest.raises(ConfigError, match="algorithm.overlong_shape='linear': expected one of"):
        load_config(overrides=["algorithm.overlong_shape=linear"])
    with pytest.raises(ConfigError, match="algorithm.adv_norm='mean': expected one of"):
        load_config(overrides=["algorithm.adv_norm=mean"])


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/run.yaml")


def test_user_verifier_path_is_accepted():
    assert load_config(overrides=["reward.verifier=mypkg.rewards:score"]).reward.verifier == "mypkg.rewards:score"


def test_every_field_is_documented():
    """Each dataclass field is followed by its docstring: the config reference is generated from them."""
    sections = [
        cls
        for _, cls in inspect.getmembers(config_module, dataclasses.is_dataclass)
        if cls.__module__.startswith(f"{config_module.__name__}.")  # the package's own, one module per section
    ]
    assert len(sections) == len(dataclasses.fields(Config))  # the root and its sections (every field but seed)
    for cls in sections:
        docs = config_module.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{cls.__name__}.{f.name} has no docstring"


def test_the_allowed_values_live_in_choices():
    """No list of string literals in the config package (a loop over field names and __all__ aside): every field's
    allowed values are in megatron_dapo.choices, where the modules that act on them import them from."""
    for path in sorted(Path(config_module.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        exempt = {id(node.iter) for node in ast.walk(tree) if isinstance(node, ast.For)}
        exempt |= {
            id(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__"
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in exempt and len(node.elts) >= 2:
                strings = all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
                assert not strings, f"{path.name}:{node.lineno}: allowed values belong in megatron_dapo/choices.py"


@pytest.mark.parametrize("module", ["megatron_dapo.config", "megatron_dapo.train"])
def test_reading_a_config_loads_no_heavy_library(module):
    """The config is a leaf (its allowed values live in megatron_dapo.choices), and the trainer's entry point sets
    the libraries' log levels before torch loads: neither import may pull in torch, Triton or the verifiers."""
    import subprocess
    import sys

    heavy = ("torch", "triton", "math_verify", "sympy", "vllm", "megatron.core")
    code = f"import sys, {module}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} loads {out.stdout.strip()}"


def test_no_module_lists_allowed_values_again():
    """Outside megatron_dapo.choices, no literal tuple, list or set of two or more strings that are all allowed values
    of one of its lists (a sampler mode, a verifier, a dtype...): a second copy of such a list drifts from the first."""
    from megatron_dapo import choices

    allowed = {k: set(v) for k, v in vars(choices).items() if k.isupper() and isinstance(v, tuple)}
    root = Path(choices.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if path.name == "choices.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set)) or len(node.elts) < 2:
                continue
            if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                names = {e.value for e in node.elts}
                again = [k for k, v in allowed.items() if names <= v]
                where = f"{path.relative_to(root.parent)}:{node.lineno}"
                assert not again, f"{where}: {sorted(names)} are values of choices.{again[0]}: import them from there"
