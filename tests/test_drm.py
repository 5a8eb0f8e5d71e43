"""DRM and Step-GRPO: losses and advantages on hand-computed numbers, the cut backbone, save/load,
pair sources, training, Step-GRPO end to end, step-wise sampling and the CLI's bad input."""

import json
import math

import numpy as np
import pytest
import torch

import reward_models
from diffalign.algorithms.continuation import choose_continuation
from diffalign.algorithms.drm_step_grpo import bradley_terry_loss, candidate_advantages, pairwise_accuracy
from diffalign.config_files import load_config
from diffalign.drm.model import DiffusionRewardModel, DRMError, num_droppable_blocks
from diffalign.forward_process import add_noise, encode_images, model_time
from diffalign.pairs import LatentPairs, PairFileError, generate_latent_pairs, load_latent_pairs, read_pair_rows
from diffalign.drm.sampling import stepwise_sample
from diffalign.drm.train import accuracy_vs_t
from diffalign.errors import ConfigError, RewardError
from diffalign.recipes.drm_step_grpo import DRMStepGRPOTrainer
from diffalign.sampling import build_kernel, sample_linear
from tests.helpers.tiny_run import FAST_ONE_PROMPT, run_cli

STEP_GRPO = "configs/shapes/drm_step_grpo.yaml"


def last_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


def small_drm(base="tiny:shapes", drop=3, seed=0):
    """A DRM whose head is random (an untrained head scores everything 0)."""
    model = DiffusionRewardModel.from_base(base, drop_last_blocks=drop, head_width=8)
    torch.manual_seed(seed)
    torch.nn.init.normal_(model.head.mlp_out[-1].weight, std=1.0)
    return model


@pytest.fixture(scope="module")
def saved_drm(tmp_path_factory):
    out = tmp_path_factory.mktemp("drm") / "shapes"
    model = small_drm()
    model.save(out)
    return model, out


@pytest.fixture(scope="module")
def drm_dir(saved_drm):
    return saved_drm[1]


# ---- pure functions -------------------------------------------------------------------------
def test_bradley_terry_loss_and_accuracy_by_hand():
    s0, s1 = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 3.0])
    labels = torch.tensor([1.0, 0.5, 1.0])  # image 0 preferred, tie, image 0 preferred
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    expected = (-math.log(sig(2)) + math.log(2) - math.log(sig(-2))) / 3
    assert bradley_terry_loss(s0, s1, labels).item() == pytest.approx(expected, rel=1e-6)
    assert bradley_terry_loss(torch.tensor([0.0]), torch.tensor([3.0]), torch.tensor([0.0])).item() == pytest.approx(-math.log(sig(3)))
    acc, n = pairwise_accuracy(s0, s1, labels)
    assert (acc, n) == (0.5, 2)  # the tie is not counted; one of the two decided pairs is right
    assert pairwise_accuracy(torch.ones(1), torch.ones(1), torch.ones(1)) == (0.5, 1)  # equal scores: half right


def test_candidate_advantages_by_hand():
    scores = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [0.0, float("nan"), 1.0]])
    adv = candidate_advantages(scores, eps=0.0)
    z = 1 / math.sqrt(2 / 3)
    assert torch.allclose(adv.advantages[0], torch.tensor([-z, 0.0, z]))
    assert adv.keep.tolist() == [[True] * 3, [False] * 3, [False] * 3]
    assert adv.advantages[1:].abs().sum() == 0 and adv.zero_std_fraction == pytest.approx(1 / 3)
    assert candidate_advantages(scores, eps=0.0, clip=1.0).advantages[0].tolist() == [-1.0, 0.0, 1.0]
    assert candidate_advantages(scores, filter_zero_std=False).keep[1].all()
    with pytest.raises(ValueError):
        candidate_advantages(torch.zeros(4, 1))


def test_choose_continuation():
    scores = torch.tensor([[0.1, 0.9, 0.5], [float("nan"), -1.0, -2.0]])
    assert choose_continuation(scores, "best").tolist() == [1, 1]
    a = choose_continuation(scores, "random", generator=torch.Generator().manual_seed(0))
    b = choose_continuation(scores, "random", generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and ((a >= 0) & (a < 3)).all()
    with pytest.raises(ValueError):
        choose_continuation(scores, "worst")


class FakeEps:
    prediction_type = "epsilon"
    alphas_cumprod = torch.linspace(0.99, 0.01, 1000)

    def alpha_cumprod_at(self, t):
        return self.alphas_cumprod[t.long()]


class FakeFlow:
    prediction_type = "flow"


def test_noising_in_each_time_convention():
    x0, eps = torch.ones(2, 3), torch.zeros(2, 3)
    assert torch.equal(model_time(FakeFlow(), torch.tensor([0.0, 0.25])), torch.tensor([0.0, 0.25]))
    assert torch.allclose(add_noise(FakeFlow(), x0, eps + 2, torch.tensor([0.0, 0.25])), torch.tensor([[1.0] * 3, [1.25] * 3]))
    fake = FakeEps()
    t = model_time(fake, torch.tensor([0.0, 1.0]))
    assert t.tolist() == [0.0, 999.0]
    abar = fake.alphas_cumprod[999]
    assert torch.allclose(add_noise(fake, x0, eps + 1, t)[1], (abar.sqrt() + (1 - abar).sqrt()).expand(3))


def test_one_time_rule_for_epsilon_models():
    """Noise level tau -> DDPM index is min(floor(tau N), N - 1) for the DRM, the SPM and DPO alike,
    with N = 1000 here: index i covers tau in [i / N, (i + 1) / N). The taus 0.0009 and 0.6
    tell it from round(tau (N - 1)), the rule the DRM had (which gives 1 and 599)."""
    fake = FakeEps()
    taus = torch.tensor([0.0, 0.5, 0.9999, 1.0, 0.0009, 0.9995, 0.6])
    assert model_time(fake, taus).tolist() == [0.0, 500.0, 999.0, 999.0, 0.0, 999.0, 600.0]


# ---- the model ------------------------------------------------------------------------------
def test_cut_unet_backbone_features_and_head():
    full = DiffusionRewardModel.from_base("tiny:shapes", drop_last_blocks=0, head_width=8)
    assert num_droppable_blocks(full.backbone) == 3
    x, t, prompts = torch.randn(2, 3, 32, 32), torch.tensor([0.3, 0.7]), ["a red circle", "two blue squares"]
    assert tuple(full.features(x, t, full.embed(prompts)).shape) == (2, 8, 32, 32)  # the last up block
    assert torch.equal(full.score_latents(x, t, prompts), torch.zeros(2))  # the head starts at zero
    cut = small_drm(drop=3)  # up blocks dropped: the mid block's 8x8 features
    assert tuple(cut.features(x, t, cut.embed(prompts)).shape) == (2, 16, 8, 8)
    assert len(cut.backbone.up_blocks) == 0 and isinstance(cut.backbone.conv_out, torch.nn.Identity)
    assert sum(p.numel() for p in cut.backbone.parameters()) < sum(p.numel() for p in full.backbone.parameters())
    cut.backbone.requires_grad_(True)
    cut.score_latents(x, t, prompts).sum().backward()  # gradients reach the backbone and the head
    assert cut.head.mlp_in[0].weight.grad.abs().sum() > 0
    assert cut.backbone.conv_in.weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="drm.drop_last_blocks"):
        DiffusionRewardModel.from_base("tiny:shapes", drop_last_blocks=4)


def test_transformer_backbone_and_clean_images():
    from diffalign.adapters import load_adapter

    assert num_droppable_blocks(load_adapter("tiny:sd3").denoiser) == 1  # 2 joint blocks: at least one is kept
    drm = small_drm("tiny:sd3", drop=1)
    assert len(drm.backbone.transformer_blocks) == 1
    x = torch.randn(3, 4, 16, 16)
    feats = drm.features(x, torch.full((3,), 0.5), drm.embed(["a", "b", "c"]))
    assert tuple(feats.shape) == (3, 16, 8, 8)  # 64 image tokens of width 16 on the 8x8 patch grid
    scores = drm.score_images(torch.rand(2, 3, 32, 32), ["a cat", "a dog"])  # VAE-encoded, scored at t = 0
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    with pytest.raises(ConfigError, match="drm.drop_last_blocks"):
        DiffusionRewardModel.from_base("tiny:sd3", drop_last_blocks=2)


def test_save_load_and_the_registered_reward(saved_drm, tmp_path):
    original, drm_dir = saved_drm
    x, t, prompts = torch.randn(3, 3, 32, 32), torch.tensor([0.0, 0.5, 0.9]), ["a red circle"] * 3
    loaded = DiffusionRewardModel.load(drm_dir)
    with torch.no_grad():
        assert torch.allclose(loaded.score_latents(x, t, prompts), original.score_latents(x, t, prompts), atol=1e-6)
    assert not any(p.requires_grad for p in loaded.parameters())
    info = json.loads((drm_dir / "drm.json").read_text())
    assert info["family"] == "shapes" and info["drop_last_blocks"] == 3 and info["base_model"] == "tiny:shapes"
    reward = reward_models.build("drm", path=str(drm_dir))
    assert torch.allclose(reward.score_latents(x, t, prompts), loaded.score_latents(x, t, prompts).detach(), atol=1e-6)
    images = torch.rand(2, 3, 32, 32)
    expected = loaded.score_latents(encode_images(loaded.adapter, images), torch.zeros(2), ["a", "b"]).detach()
    assert torch.allclose(reward(images, ["a", "b"], [{}, {}]), expected, atol=1e-6)  # clean images: t = 0
    assert torch.equal(encode_images(loaded.adapter, images), images * 2 - 1)  # pixel-space model
    with pytest.raises(RewardError, match="not a DRM folder"):
        reward_models.build("drm", path=str(tmp_path))


# ---- pairs ----------------------------------------------------------------------------------
def write_png(path, value):
    from PIL import Image

    Image.fromarray(np.full((40, 32, 3), value, dtype=np.uint8)).save(path)


def pick_a_pic_file(folder, n_rows=4):
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n_rows):
        write_png(folder / "img" / f"{i}_0.png", 200 if i % 2 else 20)
        write_png(folder / "img" / f"{i}_1.png", 20 if i % 2 else 200)
        rows.append({"caption": f"a red circle {i}", "jpg_0": f"img/{i}_0.png", "jpg_1": f"img/{i}_1.png", "label_0": float(i % 2)})
    rows.append({"caption": "a tie", "jpg_0": "img/0_0.png", "jpg_1": "img/0_1.png", "label_0": 0.5})
    rows.append({"caption": "only label_1", "image_0": "img/0_0.png", "image_1": "img/0_1.png", "label_1": 1})
    rows.append({"caption": "unlabelled", "jpg_0": "img/0_0.png", "jpg_1": "img/0_1.png", "label_0": 1, "has_label": False})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pick_a_pic_file(tmp_path):
    from diffalign.adapters import load_adapter

    path = pick_a_pic_file(tmp_path, n_rows=2)
    rows = read_pair_rows(path)
    assert [r["label_0"] for r in rows] == [0.0, 1.0, 0.5, 0.0]  # has_label=false skipped; label_1=1 -> label_0=0
    assert len(read_pair_rows(path, drop_ties=True)) == 3
    pairs = load_latent_pairs(path, load_adapter("tiny:shapes"), 32)
    assert len(pairs) == 4 and pairs.latents.shape == (8, 3, 32, 32)
    assert torch.allclose(pairs.latents[0], torch.full((3, 32, 32), 2 * 20 / 255 - 1), atol=1e-6)  # centre crop, resize, 2x - 1
    assert pairs.prompts[:2] == ["a red circle 0"] * 2
    (tmp_path / "img" / "1_1.png").unlink()
    with pytest.raises(PairFileError, match=r"pairs.jsonl:2: image .*1_1.png' does not exist"):
        read_pair_rows(path)


def test_generated_pairs_follow_the_reward():
    from diffalign.adapters import load_adapter

    adapter = load_adapter("tiny:shapes")
    reward = reward_models.build("brightness")
    pairs = generate_latent_pairs(adapter, ["a red circle", "a blue square"], reward, samples_per_prompt=3, num_steps=2,
                           guidance_scale=1.0, resolution=32, seed=0, max_pairs_per_prompt=2)
    assert 1 <= len(pairs) <= 4 and pairs.rewards.shape == (6,)
    for (a, b), y in zip(pairs.pairs.tolist(), pairs.label_0.tolist()):
        assert pairs.prompts[a] == pairs.prompts[b] and a // 3 == b // 3
        assert y == float(pairs.rewards[a] > pairs.rewards[b])
    brightness = adapter.decode(pairs.latents).mean(dim=(1, 2, 3))  # the stored latents are the scored samples
    assert torch.allclose(brightness, pairs.rewards, atol=1e-5)


def synthetic_brightness_pairs(n, generator):
    """Pairs of flat images: the brighter one is preferred; its position in the pair is random."""
    level = 0.5 + 0.3 * torch.rand(n, 1, 1, 1, generator=generator)
    latents = torch.cat([level, -level]).expand(-1, 3, 32, 32) + 0.1 * torch.randn(2 * n, 3, 32, 32, generator=generator)
    pairs = torch.stack([torch.arange(n), torch.arange(n) + n], 1)
    flip = torch.rand(n, generator=generator) < 0.5
    pairs[flip] = pairs[flip].flip(1)
    return LatentPairs(latents.contiguous(), ["a red circle"] * (2 * n), pairs, (~flip).float())


def test_drm_learns_a_preference_and_chance_at_pure_noise():
    """Bradley-Terry on pairs noised with the same noise at the same t: 15 steps of the head on a
    clear preference (brightness) reach 100 % held-out accuracy at t = 0; at t = 1 both images
    of a pair are the same noise, so every pair is a coin flip (0.5)."""
    gen = torch.Generator().manual_seed(0)
    train, held = synthetic_brightness_pairs(16, gen), synthetic_brightness_pairs(8, gen)
    drm = DiffusionRewardModel.from_base("tiny:shapes", drop_last_blocks=3, head_width=16)
    opt = torch.optim.AdamW(drm.head.parameters(), lr=1e-2)
    for _ in range(15):
        xa, xb, prompts, label = train.batch(torch.randint(0, 16, (4,), generator=gen))
        u, eps = torch.rand(4, generator=gen) * 0.5, torch.randn(xa.shape, generator=gen)
        scores = drm.score_latents(torch.cat([add_noise(drm.adapter, xa, eps, u), add_noise(drm.adapter, xb, eps, u)]),
                                   torch.cat([u, u]), prompts + prompts)
        loss = bradley_terry_loss(scores[:4], scores[4:], label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    curve = accuracy_vs_t(drm, held, [0.0, 1.0])
    assert curve[0]["accuracy"] == 1.0 and curve[1]["accuracy"] == 0.5 and curve[0]["pairs"] == 8


def test_train_reward_cli_from_a_pairs_file(repo_root, tmp_path):
    path = pick_a_pic_file(tmp_path / "data")
    out = tmp_path / "drm"
    code = run_cli("train-reward", STEP_GRPO, f"output_dir={out}", "drm.base=tiny:shapes",
                   "drm.drop_last_blocks=3", "drm.head_width=8", "pairs.source=file", f"pairs.file={path}", "pairs.eval_fraction=0.3",
                   "train.steps=2", "train.batch_size=2", "eval.t_grid=[0.0,0.5]", "log.progress_bar=false")
    assert code == 0
    for name in ("drm.json", "model.safetensors", "accuracy_vs_t.png", "accuracy_vs_t.json", "config.yaml", "metrics.jsonl"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "accuracy_vs_t.json").read_text())
    assert [r["t"] for r in summary["accuracy_vs_t"]] == [0.0, 0.5] and summary["pairs"]["train"] + summary["pairs"]["eval"] == 6
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if not r.get("eval")]
    assert [r["step"] for r in steps] == [0, 1] and all(math.isfinite(r["loss"]) for r in steps)
    assert reward_models.build("drm", path=str(out)).family == "shapes"


def test_drm_config_from_the_step_grpo_run_config(repo_root, tmp_path):
    from diffalign.drm.train import load_drm_config

    cfg = load_drm_config(repo_root / STEP_GRPO, ["train.steps=7"])
    assert cfg.output_dir == "runs/drm_shapes" and cfg.drm.base == "shapes"  # reward.kwargs.path, model.id
    assert cfg.drm.drop_last_blocks == 1 and cfg.pairs.reward == "shapes_eval" and cfg.train.steps == 7
    assert cfg.prompts.source == "shapes" and cfg.train.batch_size == 32
    plain = tmp_path / "drm.yaml"
    plain.write_text("output_dir: x\ndrm:\n  base: tiny:sd3\n")
    assert load_drm_config(plain).drm.base == "tiny:sd3" and load_drm_config(plain).train.steps == 400
    with pytest.raises(ConfigError, match="drm_train"):
        load_drm_config(repo_root / "configs/tiny/stepwise_flow_grpo_sd3.yaml")


@pytest.mark.parametrize("args, needle", [
    (["pairs.source=file", "pairs.file=MISSING_IMAGE"], "missing"),
    (["pairs.source=file"], "pairs.file"),
    (["drm.drop_last_blocks=7", "pairs.source=file", "pairs.file=GOOD"], "drm.drop_last_blocks"),
    (["train.t_max=0"], "train.t_max"),
])
def test_train_reward_bad_input(repo_root, tmp_path, capsys, args, needle):
    good = pick_a_pic_file(tmp_path / "good", n_rows=2)
    bad = pick_a_pic_file(tmp_path / "bad", n_rows=2)
    (tmp_path / "bad" / "img" / "1_0.png").unlink()
    args = [a.replace("MISSING_IMAGE", str(bad)).replace("GOOD", str(good)) for a in args]
    out = tmp_path / "drm"
    assert run_cli("train-reward", STEP_GRPO, f"output_dir={out}", "drm.base=tiny:shapes", *args) == 2
    assert needle in last_error_line(capsys)
    assert not out.exists()


# ---- Step-GRPO ------------------------------------------------------------------------------
def step_grpo_args(tmp_path, drm_dir):
    return [f"output_dir={tmp_path / 'r'}", "model.id=tiny:shapes", f"reward.kwargs.path={drm_dir}", "max_iterations=1",
            "rollout.prompts_per_iteration=1", "rollout.group_size=2", "sampling.num_steps=2", "algorithm.num_candidates=3",
            "lora.rank=4", *FAST_ONE_PROMPT]


def test_step_grpo_end_to_end_best_then_random_continuation(repo_root, tmp_path, drm_dir):
    cfg = load_config(repo_root / STEP_GRPO, step_grpo_args(tmp_path, drm_dir) + ["max_iterations=2"])
    seen = []

    class Spy(DRMStepGRPOTrainer):
        def rollout(self, iteration):
            self.algo.continuation = ("best", "random")[iteration]  # both switches in one run
            seen.append(super().rollout(iteration))
            return seen[-1]

    Spy(cfg).train()
    best, rand = seen
    assert best["steps"] == [0, 1] and best["nexts"][0].shape == (2, 3, 3, 32, 32)
    pick = best["scores"][0].argmax(1)  # "best": the next state is the best-scored candidate
    assert torch.equal(best["states"][1], best["nexts"][0][torch.arange(2), pick])
    for c in range(2):  # "random": the next state is one of the candidates
        assert any(torch.equal(rand["states"][1][c], rand["nexts"][0][c, j]) for j in range(3))
    records = [r for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) if not r.get("eval")]
    rec = records[0]
    assert rec["drm_forwards"] == 2 * 2 * 3 and rec["branched_steps"] == 2
    assert rec["trained_terms"] == 2 * 2 * 3 and rec["kept_frac"] == 1.0  # a random head: the k scores differ
    assert rec["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and rec["optimizer_steps"] == 1  # one micro-batch of 4 states
    assert "reward/acc/overall" in rec and len(records) == 2  # ShapesEval monitors the finals
    # the recipe's train.guard: ShapesEval on the chains' finals beside the DRM's score of the candidates
    assert rec["guard/learned"] == rec["drm_score_mean"] and rec["guard/verifier_images"] == 2
    assert rec["guard/verifier"] == pytest.approx(rec["reward_mean"])  # the same ShapesEval on the same images
    assert (tmp_path / "r" / "final" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("args, needle", [
    (["reward.name=shapes_eval", "reward.kwargs={}"], "cannot score noisy states"),
    (["algorithm.num_candidates=1"], "algorithm.num_candidates"),
    (["algorithm.num_candidates=65"], "algorithm.num_candidates"),
    (["reward.kwargs.path=/no/such/drm"], "is not trained yet; train it first with: diffalign train-reward"),
    (["model.id=tiny:sd3"], "cannot score sd3 latents"),
])
def test_step_grpo_bad_input(repo_root, tmp_path, capsys, drm_dir, args, needle):
    assert run_cli("train", STEP_GRPO, *step_grpo_args(tmp_path, drm_dir), *args) == 2
    assert needle in last_error_line(capsys)
    assert not (tmp_path / "r").exists()


# ---- step-wise sampling ---------------------------------------------------------------------
def test_stepwise_sampling_keeps_the_best_candidate():
    from diffalign.adapters import load_adapter

    sd3 = load_adapter("tiny:sd3")
    kernel = build_kernel(sd3, "flow_grpo", 0.7)
    embeds = sd3.encode_prompts(["a cat", "a dog"], with_uncond=True)
    schedule = sd3.make_schedule(3, 32, 32)
    seen = []

    def scorer(latents, t, prompts):
        s = -latents.flatten(1).abs().mean(1)  # prefer small latents
        seen.append(s.view(2, 3))
        return s

    out = stepwise_sample(sd3, kernel, embeds, ["a cat", "a dog"], schedule, scorer, branches=3, guidance_scale=4.5,
                          height=32, width=32, generator=torch.Generator().manual_seed(0))
    assert len(seen) == 2  # the last step is a deterministic ODE step
    for i in range(2):
        assert torch.equal(out.scores[:, i], seen[i].max(1).values)
    assert torch.isnan(out.scores[:, 2]).all() and out.scorer_forwards == 2 * 3 and out.images.shape == (2, 3, 32, 32)
    # one branch = plain SDE sampling with the same noise
    plain = stepwise_sample(sd3, kernel, embeds, ["a cat", "a dog"], schedule, None, branches=1, guidance_scale=4.5,
                            height=32, width=32, generator=torch.Generator().manual_seed(0))
    ref = sample_linear(sd3, kernel, embeds, schedule, torch.tensor([True, True, False]), guidance_scale=4.5, height=32,
                        width=32, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(plain.latents, ref.latents[:, -1])


def test_sample_cli(repo_root, tmp_path, drm_dir, capsys):
    common = ["sample", "--model", "tiny:shapes", "--prompts", "heldout", "--num-prompts", "1", "--steps", "2"]
    assert run_cli(*common, "--out", str(tmp_path / "plain"), "--reward", "shapes_eval") == 0
    plain = json.loads((tmp_path / "plain" / "samples.json").read_text())
    assert plain["summary"]["method"] == "plain ODE" and len(plain["images"]) == 1 and "reward/acc/overall" in plain["summary"]
    assert run_cli(*common, "--out", str(tmp_path / "sw"), "--drm", str(drm_dir), "--branches", "2") == 0
    assert json.loads((tmp_path / "sw" / "samples.json").read_text())["summary"]["method"] == "stepwise k=2"
    assert (tmp_path / "sw" / "grid.png").is_file()
    capsys.readouterr()
    for bad, needle in ((["--branches", "0"], "--branches"), (["--branches", "65", "--drm", str(drm_dir)], "--branches"),
                        (["--branches", "3"], "needs --drm"), (["--branches", "2", "--drm", str(tmp_path)], "not a DRM folder")):
        assert run_cli(*common, "--out", str(tmp_path / "bad"), *bad) == 2
        assert needle in last_error_line(capsys)


def test_sample_prompts_outside_the_shapes_grammar_are_warned_about_or_refused():
    from diffalign.drm.sampling import check_shapes_prompts

    lines = []
    check_shapes_prompts(["a photo of a red circle", "a photo of two squares"], scored=True, log=lines.append)
    assert lines == []  # grammar prompts pass silently
    check_shapes_prompts(["a red circle", "a photo of a cat", "a red circle"], scored=False, log=lines.append)
    assert len(lines) == 1 and lines[0].startswith("warning: prompt 'a red circle'") and "(and 1 more)" in lines[0]
    with pytest.raises(ConfigError, match="ShapesEval scores prompts of the shapes grammar only"):
        check_shapes_prompts(["a photo of a cat"], scored=True, log=lines.append)
