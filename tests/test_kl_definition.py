"""algorithm.kl_definition: which KL ``beta`` weighs (exact, or Flow-GRPO's code's exact x |dt|),
its validation, and a training iteration on a tiny model (the math: test_flow_grpo_algo.py)."""

import json

import pytest

from diffalign.config_files import load_config
from diffalign.errors import ConfigError


def test_default_is_exact_and_the_key_is_shared():
    for name in ("flow_grpo", "branch_grpo", "stepwise_flow_grpo", "drm_step_grpo"):
        cfg = load_config(None, [f"algorithm.name={name}", "algorithm.kl_definition=reference", "sampling.kernel=flow_grpo"])
        assert cfg.algorithm.kl_definition == "reference"
        assert load_config(None, [f"algorithm.name={name}"]).algorithm.kl_definition == "exact"
    cfg = load_config(None, ["algorithm.name=sol_rl", "algorithm.optimizer=flow_grpo", "algorithm.flow_grpo.kl_definition=reference"])
    assert cfg.algorithm.flow_grpo.kl_definition == "reference"


@pytest.mark.parametrize("overrides, key", [
    (["algorithm.kl_definition=approx"], "'algorithm.kl_definition'"),
    (["algorithm.kl_definition=reference", "algorithm.beta=0.04", "sampling.kernel=cps"], "'algorithm.kl_definition' 'reference'"),
    (["model.id=tiny:sd15", "algorithm.kl_definition=reference", "algorithm.beta=0.04", "sampling.kernel=ddim"],
     "'algorithm.kl_definition' 'reference'"),
    (["algorithm.name=sol_rl", "algorithm.optimizer=flow_grpo", "algorithm.flow_grpo.kl_definition=reference",
      "sampling.kernel=cps"], "'algorithm.flow_grpo.kl_definition' 'reference'"),
])
def test_bad_values_name_the_key_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert key in message and "\n" not in message
    if "kernel=cps" in overrides[-1]:
        assert "kernel cps" in message and "use 'exact'" in message


def test_reference_on_a_kernel_without_dt_is_accepted_when_beta_is_zero():
    assert load_config(None, ["algorithm.kl_definition=reference", "algorithm.beta=0", "sampling.kernel=cps"])


def test_cli_exits_2_with_one_line(repo_root, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "diffalign", "train", "tiny/flow_grpo_sd3", f"output_dir={tmp_path / 'run'}",
                          "algorithm.beta=0.04", "algorithm.kl_definition=reference", "sampling.kernel=cps"],
                         capture_output=True, text=True, cwd=repo_root, timeout=120)
    assert out.returncode == 2
    assert "algorithm.kl_definition" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def _one_iteration(repo_root, run_dir, definition):
    from diffalign.trainer import build_trainer

    cfg = load_config(str(repo_root / "configs/shapes/flow_grpo.yaml"), [
        f"output_dir={run_dir}", "model.id=tiny:shapes", "max_iterations=1", "log.progress_bar=false", "log.report=false",
        "eval.at_start=false", "eval.every=0", "eval.images_per_family=1", "eval.probe=false", "sampling.eval_num_steps=2",
        "rollout.prompts_per_iteration=2", "rollout.group_size=4", "rollout.sample_batch_size=8", "train.batch_size=8",
        "train.mixed_precision=no", "reward.name=brightness", "reward.kwargs={}", "algorithm.beta=0.04",
        f"algorithm.kl_definition={definition}", "train.optimizer_steps_per_iteration=2"])
    trainer = build_trainer(cfg, overwrite=True)
    trainer.train()
    record = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if "grad_norm" in r][0]
    schedule = trainer.adapter.make_schedule(cfg.sampling.num_steps, trainer.resolution, trainer.resolution)
    return record, (schedule[:-1] - schedule[1:])[: cfg.sampling.window_size]


def test_one_iteration_with_the_reference_kl(repo_root, tmp_path):
    """Same seed, same first optimizer step (the policy is the reference: KL 0, no gradient from it);
    on the second the KL is the exact one times the trained steps' |dt|, so the iteration's mean KL
    is the exact run's scaled by a weighted mean of those |dt|."""
    exact, _ = _one_iteration(repo_root, tmp_path / "exact", "exact")
    reference, abs_dt = _one_iteration(repo_root, tmp_path / "reference", "reference")
    assert exact["kl"] > 0 and reference["optimizer_steps"] == 2
    ratio = reference["kl"] / exact["kl"]
    assert float(abs_dt.min()) * 0.999 <= ratio <= float(abs_dt.max()) * 1.001 < 1


@pytest.mark.parametrize("kernel", ["flow_grpo", "cps", "dance", "ddim"])
def test_config_accepts_reference_exactly_where_the_kernel_has_a_dt(kernel):
    import torch

    from diffalign import config
    from diffalign.sampling import linear

    assert config.SQRT_DT_KERNELS == linear.SQRT_DT_KERNELS
    model = ["model.id=tiny:sd15"] if kernel == "ddim" else []
    overrides = [*model, f"sampling.kernel={kernel}", "algorithm.beta=0.04", "algorithm.kl_definition=reference"]
    try:
        linear.Kernel(kernel, 0.5).abs_dt(torch.tensor(0.5), torch.tensor(0.25))
    except ConfigError:
        with pytest.raises(ConfigError, match="kl_definition"):
            load_config(None, overrides)
    else:
        assert load_config(None, overrides).algorithm.kl_definition == "reference"
