"""OPD (on-policy distillation): the loss on hand-computed numbers, prompt routing, teachers from a
run's output, the student moving toward its teacher, resume and bad input."""

import json
import math
import shutil

import pytest
import torch

import schedulers
from diffalign.adapters import load_adapter
from diffalign.algorithms.opd import Route, opd_loss, routing_weights, transition_kl
from diffalign.config_files import load_config
from diffalign.errors import ConfigError
from diffalign.export import load_trained_adapter
from diffalign.recipes import available
from diffalign.recipes.opd import OPDTrainer, TeacherConfig, load_teacher
from diffalign.sampling import build_kernel
from diffalign.shapes import prompt_family, split_prompts
from diffalign.trainer import build_trainer
from tests.helpers.compare import assert_resumed_equals_uninterrupted
from tests.helpers.tiny_run import FAST, ROOT, run_cli

CONFIG = "configs/tiny/opd_sd3.yaml"
# a short run: 2 ODE steps (both trained), 2 prompts x 2 images, one micro-batch per step
SMALL = [*FAST, "sampling.num_steps=2", "algorithm.train_timestep_fraction=1.0", "rollout.group_size=2",
         "train.batch_size=8", "eval.num_prompts=1", "train.ema.enabled=false"]
# SGD with momentum (an optimizer state the checkpoint must carry); lr 50 moves the LoRA visibly in one step
RESUMABLE = ["checkpoint.every=1", "optim.name=sgd", "optim.momentum=0.9", "optim.lr=50"]


# ---- the loss, by hand ---------------------------------------------------------------------
# Two samples of two latent elements.
# Student means mu_S = [[1, 3], [0, 0]].
# Teacher A = [[1, 1], [1, -1]]: deltas [0, 2] and [-1, 1] -> mean squares 2 and 1.
#   ODE: 0.5 x (2, 1) = (1, 0.5). SDE with variances (0.5, 2): 2 / (2 x 0.5) = 2, 1 / (2 x 2) = 0.25.
# Teacher B = [[1, 3], [0, 2]]: deltas [0, 0] and [0, -2] -> mean squares 0 and 2 -> ODE (0, 1).
# Weights (routing x teacher weight) [[1, 0], [2, 0.5]]:
#   sample 1: 1 x 1 + 0 x 0 = 1; sample 2: 2 x 0.5 + 0.5 x 1 = 1.5.
# Gradient of sum over samples w.r.t. mu_S: d/dmu 0.5 mean(delta^2) = delta / 2 (2 elements):
#   sample 1: 1 x [0, 2] / 2 = [0, 1]; sample 2: 2 x [-1, 1] / 2 + 0.5 x [0, -2] / 2 = [-1, 0.5].
MU_S = [[1.0, 3.0], [0.0, 0.0]]
MU_A = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
MU_B = torch.tensor([[1.0, 3.0], [0.0, 2.0]])


def test_transition_kl_hand_computed():
    mu = torch.tensor(MU_S)
    torch.testing.assert_close(transition_kl(mu, MU_A), torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(transition_kl(mu, MU_A, torch.tensor([0.5, 2.0])), torch.tensor([2.0, 0.25]))
    torch.testing.assert_close(transition_kl(mu, mu.clone()), torch.zeros(2))


def test_opd_loss_sums_routed_teachers_hand_computed():
    mu = torch.tensor(MU_S, requires_grad=True)
    out = opd_loss(mu, [MU_A, MU_B], torch.tensor([[1.0, 0.0], [2.0, 0.5]]))
    torch.testing.assert_close(out.per_sample, torch.tensor([1.0, 1.5]))
    torch.testing.assert_close(out.per_teacher, torch.tensor([[1.0, 0.0], [1.0, 0.5]]))
    out.per_sample.sum().backward()
    torch.testing.assert_close(mu.grad, torch.tensor([[0.0, 1.0], [-1.0, 0.5]]))
    # a teacher routed to none of the samples needs no forward
    alone = opd_loss(torch.tensor(MU_S), [MU_A, None], torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    torch.testing.assert_close(alone.per_sample, torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match="routed"):
        opd_loss(torch.tensor(MU_S), [MU_A, None], torch.tensor([[1.0, 1.0], [1.0, 0.0]]))


def test_ode_loss_is_the_step_weighted_velocity_mse():
    # Euler ODE step mu = x + v dt: from s = 1 to s' = 0.5 (dt = -0.5), v_S = [1, 3], v_T = [1, 1]:
    # 0.5 x dt^2 x mean((v_S - v_T)^2) = 0.5 x 0.25 x (0 + 4) / 2 = 0.25
    x = torch.zeros(1, 2)
    s, s_next = torch.tensor([1.0]), torch.tensor([0.5])
    mu_s = schedulers.ode_step(torch.tensor([[1.0, 3.0]]), x, s, s_next).mean
    mu_t = schedulers.ode_step(torch.tensor([[1.0, 1.0]]), x, s, s_next).mean
    torch.testing.assert_close(transition_kl(mu_s, mu_t), torch.tensor([0.25]))


def test_sde_divisor_is_flow_grpos_sigma_t_squared():
    # the recipe divides by std^2 / |dt|: for the flow_grpo kernel a^2 s / (1 - s) = 0.49 x 0.5 / 0.5
    class Flow:
        prediction_type = "flow"

    kernel = build_kernel(Flow(), "flow_grpo", 0.7)
    x, v = torch.zeros(1, 4), torch.ones(1, 4)
    t, t_next = torch.tensor([0.5]), torch.tensor([0.25])
    step = kernel.step(v, x, t, t_next, sde=True, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(step.std.reshape(1) ** 2 / kernel.abs_dt(t, t_next), torch.tensor([0.49]))


# ---- routing --------------------------------------------------------------------------------
def test_routing_weights_hand_computed():
    prompts = ["a cat", "two dogs", "a red car"]
    routes = [Route(patterns=("cat|dog",)), Route(), Route(labels=("colors",))]
    w = routing_weights(prompts, [None, None, "colors"], routes, [1.0, 0.5, 2.0])
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5, 0.0], [1.0, 0.5, 0.0], [0.0, 0.5, 2.0]]))


def test_shapes_families_route_each_prompt_to_its_specialist(tmp_path):
    cfg = load_config(ROOT / "configs/shapes/opd.yaml", [f"output_dir={tmp_path / 'x'}"])
    tr = build_trainer(cfg)
    assert isinstance(tr, OPDTrainer)
    train = split_prompts().train
    w = tr.routing(train)
    layout = set(cfg.algorithm.teachers[0].families)
    for prompt, row in zip(train, w):
        expected = [1.0, 0.0] if prompt_family(prompt) in layout else [0.0, 1.0]
        assert row.tolist() == expected, prompt
    tr.check_routing(train)  # every prompt has a teacher, every teacher prompts
    orphan = load_config(ROOT / "configs/shapes/opd.yaml", [f"output_dir={tmp_path / 'y'}",
                                                            "algorithm.teachers[1].families=[colors]"])
    with pytest.raises(ConfigError, match="go to no teacher"):
        build_trainer(orphan).check_routing(train)
    idle = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'z'}", "algorithm.teachers[1].match=[zebra]",
                                       "algorithm.teachers[0].match=[.]"])
    with pytest.raises(ConfigError, match="'scenes' gets no training prompt"):
        build_trainer(idle).check_routing(idle.prompts.train)


# ---- teachers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def opd_run(tmp_path_factory):
    """A one-iteration OPD run of the tiny config: its final/ is a LoRA run output (a teacher), its
    checkpoint one to resume from."""
    out = tmp_path_factory.mktemp("opd") / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", *RESUMABLE, *SMALL) == 0
    return out


def test_a_lora_run_as_teacher_predicts_as_the_trained_model(opd_run):
    trained = load_trained_adapter(opd_run)  # the run's base + its final/ LoRA, through diffusers' loading
    student = load_adapter("tiny:sd3")  # the student's model before its own LoRA
    teacher = load_teacher(TeacherConfig(model=str(opd_run)), student, device="cpu", dtype=torch.float32)
    assert not any(p.requires_grad for p in teacher.parameters())
    emb = student.encode_prompts(["a cat", "a red car"], with_uncond=False)
    x, t = torch.randn(2, *student.latent_shape(32, 32), generator=torch.Generator().manual_seed(0)), torch.tensor([0.7, 0.3])
    with torch.no_grad(), student.swapped_denoiser(teacher):
        got = student.predict(x, t, emb, 1.0)
    with torch.no_grad():
        want = trained.predict(x, t, trained.encode_prompts(["a cat", "a red car"], with_uncond=False), 1.0)
        base = student.predict(x, t, emb, 1.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert float((got - base).abs().max()) > 1e-4  # the LoRA is in it
    # fusing the teacher's LoRA left the student's own base denoiser as it was
    assert all(torch.equal(a, b) for a, b in zip(student.denoiser.parameters(), load_adapter("tiny:sd3").denoiser.parameters()))


def test_a_lora_student_trains_against_a_lora_run_teacher(opd_run, tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", *SMALL, f"algorithm.teachers=[{{model: '{opd_run}'}}]"])
    tr = build_trainer(cfg)
    tr.setup()  # the teacher's LoRA fused into a copy first, then the student's own LoRA added
    assert len(tr.policy.lora_layers) > 0 and not any(p.requires_grad for p in tr.teachers[0].parameters())
    rec = tr.iteration(0)
    assert rec["optimizer_steps"] == 1 and rec["teacher_kl/teacher0"] > 0


def test_a_full_fine_tune_output_as_teacher_is_its_denoiser(tmp_path):
    from diffalign.export import save_trained_weights

    tuned = load_adapter("tiny:sd3")
    with torch.no_grad():
        for p in tuned.denoiser.parameters():
            p.add_(0.01)
    save_trained_weights(tuned, tmp_path / "run" / "final", lora=False, metadata={"base_model": "tiny:sd3", "family": "sd3"})
    student = load_adapter("tiny:sd3")
    teacher = load_teacher(TeacherConfig(model=str(tmp_path / "run")), student, device="cpu", dtype=torch.float32)
    want = dict(tuned.denoiser.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in teacher.named_parameters())
    assert teacher is not student.denoiser and not any(p.requires_grad for p in teacher.parameters())


# ---- training ---------------------------------------------------------------------------------
def _distance(tr, x, t, emb) -> float:
    """mean (v_student - v_teacher)^2 at fixed states."""
    with torch.no_grad():
        v_s = tr.adapter.predict(x, t, emb, 1.0)
        with tr.adapter.swapped_denoiser(tr.teachers[0]):
            v_t = tr.adapter.predict(x, t, emb, 1.0)
    return float(((v_s - v_t) ** 2).mean())


def test_student_moves_toward_a_perturbed_copy_of_itself(tmp_path):
    # full fine-tuning: the student can reach a teacher whose every weight differs (a LoRA only part of the way)
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", *SMALL, "lora.enabled=false", "optim.lr=3e-3",
                                      "algorithm.teachers=[{model: 'tiny:sd3', name: copy}]"])
    tr = build_trainer(cfg)
    tr.setup()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the teacher: the student's starting denoiser (tiny:sd3, seed 0), perturbed
        for p in tr.teachers[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    x = torch.randn(4, *tr.adapter.latent_shape(32, 32), generator=g)
    t = torch.tensor([0.9, 0.7, 0.5, 0.3])
    emb = tr.adapter.encode_prompts(["a cat", "a dog", "a red car", "a tree on a hill"], with_uncond=False)
    distances = [_distance(tr, x, t, emb)]
    records = []
    for it in range(2):
        records.append(tr.iteration(it))
        distances.append(_distance(tr, x, t, emb))
    assert all(r["optimizer_steps"] == 1 and math.isfinite(r["loss"]) for r in records)
    assert distances[2] < distances[1] < distances[0] and distances[2] < 0.75 * distances[0], distances
    assert records[1]["loss"] < records[0]["loss"], [r["loss"] for r in records]
    assert records[0]["teacher_kl/copy"] == pytest.approx(records[0]["loss"])


def test_sde_rollouts_rescore_on_policy_and_train(tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", *SMALL, "algorithm.rollout=sde"])
    tr = build_trainer(cfg)
    tr.setup()
    before = [p.detach().clone() for p in tr.trainable]
    rec = tr.iteration(0)
    assert tr.self_check_log_ratio is not None and tr.self_check_log_ratio < 1e-4  # the SDE log-ratio before the update
    assert rec["optimizer_steps"] == 1 and math.isfinite(rec["loss"]) and rec["loss"] > 0
    assert sum(float((p.detach() - b).abs().sum()) for p, b in zip(tr.trainable, before)) > 0


def test_a_guided_teacher_of_an_unguided_student_gets_the_unconditional_embeddings(tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", *SMALL, "algorithm.teachers[0].guidance_scale=3"])
    tr = build_trainer(cfg)
    tr.setup()
    assert tr.teacher_scales == [3.0, 1.0]
    traj, plan, embeds, _ = tr.rollout(0)
    assert plan.embeds.uncond is None and embeds.uncond is not None and len(embeds) == len(traj)
    rec = tr.update(traj, plan, embeds)
    assert rec["optimizer_steps"] == 1 and math.isfinite(rec["teacher_kl/animals"])


def test_self_check_catches_a_student_that_is_not_its_sampler(tmp_path, monkeypatch):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'run'}", *SMALL])
    tr = build_trainer(cfg)
    tr.setup()
    real = tr.adapter.predict
    monkeypatch.setattr(tr.adapter, "predict", lambda x, t, e, g: real(x, t, e, g) + (0.5 if torch.is_grad_enabled() else 0.0))
    from diffalign.training.checks import SelfCheckError

    with pytest.raises(SelfCheckError, match="ODE step"):
        tr.iteration(0)


def test_resume_matches_uninterrupted_run(opd_run, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    shutil.copytree(opd_run, part)  # one iteration of the same config
    assert run_cli("train", CONFIG, f"output_dir={full}", "max_iterations=2", *RESUMABLE, *SMALL) == 0
    assert run_cli("resume", str(part), "max_iterations=2") == 0
    assert_resumed_equals_uninterrupted(full, part, ("reward_mean", "loss", "teacher_kl/animals", "teacher_kl/scenes"))


# ---- configs and bad input ------------------------------------------------------------------
def test_opd_is_registered_and_its_configs_load(tmp_path):
    assert "opd" in available()
    for path in (CONFIG, "configs/shapes/opd.yaml", "configs/sd3/opd_two_teachers.yaml"):
        cfg = load_config(ROOT / path, [f"output_dir={tmp_path / 'x'}"])
        assert cfg.algorithm.name == "opd" and len(cfg.algorithm.teachers) == 2, path


@pytest.mark.parametrize("override, key", [
    ("algorithm.teachers=[]", "algorithm.teachers"),
    ("algorithm.teachers[0].weight=0", "algorithm.teachers[0].weight"),
    ("algorithm.teachers[1].match=['(']", "algorithm.teachers[1].match[0]"),
    ("algorithm.teachers[0].families=[circles]", "algorithm.teachers[0].families"),
    ("algorithm.teachers[0].model=/no/such/teacher", "algorithm.teachers[0].model"),
    ("algorithm.rollout=sde", "algorithm.rollout"),
    ("algorithm.teachers[0].families=[colors]", "algorithm.teachers[0].families"),  # families need ShapesWorld prompts
])
def test_bad_value_exits_2_with_one_line_naming_the_key(tmp_path, capsys, override, key):
    extra = ["sampling.kernel=cps"] if override == "algorithm.rollout=sde" else []
    assert run_cli("train", CONFIG, f"output_dir={tmp_path / 'bad'}", override, *extra, *FAST) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]
    assert len(err) == 1 and f"config key '{key}" in err[0], err
    assert not (tmp_path / "bad").exists()


def test_config_records_teachers(opd_run):
    saved = (opd_run / "config.yaml").read_text()
    assert "teachers:" in saved and "cat|dog" in saved
    rec = json.loads((opd_run / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["optimizer_steps"] == 1 and "teacher_kl/animals" in rec


def test_an_override_reaches_one_teacher_by_index(tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'x'}", "algorithm.teachers[1].weight=2.5",
                                      "algorithm.teachers[0].match=[cat]"])
    assert [t.weight for t in cfg.algorithm.teachers] == [1.0, 2.5] and cfg.algorithm.teachers[0].match == ["cat"]
    with pytest.raises(ConfigError, match="'teachers' has no entry 2"):
        load_config(ROOT / CONFIG, [f"output_dir={tmp_path / 'x'}", "algorithm.teachers[2].weight=1"])
