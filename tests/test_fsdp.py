"""FSDP (torch fully_shard) on two CPU processes (gloo): full fine-tuning with EMA gives the same
weights as one process over the same samples and resumes exactly; a process without micro-batches
joins the other's forwards (no deadlock, same update); bad settings stop with exit code 2.

"The same weights" is the comparison of tests/helpers/compare.py: runs trained with plain SGD and
a continuous reward end at most REL of their update apart. Not with AdamW: there Diffusion-DPO
under FSDP and under plain data parallelism end 1.6e-3 apart on one LoRA A element (lr 1e-2). Its
gradient is exactly zero at the first step (LoRA B starts at zero), then rounding noise at the
second: -1.6e-9 vs +1.8e-9, where the largest element is 0.13. AdamW normalises that noise into
steps of +7.4e-4 and -8.3e-4."""

import json
import os

import pytest
import torch

from diffalign.cli import main as cli_main
from tests.helpers.compare import COMPARABLE, FLOW_GRPO, OTHER_ALGORITHMS, REL, SHORT_RUN, assert_same_update, weights
from tests.helpers.launch import accelerate_launch, launch as run, start_run
from tests.helpers.tiny_run import train_records

# SGD steps are lr x gradient: lr 2 moves the full fine-tuning's EMA weights by ~1.5e-3 in three iterations
COMMON = ["configs/tiny/flow_grpo_sd3.yaml", "log.progress_bar=false", "log.report=false", "eval.at_start=false",
          "sampling.eval_num_steps=2", "optim.lr=2", "train.batch_size=64", *COMPARABLE]
FULL_FT = ["lora.enabled=false", "train.ema.enabled=true", "train.ema.every=1", "checkpoint.every=1"]


def test_fsdp_full_finetuning_matches_one_process_and_resumes_exactly(repo_root, tmp_path):
    start, one, two, part = tmp_path / "start", tmp_path / "one", tmp_path / "two", tmp_path / "part"
    train = ["-m", "diffalign.cli", "train", *COMMON, *FULL_FT]
    start_run([*train, "rollout.prompts_per_iteration=2"], start)
    run([*train, f"output_dir={one}", "max_iterations=3", "rollout.prompts_per_iteration=2"], repo_root)
    fsdp = ["rollout.prompts_per_iteration=1", "train.fsdp=true"]
    res = run([*train, f"output_dir={two}", "max_iterations=3", *fsdp], repo_root, nproc=2)
    assert "FSDP: 3 units over 2 processes" in res.stderr
    merged = "final/transformer/diffusion_pytorch_model.safetensors"  # the merged pipeline (EMA weights)
    b = weights(two, merged)
    assert_same_update(weights(start, merged), weights(one, merged), b, rel=REL, min_update=5e-4)
    assert [r["reward_mean"] for r in train_records(two)] == pytest.approx([r["reward_mean"] for r in train_records(one)], rel=1e-3)
    # interrupted after 2 iterations, resumed to 3: the full optimizer, EMA and weights were saved and re-sharded
    run([*train, f"output_dir={part}", "max_iterations=2", *fsdp], repo_root, nproc=2)
    run(["-m", "diffalign.cli", "resume", str(part), "max_iterations=3"], repo_root, nproc=2)
    c = weights(part, merged)
    for k in b:
        torch.testing.assert_close(b[k], c[k], rtol=1e-6, atol=1e-7)
    assert [r["reward_mean"] for r in train_records(two)] == [r["reward_mean"] for r in train_records(part)]


def test_fsdp_process_without_micro_batches_joins_the_others(repo_root, tmp_path):
    start, one, two = tmp_path / "start", tmp_path / "one", tmp_path / "two"
    settings = [*COMPARABLE, "optim.lr=50"]  # Flow-GRPO's gradients are ~1e-4: weights move by ~1e-2
    start_run(["tests/fsdp_worker.py", "rollout.prompts_per_iteration=2", *settings], start)
    run(["tests/fsdp_worker.py", str(one), "rollout.prompts_per_iteration=2", *settings], repo_root)
    run(["tests/fsdp_worker.py", str(two), "rollout.prompts_per_iteration=1", "train.fsdp=true", *settings], repo_root, nproc=2)
    # trained on the first half only
    assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)


@pytest.mark.parametrize("config, overrides, key", [
    ("configs/tiny/flow_grpo_sd3.yaml", ["train.fsdp=true", "train.zero_stage=2"], "train.fsdp"),
    ("configs/tiny/branch_grpo_sd3.yaml", ["train.fsdp=true"], "train.fsdp"),
])
def test_bad_fsdp_settings_exit_2(tmp_path, capsys, config, overrides, key):
    out = tmp_path / "run"
    code = cli_main(["train", config, f"output_dir={out}", "max_iterations=1", "log.progress_bar=false", *overrides])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and key in err
    assert not out.exists()


def test_fsdp_accelerate_config_makes_an_fsdp_run(monkeypatch):
    """A launch with the shipped configs/accelerate/fsdp.yaml is an FSDP run for diffalign: the
    environment accelerate's launcher derives from the file turns FSDP on without train.fsdp, and
    ZeRO next to it is refused."""
    # accelerate's own launch path: parse, validate against the config file, build the environment
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    from diffalign import distributed
    from diffalign.config_files import load_config
    from diffalign.errors import ConfigError

    args = launch_command_parser().parse_args(["--config_file", "configs/accelerate/fsdp.yaml", "train.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    cfg = load_config("configs/tiny/flow_grpo_sd3.yaml")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not distributed.fsdp_requested(cfg.train.fsdp, cfg.train.zero_stage)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert distributed.fsdp_requested(cfg.train.fsdp, cfg.train.zero_stage)
    cfg.train.zero_stage = 2
    with pytest.raises(ConfigError, match="exclude each other"):
        distributed.fsdp_requested(cfg.train.fsdp, cfg.train.zero_stage)


def _launch_env(monkeypatch, launcher: list[str]) -> None:
    """The environment accelerate's launcher gives its processes for ``launcher`` (its flags), set here."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    for key in [k for k in os.environ if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"]:
        monkeypatch.delenv(key)
    args = launch_command_parser().parse_args([*launcher, "train.py"])
    for key, value in prepare_multi_gpu_env(_validate_launch_command(args)[0]).items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("launcher, reshard", [
    (["--config_file", "configs/accelerate/fsdp.yaml"], True),
    (["--config_file", "configs/accelerate/cpu_fsdp2.yaml"], True),
    (["--config_file", "configs/accelerate/cpu_fsdp2.yaml", "--fsdp_reshard_after_forward", "false"], False),
])
def test_fsdp2_settings_come_from_the_accelerate_config(monkeypatch, launcher, reshard):
    from diffalign import distributed

    _launch_env(monkeypatch, launcher)
    assert distributed.fsdp_requested(False) and distributed.fsdp_settings().reshard_after_forward is reshard


@pytest.mark.parametrize("launcher, key", [
    (["--use_fsdp", "--num_processes", "2"], "fsdp_version 1"),  # accelerate's default version
    (["--config_file", "configs/accelerate/cpu_fsdp2.yaml", "--fsdp_version", "1"], "fsdp_version 1"),
    (["--config_file", "configs/accelerate/cpu_fsdp2.yaml", "--fsdp_offload_params", "true"], "fsdp_offload_params"),
    (["--config_file", "configs/accelerate/cpu_fsdp2.yaml", "--fsdp_activation_checkpointing", "true"], "train.gradient_checkpointing"),
])
def test_fsdp_settings_diffalign_does_not_apply_exit_2(tmp_path, capsys, monkeypatch, launcher, key):
    """An accelerate FSDP config that asks for FSDP1 or for what diffalign's FSDP2 does not do stops
    with one line (a single process reads the settings too, before anything is trained)."""
    _launch_env(monkeypatch, launcher)
    out = tmp_path / "run"
    code = cli_main(["train", "configs/tiny/flow_grpo_sd3.yaml", f"output_dir={out}", "max_iterations=1", "log.progress_bar=false"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and key in err


def test_fsdp2_accelerate_launch_matches_one_process(repo_root, tmp_path, flow_grpo_reference):
    """accelerate launch with configs/accelerate/cpu_fsdp2.yaml (FSDP2 over two gloo processes, each
    block's weights kept gathered from forward to backward) trains the same update as one process."""
    (start, one), two = flow_grpo_reference, tmp_path / "fsdp2"
    res = accelerate_launch(["--config_file", "configs/accelerate/cpu_fsdp2.yaml", "--fsdp_reshard_after_forward", "false"],
                            ["-m", "diffalign.cli", "train", *FLOW_GRPO, f"output_dir={two}", "rollout.prompts_per_iteration=1"],
                            repo_root, timeout=300)
    assert "FSDP: 3 units over 2 processes (weights kept gathered between forward and backward)" in res.stderr
    assert [r["reward_mean"] for r in train_records(two)] == pytest.approx([r["reward_mean"] for r in train_records(one)], rel=1e-3)
    assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)


def test_fsdp_stepwise_flow_grpo_matches_data_parallel(repo_root, tmp_path):
    """The per-transition update (Stepwise-Flow-GRPO) under FSDP: the same update as plain data
    parallelism over the same two processes."""
    start, ddp, fsdp = tmp_path / "start", tmp_path / "ddp", tmp_path / "fsdp"
    train = ["-m", "diffalign.cli", "train", "configs/tiny/stepwise_flow_grpo_sd3.yaml", "max_iterations=2",
             "log.progress_bar=false", "log.report=false", "eval.at_start=false", "sampling.eval_num_steps=2",
             "train.ema.enabled=false", "optim.lr=1", "train.batch_size=4", "rollout.prompts_per_iteration=1", *COMPARABLE]
    start_run(train, start)
    run([*train, f"output_dir={ddp}"], repo_root, nproc=2)
    run([*train, f"output_dir={fsdp}", "train.fsdp=true"], repo_root, nproc=2)
    assert_same_update(weights(start), weights(ddp), weights(fsdp), rel=REL, min_update=1e-3)
    assert [r["reward_mean"] for r in train_records(fsdp)] == pytest.approx([r["reward_mean"] for r in train_records(ddp)], rel=1e-3)


PREFERENCE = ("spo", "diffusion_dpo")  # two processes, LoRA: the same runs as tests/test_distributed.py's


@pytest.mark.parametrize("name", PREFERENCE)
def test_fsdp_preference_methods_match_data_parallel(repo_root, tmp_path, shared_run, name):
    """SPO (equal rollouts, equal pair shares) and Diffusion-DPO (every process generates the same
    pairs, then a slice of one global draw per micro-batch) keep the processes' forwards in
    lockstep by construction: under FSDP they give plain data parallelism's update."""
    config, both, _, two_proc = OTHER_ALGORITHMS[name]
    train = ["-m", "diffalign.cli", "train", config, *SHORT_RUN, *both, *two_proc]
    start, fsdp = tmp_path / "start", tmp_path / "fsdp"
    start_run(train, start)
    ddp, _ = shared_run(train, nproc=2)  # the same run as tests/test_distributed.py's two processes
    res = run([*train, f"output_dir={fsdp}", "train.fsdp=true"], repo_root, nproc=2)
    assert "FSDP:" in res.stderr
    assert_same_update(weights(start), weights(ddp), weights(fsdp), rel=REL, min_update=1e-3)
    assert [r["loss"] for r in train_records(ddp)] == pytest.approx([r["loss"] for r in train_records(fsdp)], rel=1e-3, abs=1e-6)
