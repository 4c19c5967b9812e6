"""HF <-> Megatron conversion tools: bit-exact round trips at TP=1 and TP=2, logits, training checkpoints, errors.

The conversions run through the tools' real command line in subprocesses (Megatron stays out of pytest's
process); their refusals, which come before any model is built, run the tools' main() in the test's process. Tiny models, each converted once (the converter's processes are most of this file's time):
Qwen2 with untied embeddings and QKV bias in one safetensors file at TP=2 (the bias and the vocabulary
sharded), vocabulary 300 so that its padding differs between TP=1 (384) and TP=2 (512) and the TP=2 ->
TP=1 load must reshard the vocabulary too; Llama with tied embeddings in sharded safetensors at TP=1; Qwen3 (per-head
q/k norms, head_dim not hidden/heads, no QKV bias) at TP=2 and at PP=2, its norms replicated or split by layer; a
Qwen3-MoE (a router and 8 experts a layer, saved one expert at a time in sharded safetensors) at TP=2. A
training checkpoint is written by the trainer's own CheckpointManager after one train step at TP=2 (in a
torchrun worker).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from convert_helpers import megatron_logits, run_all_ok, tool_module, training_checkpoint
from megatron_helpers import tiny_hf_model

from megatron_dapo.convert.common import ConvertError, parse_size
from megatron_dapo.convert.resolve import resolve_megatron_checkpoint, training_step_dir
from megatron_dapo.convert.safetensors_io import SafetensorsReader, ShardWriter

FAMILIES = {
    "qwen2": dict(seed=0, vocab_size=300, tied=False, shard=None),
    "llama": dict(seed=1, vocab_size=250, tied=True, shard="100KB"),
    "qwen3": dict(seed=2, vocab_size=300, tied=False, shard=None),
    "qwen3_moe": dict(seed=3, vocab_size=300, tied=False, shard="100KB"),  # experts one by one, over shards
}
# (family, tp, pp). Qwen3 at TP 2 is the MoE case's: its attention (q/k norms, head_dim 32 != hidden / heads) and its
# second layer, dense, are Qwen3's own.
CASES = [("qwen2", 2, 1), ("llama", 1, 1), ("qwen3", 1, 2), ("qwen3_moe", 2, 1)]
TOKENIZER_FILES = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"model_max_length": 64}'}


def _case_id(case: tuple[str, int, int]) -> str:
    return f"{case[0]}-tp{case[1]}" + (f"-pp{case[2]}" if case[2] > 1 else "")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def hf_models(workdir) -> dict[str, tuple[Path, torch.nn.Module]]:
    """family -> (HF directory with weights, config, generation config and tokenizer files; the model)."""
    out = {}
    for family, spec in FAMILIES.items():
        model = tiny_hf_model(family, seed=spec["seed"], vocab_size=spec["vocab_size"], tied=spec["tied"])
        path = workdir / f"hf_{family}"
        model.save_pretrained(path, **({"max_shard_size": spec["shard"]} if spec["shard"] else {}))
        for name, text in TOKENIZER_FILES.items():
            (path / name).write_text(text)
        out[family] = (path, model)
    return out


@pytest.fixture(scope="module")
def megatron_ckpts(hf_models, workdir) -> dict[tuple[str, int, int], tuple[Path, str]]:
    """(family, tp, pp) -> (converted Megatron checkpoint directory, the tool's stdout)."""
    paths, runs = {}, []
    for family, tp, pp in CASES:
        path = paths[(family, tp, pp)] = workdir / f"mcore_{_case_id((family, tp, pp))}"
        force = []
        if (family, tp, pp) == ("llama", 1, 1):  # --force replaces an existing directory's contents
            path.mkdir()
            (path / "stale.txt").write_text("old")
            force = ["--force"]
        args = ["--hf", str(hf_models[family][0]), "--out", str(path), "--dtype", "fp32", *force]
        args += ["--tp", str(tp), "--pp", str(pp)]
        runs.append(("convert_hf_to_megatron", args))
    stdouts = run_all_ok(runs)
    return {case: (paths[case], out) for case, out in zip(CASES, stdouts)}


@pytest.fixture(scope="module")
def hf_back(megatron_ckpts, workdir) -> dict[tuple[str, int, int], Path]:
    """(family, tp, pp) -> Hugging Face directory converted back from the Megatron checkpoint (at TP=1, PP=1)."""
    paths, alone, together = {}, [], []
    for case, (ckpt, _) in megatron_ckpts.items():
        path = paths[case] = workdir / f"back_{_case_id(case)}"
        args = ["--megatron", str(ckpt), "--out", str(path)]
        if case == ("qwen2", 2, 1):  # the tool's own process, writing shards
            alone.append(("convert_megatron_to_hf", [*args, "--max-shard-size", "100KB"]))
        else:  # the others in one process beside it: each conversion starts and ends its own world
            together.append(args)
    run_all_ok([*alone, ("convert_megatron_to_hf", together)])
    return paths


# ---------------------------------------------------------------- round trips


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_round_trip_is_bit_exact(case, hf_models, hf_back):
    src, model = hf_models[case[0]]
    original, back = SafetensorsReader(src), SafetensorsReader(hf_back[case])
    assert set(back) == set(original)
    assert ("lm_head.weight" in back) == (not FAMILIES[case[0]]["tied"])
    for name in original:
        assert back[name].dtype == torch.float32, name
        assert torch.equal(back[name], original[name]), name
    # everything but the weights came along
    for name in ("generation_config.json", *TOKENIZER_FILES):
        assert (hf_back[case] / name).read_bytes() == (src / name).read_bytes(), name
    # config.json is rewritten only to declare the written dtype, float32 here as in the source
    assert json.loads((hf_back[case] / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert not (hf_back[case] / "megatron_dapo.json").exists()


@pytest.mark.slow
def test_sharded_output_has_an_index(hf_back):
    sharded, single = hf_back[("qwen2", 2, 1)], hf_back[("llama", 1, 1)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((sharded / f).is_file() for f in files)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in SafetensorsReader(sharded).values())
    assert (single / "model.safetensors").is_file() and not (single / "model.safetensors.index.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_transformers_loads_the_result(case, hf_models, hf_back):
    from transformers import AutoModelForCausalLM

    _, model = hf_models[case[0]]
    moe = {"experts_implementation": "eager"} if case[0] == "qwen3_moe" else {}  # the reference's loop over experts
    loaded = AutoModelForCausalLM.from_pretrained(hf_back[case], dtype=torch.float32, **moe).eval()
    assert loaded.config.tie_word_embeddings == FAMILIES[case[0]]["tied"]
    tokens = torch.randint(0, FAMILIES[case[0]]["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


@pytest.mark.slow
def test_megatron_logits_match_transformers(hf_models, megatron_ckpts, workdir):
    tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = megatron_logits([path for path, _ in megatron_ckpts.values()], tokens, workdir / "logits.pt")
    for (family, tp, pp), (path, _) in megatron_ckpts.items():
        with torch.no_grad():
            expected = hf_models[family][1](tokens).logits
        msg = f"{family} saved at tp={tp} pp={pp}"
        torch.testing.assert_close(logits[str(path)], expected, atol=1e-5, rtol=0, msg=msg)


@pytest.mark.slow
def test_checkpoint_directory(hf_models, megatron_ckpts):
    path, stdout = megatron_ckpts[("qwen2", 2, 1)]
    meta = json.loads((path / "megatron_dapo.json").read_text())
    assert (meta["family"], meta["tp"], meta["pp"], meta["dtype"]) == ("qwen2", 2, 1, "fp32")
    assert meta["source"] == str(hf_models["qwen2"][0].absolute()) and meta["format_version"] == 1
    assert (path / "model" / "metadata.json").is_file()
    for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
        assert (path / name).read_bytes() == (hf_models["qwen2"][0] / name).read_bytes(), name
    assert not list(path.glob("*.safetensors"))
    for stage in (
        "checked",
        "1 safetensors file(s)",
        "launching 2 processes",
        "built qwen2 model",
        "read the HF tensors",
        "saved dist checkpoint",
        "done",
    ):
        assert stage in stdout, stage
    forced, stdout = megatron_ckpts[("llama", 1, 1)]
    assert "4 safetensors file(s)" in stdout  # the sharded input
    assert not (forced / "stale.txt").exists()


# ---------------------------------------------------------------- training checkpoints


@pytest.fixture(scope="module")
def training_run(hf_models, workdir) -> tuple[Path, dict[str, torch.Tensor]]:
    """(run directory as megatron_dapo.train leaves it, the weights its checkpoint holds as HF tensors).

    The Qwen2 model trained one DAPO step at TP=2 (lr 1e-2, so every tensor moves), saved as
    run/checkpoints/step_00000001 with run/config.yaml naming the HF model in model.hf_path.
    """
    run = workdir / "run"
    trained = training_checkpoint(hf_models["qwen2"][0], run, workdir / "trained.pt", 2, "parallel.tp=2")
    return run, trained


@pytest.mark.slow
def test_a_training_run_converts_to_the_weights_its_checkpoint_holds(training_run, hf_models, workdir):
    run, trained = training_run
    src = hf_models["qwen2"][0]
    out = workdir / "back_training"
    (stdout,) = run_all_ok([("convert_megatron_to_hf", ["--megatron", str(run), "--out", str(out)])])
    assert "training checkpoint step_00000001, saved by 2 rank(s) at tp=2 pp=1" in stdout
    back, original = SafetensorsReader(out), SafetensorsReader(src)
    assert set(back) == set(trained) == set(original)
    for name, tensor in trained.items():
        assert back[name].dtype == torch.float32, name
        assert torch.equal(back[name], tensor), name
        assert not torch.equal(tensor, original[name]), name  # trained: not just the HF weights again
    # config.json, generation config and tokenizer from the HF model the run's config.yaml names
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for name in ("generation_config.json", *TOKENIZER_FILES):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert not (out / "megatron_dapo.json").exists()


@pytest.mark.slow
def test_which_training_step_is_converted_and_refusals(training_run, hf_models, megatron_ckpts, tmp_path, run_main):
    run, _ = training_run
    src = hf_models["qwen2"][0]
    step1 = run / "checkpoints" / "step_00000001"
    for path in (run, run / "checkpoints", step1):
        source = resolve_megatron_checkpoint(path)
        assert (source.step, source.dist_dir, source.hf_dir, source.dtype) == (step1, step1 / "dist", src, "fp32")
        assert source.arch.family == "qwen2"

    # checkpoints of a run without config.yaml: steps 1 and 2 complete, 3 interrupted mid-save
    ckpts = tmp_path / "checkpoints"
    for n in (1, 2, 3):
        shutil.copytree(step1, ckpts / f"step_{n:08d}")
    (ckpts / "step_00000003" / "COMPLETE").unlink()
    assert training_step_dir(ckpts) == ckpts / "step_00000002"  # no `latest`: the newest complete one
    (ckpts / "latest").write_text("step_00000001\n")
    assert training_step_dir(ckpts) == ckpts / "step_00000001"  # `latest` names it
    source = resolve_megatron_checkpoint(ckpts, src)
    assert (source.step, source.hf_dir) == (ckpts / "step_00000001", src)
    assert source.saved == "training checkpoint step_00000001, saved by 2 rank(s)"  # no run config: no layout

    def error(path, hf_config=None) -> str:
        with pytest.raises(ConvertError) as e:
            resolve_megatron_checkpoint(path, hf_config)
        return str(e.value)

    msg = error(ckpts / "step_00000003", src)
    assert f"{ckpts / 'step_00000003'} is an incomplete training checkpoint" in msg and "COMPLETE" in msg
    msg = error(ckpts)
    assert str(ckpts / "step_00000001") in msg and str(tmp_path / "config.yaml") in msg and "--hf-config" in msg
    msg = error(ckpts, tmp_path)
    assert f"--hf-config names {tmp_path}, which has no config.json" in msg
    assert "--hf-config is for training checkpoints" in error(megatron_ckpts[("llama", 1, 1)][0], src)
    for n in (1, 2):
        (ckpts / f"step_{n:08d}" / "COMPLETE").unlink()
    msg = error(ckpts, src)
    assert f"{ckpts} holds no complete training checkpoint" in msg and "step_00000003" in msg
    assert training_step_dir(tmp_path / "elsewhere") is None

    # through the command line: one 'error:' line naming the checkpoint and what to pass
    (ckpts / "step_00000002" / "COMPLETE").write_text("2\n")
    err = _fails(run_main, "convert_megatron_to_hf", "--megatron", str(ckpts), "--out", str(tmp_path / "out"))
    assert err.startswith("error: ") and str(ckpts / "step_00000002") in err and "--hf-config" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- refusals and errors


def _fails(run_main, tool: str, *args: str) -> str:
    """The tool's one `error:` line (its main() in this process: the checks come before a model is built)."""
    code, err = run_main(tool_module(tool).main, list(args))
    assert code == 1 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.slow
def test_refuses_a_non_empty_output_without_force(hf_models, megatron_ckpts, tmp_path, run_main):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", str(hf_models["qwen2"][0]), "--out", str(out))
    assert "not empty" in err and "--force" in err
    llama = str(megatron_ckpts[("llama", 1, 1)][0])
    err = _fails(run_main, "convert_megatron_to_hf", "--megatron", llama, "--out", str(out))
    assert "not empty" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"
    src = hf_models["qwen2"][0]  # --force never deletes the input
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", str(src), "--out", str(src), "--force")
    assert "input directory" in err


def _copy_without(src: Path, dst: Path, *names: str) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*names))
    return dst


def test_missing_files(hf_models, tmp_path, run_main):
    src = hf_models["qwen2"][0]
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o1"))
    assert "nowhere" in err and "no such directory" in err
    no_config = _copy_without(src, tmp_path / "no_config", "config.json")
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", str(no_config), "--out", str(tmp_path / "o2"))
    assert "config.json" in err
    no_weights = _copy_without(src, tmp_path / "no_weights", "*.safetensors")
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", str(no_weights), "--out", str(tmp_path / "o3"))
    assert "no *.safetensors" in err and "no_weights" in err
    err = _fails(run_main, "convert_megatron_to_hf", "--megatron", str(src), "--out", str(tmp_path / "o4"))
    assert "not a megatron-dapo checkpoint" in err and "megatron_dapo.json" in err


def test_unsupported_architecture(tmp_path, run_main):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "gpt2")
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "out"))
    assert "GPT2LMHeadModel" in err and "architectures" in err and "config.json" in err


def test_a_sliding_window_qwen3_is_refused_naming_the_field(hf_models, tmp_path, run_main):
    src = _copy_without(hf_models["qwen3"][0], tmp_path / "sliding")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 16}))
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", str(src), "--out", str(tmp_path / "out"))
    assert "config.json: field 'use_sliding_window'=true is not supported" in err
    assert not (tmp_path / "out").exists()


def test_tensor_shape_mismatch_and_missing_tensor(hf_models, tmp_path, run_main):
    from safetensors.torch import save_file

    src = hf_models["qwen2"][0]
    tensors = dict(SafetensorsReader(src))
    bad = _copy_without(src, tmp_path / "bad", "*.safetensors")
    save_file({**tensors, "model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)}, bad / "model.safetensors")
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", str(bad), "--out", str(tmp_path / "o1"))
    assert "model.layers.1.self_attn.k_proj.weight" in err and "(16, 64)" in err and "(32, 64)" in err

    missing = _copy_without(src, tmp_path / "missing", "*.safetensors")
    tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, missing / "model.safetensors")
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", str(missing), "--out", str(tmp_path / "o2"))
    assert "model.layers.0.mlp.up_proj.weight" in err


def test_tp_must_divide_the_query_groups(hf_models, tmp_path, run_main):
    src = str(hf_models["qwen2"][0])
    err = _fails(run_main, "convert_hf_to_megatron", "--hf", src, "--out", str(tmp_path / "o"), "--tp", "4")
    assert "parallel.tp=4" in err and "2 query groups" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("tool", ["convert_hf_to_megatron", "convert_megatron_to_hf"])
def test_help(tool, capsys):
    with pytest.raises(SystemExit) as done:
        tool_module(tool).main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    flags = ("--hf", "--tp", "--pp") if "hf_to" in tool else ("--megatron", "--hf-config")
    for flag in ("--out", "--dtype", "--force", *flags):
        assert flag in out, flag
    if tool == "convert_megatron_to_hf":
        assert "--max-shard-size" in out


# ---------------------------------------------------------------- helpers in process


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1000") == 1000
    with pytest.raises(ConvertError, match="not understood"):
        parse_size("big")


def test_shard_writer_gives_an_oversized_tensor_its_own_shard(tmp_path):
    writer = ShardWriter(tmp_path, max_shard_bytes=100, dtype=torch.bfloat16)
    base = torch.arange(80, dtype=torch.float32)
    writer.add("a", base[:10])  # views of one storage: the writer copies, safetensors refuses shared memory
    writer.add("big", base)  # 160 bytes in bf16, over the limit
    writer.add("b", base[10:20])
    files = writer.close()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    back = SafetensorsReader(tmp_path)
    assert back["big"].dtype == torch.bfloat16 and torch.equal(back["big"].float(), base)
    assert writer.total_bytes == 200
