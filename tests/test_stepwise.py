"""Stepwise-Flow-GRPO: gains and advantages on hand-computed numbers, the Tweedie refinement, the
dense rollout (parity with sample_linear), batched reward calls, on-policy ratio 1, bad input."""

import math

import pytest
import torch

from diffalign.adapters import load_adapter
from diffalign.algorithms.stepwise_flow_grpo import stepwise_advantages, stepwise_gains
from diffalign.config_files import load_config
from diffalign.errors import ConfigError
from diffalign.recipes.stepwise_flow_grpo import StepwiseFlowGRPOTrainer, trainable_steps
from diffalign.sampling import build_kernel, sample_linear
from diffalign.training.checks import SelfCheckError
from diffalign.sampling.dense import refine_x0, sample_linear_dense
from tests.helpers.adapters import sd3  # noqa: F401 (fixture)
from tests.helpers.tiny_run import FAST_ONE_PROMPT, run_cli, train_records

TINY = "configs/tiny/stepwise_flow_grpo_sd3.yaml"
# ---- pure functions -------------------------------------------------------------------------
def test_gains_are_reward_differences():
    r = torch.tensor([[0.0, 1.0, 4.0], [2.0, 2.0, 1.0]])
    assert stepwise_gains(r).tolist() == [[1.0, 3.0], [0.0, -1.0]]
    with pytest.raises(ValueError):
        stepwise_gains(torch.zeros(3))


def test_joint_and_per_step_normalisation_by_hand():
    gains = torch.tensor([[1.0, 3.0], [5.0, 7.0], [2.0, 2.0], [2.0, 2.0]])
    groups = torch.tensor([0, 0, 1, 1])
    # joint: group 0's four gains have mean 4 and std sqrt(5); group 1's are all equal -> dropped
    joint = stepwise_advantages(gains, groups, normalize="joint", eps=0.0)
    s5 = math.sqrt(5.0)
    assert torch.allclose(joint.advantages[:2], torch.tensor([[-3 / s5, -1 / s5], [1 / s5, 3 / s5]]))
    assert joint.keep.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    assert joint.advantages[2:].abs().sum() == 0 and joint.zero_std_fraction == 0.5
    # per step: step 0 (1, 5) and step 1 (3, 7) each have std 2 -> +-1
    per = stepwise_advantages(gains, groups, normalize="per_step", eps=0.0)
    assert per.advantages[:2].tolist() == [[-1.0, -1.0], [1.0, 1.0]]
    assert per.zero_std_fraction == 0.5  # 2 of 4 (group, step) units
    # clip, eps
    clipped = stepwise_advantages(gains, groups, normalize="joint", eps=0.0, clip=1.0)
    assert clipped.advantages[0, 0] == -1.0 and clipped.advantages[1, 1] == 1.0
    assert torch.allclose(stepwise_advantages(gains, groups, eps=1.0).advantages[0, 0], torch.tensor(-3 / (s5 + 1)))
    # without filtering, an all-equal group keeps its (zero) advantages
    assert stepwise_advantages(gains, groups, filter_zero_std=False).keep[2:].all()


def test_step_mask_and_nonfinite_rows():
    gains = torch.tensor([[1.0, 100.0], [5.0, -100.0], [float("nan"), 0.0]])
    groups = torch.tensor([0, 0, 0])
    adv = stepwise_advantages(gains, groups, step_mask=torch.tensor([True, False]), eps=0.0)
    # only step 0 of the finite rows enters the statistics: (1, 5) -> -1, +1
    assert adv.advantages[:2, 0].tolist() == [-1.0, 1.0]
    assert adv.keep.tolist() == [[True, False], [True, False], [False, False]]
    assert adv.advantages[:, 1].abs().sum() == 0 and adv.advantages[2].abs().sum() == 0
    with pytest.raises(ValueError, match="normalize"):
        stepwise_advantages(gains, groups, normalize="global")


# ---- Tweedie refinement ---------------------------------------------------------------------
class LinearFlow:
    """A 'model' with v(x, t) = a x, so K Euler substeps from t to 0 give x (1 - a t / K)^K."""

    prediction_type = "flow"
    family = "fake"

    def __init__(self, a):
        self.a = a
        self.calls = 0

    def predict(self, x, t, embeds, guidance_scale=1.0):
        self.calls += 1
        return self.a * x

    def to_x0(self, v, x, t):
        return x - t.view(-1, 1) * v


def test_refine_x0_substeps_by_hand():
    x, t = torch.tensor([[1.0, 2.0]]), torch.tensor([0.8])
    model = LinearFlow(0.5)
    v = model.predict(x, t, None)
    model.calls = 0
    plain = refine_x0(model, x, t, v, None, guidance_scale=1.0, substeps=0)
    assert torch.allclose(plain, x * (1 - 0.5 * 0.8))
    assert torch.equal(refine_x0(model, x, t, v, None, guidance_scale=1.0, substeps=1), plain)  # K = 1 is plain Tweedie
    assert model.calls == 0
    for k in (2, 3, 5):
        model.calls = 0
        out = refine_x0(model, x, t, v, None, guidance_scale=1.0, substeps=k)
        assert torch.allclose(out, x * (1 - 0.5 * 0.8 / k) ** k), k
        assert model.calls == k - 1  # the first substep reuses the rollout's output
    with pytest.raises(ConfigError, match="tweedie_substeps"):
        refine_x0(model, x, t, v, None, guidance_scale=1.0, substeps=9)


def test_dense_rollout_matches_sample_linear(sd3):
    kernel = build_kernel(sd3, "cps", 0.8)
    embeds = sd3.encode_prompts(["a cat", "a dog"], with_uncond=True)
    schedule = sd3.make_schedule(3, 32, 32)
    mask = torch.ones(3, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    noise, step_noise = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 3, 4, 16, 16, generator=g)
    kw = dict(guidance_scale=4.5, height=32, width=32, noise=noise, step_noise=step_noise)
    ref = sample_linear(sd3, kernel, embeds, schedule, mask, **kw)
    dense = sample_linear_dense(sd3, kernel, embeds, schedule, mask, substeps=0, **kw)
    assert torch.equal(dense.latents, ref.latents) and torch.equal(dense.log_probs, ref.log_probs)
    assert torch.equal(dense.images, ref.images)
    for i in range(3):  # Tweedie of each visited state; the final state is the real sample
        t = schedule[i].expand(2)
        v = sd3.predict(dense.latents[:, i], t, embeds, 4.5)
        assert torch.allclose(dense.x0_estimates[:, i], sd3.to_x0(v, dense.latents[:, i], t), atol=1e-5)
    assert torch.equal(dense.x0_estimates[:, 3], dense.latents[:, 3])
    assert dense.trainable_steps.tolist() == [True, True, False]  # CPS's step to sigma 0 is deterministic
    refined = sample_linear_dense(sd3, kernel, embeds, schedule, mask, substeps=3, **kw)
    assert refined.extra_forwards == 3 * 2 and torch.equal(refined.latents, ref.latents)
    assert not torch.allclose(refined.x0_estimates[:, 0], dense.x0_estimates[:, 0])


def test_trainable_steps_of_the_std_schedules(sd3):
    schedule = sd3.make_schedule(4, 32, 32)  # starts at sigma 1
    mask = torch.ones(4, dtype=torch.bool)
    assert trainable_steps(build_kernel(sd3, "cps", 0.8), schedule, mask).tolist() == [True, True, True, False]
    stepwise = build_kernel(sd3, "cps", 0.8, std_schedule="stepwise")  # std = eta s' sqrt(1 - s): 0 at s = 1
    assert trainable_steps(stepwise, schedule, mask).tolist() == [False, True, True, False]
    assert trainable_steps(build_kernel(sd3, "flow_grpo", 0.7), schedule, torch.tensor([False, True, True, True])).tolist() == [
        False, True, True, True]


# ---- the recipe end to end ------------------------------------------------------------------
def test_one_reward_call_per_chunk_and_ratio_one(repo_root, tmp_path):
    cfg = load_config(repo_root / TINY, [f"output_dir={tmp_path / 'r'}", "max_iterations=1", "rollout.prompts_per_iteration=2",
                                         "rollout.group_size=2", "rollout.sample_batch_size=2", "sampling.num_steps=3",
                                         "algorithm.tweedie_substeps=2", "eval.num_prompts=1", *FAST_ONE_PROMPT])
    calls = []

    class Counting(StepwiseFlowGRPOTrainer):
        def score(self, images, prompts, metadata=None):
            calls.append(len(prompts))
            return super().score(images, prompts, metadata)

    Counting(cfg).train()
    assert calls[:2] == [2 * 4, 2 * 4]  # 2 chunks of 2 samples x (T + 1 = 4) images, then the final eval
    rec = train_records(tmp_path / "r")[0]
    assert rec["trained_steps_per_sample"] == 2 and rec["trained_terms"] == 4 * 2
    assert rec["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and rec["clip_frac"] == 0.0  # on-policy before the update
    assert rec["refinement_forwards"] == 2 * 3 * 1 and rec["optimizer_steps"] == 1  # batched calls: 2 chunks x T x (K - 1)


def test_cli_per_step_and_stepwise_schedule(repo_root, tmp_path):
    out = tmp_path / "r"
    code = run_cli("train", TINY, f"output_dir={out}", "max_iterations=1", "sampling.num_steps=4",
                   "sampling.std_schedule=stepwise", "algorithm.advantage_norm=per_step", "algorithm.tweedie_substeps=0", *FAST_ONE_PROMPT)
    assert code == 0
    rec = train_records(out)[0]
    assert rec["trained_steps_per_sample"] == 2  # first (from sigma 1) and last (to 0) steps are deterministic
    assert math.isfinite(rec["loss"]) and (out / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_shapes_config_runs_on_the_tiny_shapes_model(repo_root, tmp_path):
    out = tmp_path / "r"
    code = run_cli("train", "configs/shapes/stepwise_flow_grpo.yaml", f"output_dir={out}", "model.id=tiny:shapes",
                   "max_iterations=1", "rollout.prompts_per_iteration=1", "rollout.group_size=2", "sampling.num_steps=2",
                   "algorithm.tweedie_substeps=2", "lora.rank=4", *FAST_ONE_PROMPT)
    assert code == 0 and len(train_records(out)) == 1


def test_self_check_catches_an_off_policy_update(repo_root, tmp_path):
    cfg = load_config(repo_root / TINY, [f"output_dir={tmp_path / 'r'}", "max_iterations=1", "sampling.num_steps=2",
                                         "rollout.prompts_per_iteration=1", *FAST_ONE_PROMPT])

    class Broken(StepwiseFlowGRPOTrainer):
        def update_transitions(self, *args, **kwargs):
            self.kernel.noise_level *= 0.5  # re-scores with another kernel than the sampler used
            return super().update_transitions(*args, **kwargs)

    with pytest.raises(SelfCheckError, match="self-check"):
        Broken(cfg).train()


@pytest.mark.parametrize("args, needle", [
    (["algorithm.tweedie_substeps=9"], "algorithm.tweedie_substeps"),
    (["algorithm.tweedie_substeps=-1"], "algorithm.tweedie_substeps"),
    (["algorithm.advantage_norm=global"], "algorithm.advantage_norm"),
    (["model.id=tiny:sd15", "sampling.kernel=ddim"], "flow-matching"),
])
def test_bad_input_is_one_line_and_exit_2(repo_root, tmp_path, capsys, args, needle):
    out = tmp_path / "r"
    assert run_cli("train", TINY, f"output_dir={out}", *args, *FAST_ONE_PROMPT) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()  # nothing on disk was touched
