"""DeepSpeed ZeRO-1 and ZeRO-2 on two CPU processes (gloo): the same update as one process, exact resume,
discarded steps, and the bad-input errors (ZeRO-3, fp16, xformers on CPU)."""

import json

import pytest
import torch

from diffalign.cli import main as cli_main
from tests.helpers.compare import COMPARABLE, REL, assert_same_update, weights
from tests.helpers.launch import launch as run, start_run
from tests.helpers.tiny_run import train_records

try:
    import deepspeed  # noqa: F401

    HAS_DEEPSPEED = True
except ImportError:
    HAS_DEEPSPEED = False
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is an optional extra (scripts/setup.sh installs it)")

COMMON = ["configs/tiny/flow_grpo_sd3.yaml", "log.progress_bar=false", "log.report=false", "eval.at_start=false",
          "sampling.eval_num_steps=2", "train.ema.enabled=false", "optim.lr=1e-2", "train.batch_size=64"]

# SGD with momentum: a state to partition and resume; Flow-GRPO's gradients are ~1e-4, lr 50 moves the weights by ~2e-2
TRAIN = ["-m", "diffalign.cli", "train", *COMMON, *COMPARABLE, "optim.lr=50"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, shared_run):
    """The initial weights and three iterations of one process over both prompts: what ZeRO-1 and
    ZeRO-2 over two processes (one prompt each) must reproduce."""
    start = tmp_path_factory.mktemp("zero") / "start"
    start_run([*TRAIN, "rollout.prompts_per_iteration=2"], start)
    one, _ = shared_run([*TRAIN, "max_iterations=3", "rollout.prompts_per_iteration=2"])
    return start, one


@needs_deepspeed
def test_zero2_two_processes_match_one_and_resume_exactly(repo_root, tmp_path, one_process):
    (start, one), two, part = one_process, tmp_path / "two", tmp_path / "part"
    zero = ["rollout.prompts_per_iteration=1", "train.zero_stage=2", "checkpoint.every=1"]
    run([*TRAIN, f"output_dir={two}", "max_iterations=3", *zero], repo_root, nproc=2)
    b = weights(two)
    assert_same_update(weights(start), weights(one), b, rel=REL, min_update=1e-3)
    assert [r["reward_mean"] for r in train_records(two)] == pytest.approx([r["reward_mean"] for r in train_records(one)], rel=1e-3)
    # the checkpoint holds every process's optimizer partition; an interrupted ZeRO run resumes exactly
    from diffalign import runs

    state = runs.load_checkpoint(runs.latest_checkpoint(two))
    assert state["optimizer"]["zero_stage"] == 2 and len(state["optimizer"]["partitions"]) == 2
    run([*TRAIN, f"output_dir={part}", "max_iterations=2", *zero], repo_root, nproc=2)
    run(["-m", "diffalign.cli", "resume", str(part), "max_iterations=3"], repo_root, nproc=2)
    c = weights(part)
    for k in b:
        torch.testing.assert_close(b[k], c[k], rtol=1e-6, atol=1e-7)
    assert [r["reward_mean"] for r in train_records(two)] == [r["reward_mean"] for r in train_records(part)]


@needs_deepspeed
def test_zero1_two_processes_match_one(repo_root, tmp_path, one_process):
    """ZeRO-1 (optimizer states partitioned, gradients reduced whole) makes the update one process
    makes over the same samples, and its checkpoint holds each process's partition."""
    from diffalign import runs

    (start, one), two = one_process, tmp_path / "two"
    res = run([*TRAIN, f"output_dir={two}", "max_iterations=3", "rollout.prompts_per_iteration=1", "train.zero_stage=1"],
              repo_root, nproc=2)
    assert "DeepSpeed ZeRO-1 over 2 processes" in res.stderr
    assert_same_update(weights(start), weights(one), weights(two), rel=REL, min_update=1e-3)
    assert [r["reward_mean"] for r in train_records(two)] == pytest.approx([r["reward_mean"] for r in train_records(one)], rel=1e-3)
    state = runs.load_checkpoint(runs.latest_checkpoint(two))
    assert state["optimizer"]["zero_stage"] == 1 and len(state["optimizer"]["partitions"]) == 2


@needs_deepspeed
def test_zero2_discard_and_step(repo_root, tmp_path):
    out = tmp_path / "seen.json"
    run(["tests/zero_worker.py", str(out), str(tmp_path / "run")], repo_root, nproc=2)
    seen = json.loads(out.read_text())
    assert seen["world"] == 2
    assert seen["unchanged_after_discard"] is True  # a poisoned accumulation never reaches the weights
    assert seen["skipped"] == 0  # the recipes count skipped steps; discarding is their tool
    assert seen["applied"] is True and seen["moved"] > 0
    # the engine's norm is that of the gradient summed over micro-batches and processes
    assert seen["norm"] == pytest.approx(seen["expected_norm"], rel=1e-4)


def test_deepspeed_config_follows_the_run_config():
    from diffalign.config_files import load_config
    from diffalign.distributed import deepspeed_config

    cfg = load_config("configs/tiny/flow_grpo_sd3.yaml", ["train.zero_stage=2", "train.batch_size=6", "optim.grad_clip=0.5"])
    ds = deepspeed_config(2, world=4, batch_size=cfg.train.batch_size, grad_clip=cfg.optim.grad_clip)
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["train_micro_batch_size_per_gpu"] == 6 and ds["train_batch_size"] == 24
    assert ds["gradient_clipping"] == 0.5 and not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]


@pytest.mark.parametrize("override, key", [
    ("train.zero_stage=3", "train.zero_stage"),
    ("train.attention=xformers", "train.attention"),
])
def test_bad_distributed_settings_exit_2(tmp_path, capsys, override, key):
    if key == "train.attention" and torch.cuda.is_available():
        pytest.skip("xformers may be usable on this machine")
    out = tmp_path / "run"
    code = cli_main(["train", *COMMON, f"output_dir={out}", "max_iterations=1", override])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and key in err
    assert not out.exists()  # nothing written


class _Plugin:
    def __init__(self, stage, offload="none"):
        self.zero_stage = stage
        self.deepspeed_config = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}}}


class _Accel:
    def __init__(self, plugin, num_processes=8):
        from accelerate.utils import DistributedType

        self.state = type("S", (), {"deepspeed_plugin": plugin})()
        self.distributed_type = DistributedType.DEEPSPEED if plugin else DistributedType.MULTI_CPU
        self.num_processes = num_processes


def test_zero_stage_from_the_accelerate_config(monkeypatch):
    import yaml

    from diffalign.config_files import load_config
    from diffalign.distributed import zero_stage
    from diffalign.errors import ConfigError

    shipped = yaml.safe_load(open("configs/accelerate/deepspeed_zero2.yaml"))
    assert shipped["distributed_type"] == "DEEPSPEED" and shipped["deepspeed_config"]["zero_stage"] == 2
    cfg = load_config("configs/tiny/flow_grpo_sd3.yaml", [])
    assert zero_stage(cfg.train.zero_stage, _Accel(None, 2)) == 0
    assert zero_stage(2, _Accel(None, 1)) == 0  # one process
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert zero_stage(cfg.train.zero_stage, _Accel(_Plugin(2))) == 2
    with pytest.raises(ConfigError, match="zero_stage 3"):
        zero_stage(cfg.train.zero_stage, _Accel(_Plugin(3)))
    with pytest.raises(ConfigError, match="offload"):
        zero_stage(cfg.train.zero_stage, _Accel(_Plugin(2, offload="cpu")))
    with pytest.raises(ConfigError, match="disagrees"):
        zero_stage(1, _Accel(_Plugin(2)))
    with pytest.raises(ConfigError, match="needs CUDA GPUs"):  # accelerate's DeepSpeed launcher on a CPU machine
        zero_stage(cfg.train.zero_stage, _Accel(None, 2))


def test_8bit_adam_needs_bitsandbytes(tmp_path, capsys):
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        out = tmp_path / "run"
        assert cli_main(["train", *COMMON, f"output_dir={out}", "max_iterations=1", "optim.use_8bit_adam=true"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("error:") and "optim.use_8bit_adam" in err and "bitsandbytes" in err
        assert not out.exists()
        return
    pytest.skip("bitsandbytes is installed: the GPU test below covers it")


@pytest.mark.gpu
def test_xformers_and_8bit_adam_on_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("xformers")
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "run"
    assert cli_main(["train", *COMMON, f"output_dir={out}", "max_iterations=2", "train.attention=xformers",
                     "optim.use_8bit_adam=true", "train.mixed_precision=bf16", "model.dtype=bfloat16"]) == 0
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()
