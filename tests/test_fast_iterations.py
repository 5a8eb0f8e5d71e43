"""The fast-iteration switches: train.mixed_precision=auto, train.channels_last, train.detach_uncond."""

import json

import pytest
import torch

from diffalign.adapters._util import guided_forward
from diffalign.adapters.base import PromptEmbeds
from diffalign.config import native_bf16, TrainConfig
from diffalign.config_files import load_config
from diffalign.errors import ConfigError


def test_native_bf16_reads_the_cpu_flags():
    assert native_bf16("cpu", {"avx2", "avx512_bf16"})
    assert native_bf16("cpu", {"amx_bf16", "amx_tile"})
    assert not native_bf16("cpu", {"avx2", "avx512f"})
    assert not native_bf16("meta", set())


def test_auto_precision_resolves_per_device(monkeypatch):
    import diffalign.config as config

    cfg = TrainConfig(mixed_precision="auto")
    monkeypatch.setattr(config, "native_bf16", lambda device: True)
    assert cfg.resolved_mixed_precision(torch.device("cpu")) == "bf16"
    monkeypatch.setattr(config, "native_bf16", lambda device: False)
    assert cfg.resolved_mixed_precision(torch.device("cpu")) == "no"
    assert TrainConfig(mixed_precision="bf16").resolved_mixed_precision(torch.device("cpu")) == "bf16"


def test_yaml_bare_no_means_the_string_no(repo_root):
    cfg = load_config(str(repo_root / "configs/shapes/flow_grpo.yaml"), ["train.mixed_precision=no"])
    assert cfg.train.mixed_precision == "no"
    with pytest.raises(ConfigError, match="train.mixed_precision"):
        load_config(str(repo_root / "configs/shapes/flow_grpo.yaml"), ["train.mixed_precision=true"])


def _linear_forward(weight):
    return lambda x, t, kw: x @ weight + kw["c"]


def test_detached_uncond_keeps_the_value_and_drops_its_gradient():
    torch.manual_seed(0)
    weight = torch.randn(3, 3, requires_grad=True)
    x, t = torch.randn(4, 3), torch.rand(4)
    embeds = PromptEmbeds(cond={"c": torch.randn(4, 3)}, uncond={"c": torch.randn(4, 3)})
    g = 4.0
    full = guided_forward(_linear_forward(weight), x, t, embeds, g)
    detached = guided_forward(_linear_forward(weight), x, t, embeds, g, detach_uncond=True)
    torch.testing.assert_close(detached, full)
    (grad_full,) = torch.autograd.grad(full.sum(), weight)
    (grad_detached,) = torch.autograd.grad(detached.sum(), weight)
    # out = (1 - g) * uncond + g * cond, both linear in the weight with the same input x
    torch.testing.assert_close(grad_full, grad_detached * (1 - g + g) / g)
    torch.testing.assert_close(grad_detached, g * x.t() @ torch.ones(4, 3))
    with torch.no_grad():  # sampling: one batched forward either way
        torch.testing.assert_close(guided_forward(_linear_forward(weight), x, t, embeds, g, detach_uncond=True), full)


@pytest.mark.parametrize("precision", ["bf16"])
def test_fast_settings_keep_the_on_policy_ratio_at_one(repo_root, tmp_path, precision):
    """Rollouts and updates run in the same precision and memory format: the self-check (every
    |log ratio| <= train.self_check_tolerance before the first update) passes, and weights move."""
    from diffalign.trainer import build_trainer

    cfg = load_config(str(repo_root / "configs/shapes/flow_grpo.yaml"), [
        f"output_dir={tmp_path / 'run'}", "model.id=tiny:shapes", "max_iterations=1", "log.progress_bar=false",
        "log.report=false", "eval.at_start=false", "eval.every=0", "rollout.prompts_per_iteration=2",
        "rollout.group_size=4", "rollout.sample_batch_size=8", "train.batch_size=8", "sampling.eval_num_steps=2",
        f"train.mixed_precision={precision}", "train.channels_last=true", "train.detach_uncond=true",
        "train.self_check_tolerance=1e-3", "eval.num_prompts=2", "reward.name=brightness", "reward.kwargs={}"])
    trainer = build_trainer(cfg, overwrite=True)
    trainer.train()
    assert trainer.mixed_precision == precision
    assert trainer.self_check_log_ratio is not None and trainer.self_check_log_ratio <= 1e-3
    records = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert train[0]["time/rollout"] > 0 and train[0]["time/update"] > 0
    assert train[0]["grad_norm"] > 0
