"""SPO: pair selection and losses on hand-computed numbers, the step-aware preference models
(tiny CLIP built in code, ShapesSPM), the step-wise resampler (DDIM and flow SDE kernels), SPM
training through ``diffalign train-spm``, and SPO end to end through the CLI with bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

import reward_models
from diffalign.algorithms.continuation import choose_continuation
from diffalign.algorithms.spo import pair_accuracy, select_pairs, spm_pair_loss, spo_loss
from diffalign.pairs import PairFileError, label_pairs, read_pairs, write_pairs
from diffalign.spm.model import ClipSPM, ShapesSPM, SPMError, load_spm
from tests.helpers.tiny_run import FAST, run_cli

TINY_SPO = "configs/tiny/spo_sd15.yaml"


# ---------------------------------------------------------------- pure functions


def test_spm_pair_loss_hand_computed():
    s0, s1 = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.0])
    loss = spm_pair_loss(s0, s1, torch.tensor([1.0, 0.0, 0.5]))
    # p0 = sigmoid(1): -log p0 = log(1 + e^-1); -log p1 = log(1 + e^1); a tie averages them
    expected = [math.log1p(math.exp(-1)), math.log1p(math.e), 0.5 * (math.log1p(math.exp(-1)) + math.log1p(math.e))]
    torch.testing.assert_close(loss, torch.tensor(expected))
    # a tie is minimal when the scores are equal: the gradient pulls them together
    a = torch.tensor([1.0], requires_grad=True)
    spm_pair_loss(a, torch.tensor([0.0]), torch.tensor([0.5])).sum().backward()
    assert a.grad.item() == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item() - 0.5)


def test_pair_accuracy_ignores_ties():
    correct, decided = pair_accuracy(torch.tensor([2.0, 0.0, 1.0, 3.0]), torch.tensor([1.0, 1.0, 1.0, 0.0]),
                                     torch.tensor([1.0, 1.0, 0.5, 0.0]))
    assert decided.tolist() == [True, True, False, True]
    assert correct.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_select_pairs_margin_threshold_and_ties():
    scores = torch.tensor([[2.0, 0.0, 1.0], [0.5, 0.5, 0.5], [0.0, 3.0, 1.0]])
    sel = select_pairs(scores, threshold=0.5)
    assert sel.best.tolist() == [0, 0, 1] and sel.worst.tolist()[0] == 1 and sel.worst.tolist()[2] == 0
    # softmax(s_b, s_w)[0] - [1] = tanh((s_b - s_w) / 2)
    torch.testing.assert_close(sel.margin, torch.tensor([math.tanh(1.0), 0.0, math.tanh(1.5)]))
    assert sel.keep.tolist() == [True, False, True]
    assert select_pairs(scores, threshold=0.8).keep.tolist() == [False, False, True]
    assert select_pairs(scores, threshold=0.0).keep.tolist() == [True, False, True]  # equal scores never pair
    with pytest.raises(ValueError, match="threshold"):
        select_pairs(scores, threshold=1.0)
    with pytest.raises(ValueError, match="k >= 2"):
        select_pairs(torch.zeros(3, 1), threshold=0.1)


def test_choose_continuation_best_and_uniform_random():
    scores = torch.tensor([[0.0, 2.0, 1.0]]).repeat(3000, 1)
    assert choose_continuation(scores, "best").eq(1).all()
    picks = choose_continuation(scores, "random", torch.Generator().manual_seed(0))
    counts = torch.bincount(picks, minlength=3).float() / len(picks)
    assert (counts - 1 / 3).abs().max() < 0.04  # uniform, whatever the scores
    again = choose_continuation(scores, "random", torch.Generator().manual_seed(0))
    assert torch.equal(picks, again)
    with pytest.raises(ValueError):
        choose_continuation(scores, "worst")


def test_spo_loss_hand_computed_and_clamp_gradient():
    logp_w = torch.tensor([0.05], requires_grad=True)
    logp_l = torch.tensor([-0.2], requires_grad=True)
    zero = torch.zeros(1)
    res = spo_loss(logp_w, zero, logp_l, zero, beta=10.0, clip_range=0.1)
    # r_w = e^0.05 = 1.0513 (inside [0.9, 1.1]); r_l = e^-0.2 = 0.8187 -> clamped to 0.9
    logit = 10.0 * (0.05 - math.log(0.9))
    assert res.loss.item() == pytest.approx(math.log1p(math.exp(-logit)), rel=1e-5)
    assert res.ratio_lose.item() == pytest.approx(0.9) and res.ratio_win.item() == pytest.approx(math.exp(0.05), rel=1e-6)
    assert res.clip_frac.item() == pytest.approx(0.5) and res.accuracy.item() == 1.0
    res.loss.backward()
    assert logp_l.grad.item() == 0.0  # the clamped ratio carries no gradient (SPO's trust region)
    # d/dlogp_w of -log sigmoid(10 * logp_w + c) = -10 * sigmoid(-logit)
    assert logp_w.grad.item() == pytest.approx(-10.0 / (1 + math.exp(logit)), rel=1e-5)
    # at the reference (ratios 1) the loss is log 2 for any beta
    same = spo_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), beta=3.0)
    assert same.loss.item() == pytest.approx(math.log(2))


def test_label_pairs_within_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, float("nan")])
    assert label_pairs(rewards, 3) == [(0, 1, 1.0), (0, 2, 0.5), (1, 2, 0.0), (3, 4, 0.5)]
    assert label_pairs(rewards, 3, keep_ties=False) == [(0, 1, 1.0), (1, 2, 0.0)]


# ---------------------------------------------------------------- step-aware preference models


def _images(n, seed=0, size=32):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _perturb_time_conditioning(spm: ClipSPM) -> None:
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for mod in [*spm.adaln, spm.post_adaln]:
            mod[1].weight.normal_(0, 0.5)


def test_clip_spm_equals_its_backbone_at_init_and_depends_on_t(tmp_path):
    from reward_models.pickscore import PickScore

    spm = ClipSPM.tiny(seed=0)
    images, prompts = _images(3), ["a photo of a red circle", "a photo of two squares", "a photo of a red circle"]
    # identity adaLN at init: the SPM is its backbone's PickScore at every noise level
    reference = PickScore.from_components(spm.clip, spm.tokenizer, spm.processor_config).score(images, prompts)
    for tau in (0.0, 0.5, 0.99):
        torch.testing.assert_close(spm(images, prompts, torch.full((3,), tau)), reference, rtol=1e-4, atol=1e-4)
    _perturb_time_conditioning(spm)
    s_clean, s_noisy = spm(images, prompts, torch.zeros(3)), spm(images, prompts, torch.full((3,), 0.9))
    assert (s_clean - s_noisy).abs().max() > 1e-3
    # outside a scoring call the stock CLIP is untouched (hooks are identity without a time condition)
    pixels = spm.transform(images)
    stock = spm.clip.get_image_features(pixel_values=pixels)
    stock = stock if isinstance(stock, torch.Tensor) else stock.pooler_output
    assert torch.allclose(torch.nn.functional.normalize(stock, dim=-1),
                          PickScore.from_components(spm.clip, spm.tokenizer, spm.processor_config).image_embeddings(pixels), atol=1e-5)
    # save -> load through the reward registry reproduces the scores and takes a timestep
    spm.save_pretrained(tmp_path / "spm")
    reward = reward_models.build("spm", model=str(tmp_path / "spm"), batch_size=2)
    assert reward.takes_timestep
    torch.testing.assert_close(reward.score(images, prompts, 0.9), s_noisy.detach(), rtol=1e-4, atol=1e-4)
    meta = [{"noise_level": 0.0}, {"noise_level": 0.9}, {}]  # per-sample t from metadata, default t = 0
    torch.testing.assert_close(reward(images, prompts, meta),
                               torch.stack([s_clean[0], s_noisy[1], s_clean[2]]).detach(), rtol=1e-4, atol=1e-4)


def test_clip_spm_loads_a_clip_backbone_folder(tmp_path):
    spm = ClipSPM.tiny(seed=0)
    spm.clip.save_pretrained(tmp_path / "clip")
    spm.tokenizer.save_pretrained(tmp_path / "clip")
    (tmp_path / "clip" / "preprocessor_config.json").write_text(json.dumps(spm.processor_config))
    fresh = load_spm(str(tmp_path / "clip"))  # a CLIP / PickScore folder: untrained time conditioning
    assert isinstance(fresh, ClipSPM)
    images, prompts = _images(2), ["a photo of a circle", "a photo of a square"]
    torch.testing.assert_close(fresh(images, prompts, torch.tensor([0.3, 0.7])), spm(images, prompts, torch.zeros(2)),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(SPMError, match="does not exist"):
        load_spm(str(tmp_path / "missing" / "folder"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SPMError, match="neither an SPM folder"):
        load_spm(str(tmp_path / "empty"))


def test_shapes_spm_conditions_on_t_and_prompt_and_round_trips(tmp_path):
    spm = load_spm("tiny:shapes")
    assert isinstance(spm, ShapesSPM) and spm.takes_timestep
    images = _images(2).repeat(2, 1, 1, 1)
    with torch.no_grad():  # the condition modulations start at 0: give them a value
        for block in spm.blocks:
            block.mod.weight.normal_(0, 0.3)
    prompts = ["a photo of a red circle", "a photo of a red circle", "a photo of a blue square", "a photo of a red circle"]
    s = spm(images, prompts, torch.tensor([0.1, 0.1, 0.1, 0.8]))  # images (a, b, a, b)
    assert (s[2] - s[0]).abs().item() > 1e-6  # same image and t, another prompt
    assert (s[3] - s[1]).abs().item() > 1e-6  # same image and prompt, another t
    torch.testing.assert_close(spm(images[:1], prompts[:1], torch.tensor([0.1])), s[:1])  # no cross-talk in a batch
    s.sum().backward()
    assert spm.stem.weight.grad is not None
    spm.save_pretrained(tmp_path / "shapes_spm")
    again = load_spm(str(tmp_path / "shapes_spm"))
    torch.testing.assert_close(again(images, prompts, torch.tensor([0.1, 0.1, 0.1, 0.8])), s.detach())


# ---------------------------------------------------------------- step-wise resampler


def _brightness(images, prompts, tau):
    return images.mean(dim=(1, 2, 3))


def _rollout(adapter, kernel, prompts, seeds, **kwargs):
    from diffalign.spm.sampling import sample_stepwise

    embeds = adapter.encode_prompts(prompts, with_uncond=True)
    schedule = adapter.make_schedule(kwargs.pop("num_steps", 5), 32, 32)
    return sample_stepwise(adapter, kernel, embeds, prompts, schedule, _brightness, guidance_scale=3.0, height=32, width=32,
                           generators=[torch.Generator().manual_seed(s) for s in seeds], **kwargs)


@pytest.mark.parametrize("family, kernel_name, noise", [("sd15", "ddim", 1.0), ("sd3", "flow_grpo", 0.7)])
def test_stepwise_resampler_pairs_share_a_state_and_rescore_on_policy(family, kernel_name, noise):
    from diffalign.adapters import load_adapter
    from diffalign.sampling import build_kernel

    adapter = load_adapter(f"tiny:{family}")
    kernel = build_kernel(adapter, kernel_name, noise)
    prompts = ["a cat", "a dog"]
    out = _rollout(adapter, kernel, prompts, [11, 12], num_candidates=3, threshold=0.0, start_step=2)
    p = out.pairs
    assert out.judged_steps == [2, 3, 4] and out.scores.shape == (3, 2, 3)
    assert len(p) == int(out.keep.sum()) and len(p) > 0
    assert torch.equal(p.state_win, p.state_lose)  # one step per branch: both transitions leave the same state
    assert not torch.equal(p.next_win, p.next_lose)
    assert out.nfe == 2 + 1 + 2 * 3  # plain steps, the first shared state, k scoring forwards per non-final judgement
    # re-scoring the kept transitions with the same weights gives the sampler's log-probabilities
    emb = adapter.encode_prompts([prompts[i] for i in p.sample], with_uncond=True)
    with torch.no_grad():
        model_out = adapter.predict(p.state_win, p.t, emb, 3.0)
    for nxt, logp in ((p.next_win, p.log_prob_win), (p.next_lose, p.log_prob_lose)):
        again = kernel.step(model_out, p.state_win, p.t, p.t_next, sde=True, prev_sample=nxt).log_prob
        torch.testing.assert_close(again, logp, rtol=0, atol=1e-4)
    # the winner is the candidate the scorer liked best: its x0 prediction is brighter
    # (checked at the final, clean judgement where the scored image is the state itself)
    last = p.step == 4
    assert (adapter.decode(p.next_win[last]).mean(dim=(1, 2, 3)) > adapter.decode(p.next_lose[last]).mean(dim=(1, 2, 3))).all()
    # per-sample generators: a batch of two equals two batches of one
    single = _rollout(adapter, kernel, prompts[1:], [12], num_candidates=3, threshold=0.0, start_step=2)
    torch.testing.assert_close(single.images, out.images[1:])
    torch.testing.assert_close(single.scores[:, 0], out.scores[:, 1])


def test_stepwise_resampler_branch_chains_and_best_continuation():
    from diffalign.adapters import load_adapter
    from diffalign.sampling import build_kernel

    adapter = load_adapter("tiny:sd15")
    kernel = build_kernel(adapter, "ddim", 1.0)
    out = _rollout(adapter, kernel, ["a cat"], [3], num_candidates=2, threshold=0.0, start_step=1, branch_steps=2,
                   continue_from="best")
    assert out.judged_steps == [1, 3]  # steps 1-2 and 3-4 are judged as two-step chains
    p = out.pairs
    assert sorted(p.step.tolist()) == [1, 2, 3, 4]  # both judgements kept, two transitions each
    second = p.step % 2 == 0  # the second step of a chain starts from each chain's own state
    assert not torch.equal(p.state_win[second], p.state_lose[second])
    first = ~second
    assert torch.equal(p.state_win[first], p.state_lose[first])
    # continuing from the best candidate: the final image is the best-scored candidate's
    assert out.images.mean().item() == pytest.approx(out.scores[-1, 0].max().item(), abs=1e-5)


# ---------------------------------------------------------------- pair files and train-spm


def _write_pair_file(folder, n=8, size=32, label=None):
    """Bright-vs-dark pairs (image 0 brighter on even rows) in the Pick-a-Pic layout."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    lines = []
    g = torch.Generator().manual_seed(0)
    prompts = ["a photo of a red circle", "a photo of a blue square", "a photo of two triangles", "a photo of a circle"]
    for i in range(n):
        bright = (0.6 + 0.3 * torch.rand(size, size, 3, generator=g)).mul(255).byte().numpy()
        dark = (0.1 + 0.3 * torch.rand(size, size, 3, generator=g)).mul(255).byte().numpy()
        a, b = (bright, dark) if i % 2 == 0 else (dark, bright)
        Image.fromarray(a).save(folder / "images" / f"{i}_a.png")
        Image.fromarray(b).save(folder / "images" / f"{i}_b.png")
        lines.append(json.dumps({"caption": prompts[i % 4], "jpg_0": f"images/{i}_a.png", "jpg_1": f"images/{i}_b.png",
                                 "label_0": label if label is not None else (1 if i % 2 == 0 else 0)}))
    (folder / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "pairs.jsonl"


def test_pair_files_round_trip_and_refuse_bad_labels_and_images(tmp_path):
    pairs = read_pairs(_write_pair_file(tmp_path / "ok"))
    assert len(pairs) == 8 and pairs.images_0.dtype == torch.uint8 and pairs.label_0.tolist()[:2] == [1.0, 0.0]
    winners, losers = pairs.oriented()
    assert (winners.float().mean(dim=(1, 2, 3)) > losers.float().mean(dim=(1, 2, 3))).all()
    write_pairs(pairs.select([0, 1]), tmp_path / "copy")
    again = read_pairs(tmp_path / "copy")
    assert torch.equal(again.images_0, pairs.images_0[:2]) and again.prompts == pairs.prompts[:2]
    train, held = pairs.split(0.25, seed=0)
    assert set(train.prompts).isdisjoint(held.prompts) and len(train) + len(held) == 8

    with pytest.raises(PairFileError, match=r"label_0 must be 0, 0.5 or 1, got 0.3"):
        read_pairs(_write_pair_file(tmp_path / "bad_label", label=0.3))
    bad = tmp_path / "bad_image"
    _write_pair_file(bad)
    (bad / "images" / "3_b.png").write_bytes(b"not a png")
    with pytest.raises(PairFileError, match=r"pairs.jsonl:4: image .* cannot be read"):
        read_pairs(bad)
    (bad / "images" / "3_b.png").unlink()
    with pytest.raises(PairFileError, match="does not exist"):
        read_pairs(bad)
    mismatch = tmp_path / "mismatch.jsonl"
    mismatch.write_text(json.dumps({"caption": "x", "jpg_0": "a.png", "jpg_1": "b.png", "label_0": 1, "label_1": 1}) + "\n")
    with pytest.raises(PairFileError, match="label_1"):
        read_pairs(mismatch)


def test_spm_recipes_live_in_the_spo_configs(repo_root, capsys):
    from diffalign.config_files import load_config
    from diffalign.spm.train import load_spm_config

    shapes = load_spm_config(str(repo_root / "configs/shapes/spo.yaml"), [])
    run = load_config(repo_root / "configs/shapes/spo.yaml")
    assert shapes.output_dir == run.algorithm.spm_kwargs["model"] == "runs/spm_shapes"  # trained where the run loads it
    assert shapes.model.id == run.model.id and shapes.reward.kwargs == {"partial_credit": True} and shapes.pairs.images_per_prompt == 6
    for name in ("sd15", "sdxl"):
        cfg = load_spm_config(str(repo_root / f"configs/{name}/spo.yaml"), [])
        assert cfg.spm.backbone == "yuvalkirstain/PickScore_v1" and cfg.output_dir == f"runs/spm_{name}"
        assert cfg.train.weight_decay == 0.3 and cfg.pairs.file == "data/pickapic/train/pairs.jsonl"
    assert run_cli("train-spm", "configs/shapes/flow_grpo.yaml") == 2
    assert "run config of algorithm 'flow_grpo'" in capsys.readouterr().err
    assert run_cli("train", TINY_SPO, "algorithm.spm_train.train.lr=0", *FAST) == 2
    assert "config key 'algorithm.spm_train.train.lr' must be > 0" in capsys.readouterr().err
    assert run_cli("train", TINY_SPO, "algorithm.spm_train.bogus=1", *FAST) == 2
    assert "unknown config key 'algorithm.spm_train.bogus'" in capsys.readouterr().err


def test_train_spm_cli_writes_model_and_accuracy_curve(repo_root, tmp_path, capsys):
    pairs = _write_pair_file(tmp_path / "pairs", n=8)
    out = tmp_path / "spm"
    code = run_cli("train-spm", "configs/shapes/spo.yaml", f"output_dir={out}", "model.id=tiny:sd15", "model.resolution=32",
                   f"pairs.file={pairs}", "pairs.heldout_fraction=0.25", "spm.backbone=tiny:shapes", "train.steps=4", "train.batch_size=4",
                   "train.x0_views_per_pair=1", "eval.every=2", "eval.taus=[0.5]", "eval.curve_points=2", "train.lr=1e-2")
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "accuracy_vs_t.json").read_text())
    assert summary["taus"] == [0.0, 0.95] and len(summary["accuracy_after"]) == 2
    assert summary["train_pairs"] + summary["heldout_pairs"] == 8 and summary["heldout_pairs"] > 0
    assert (out / "accuracy_vs_t.png").stat().st_size > 1000
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in records) and any("eval/acc@0.5" in r for r in records)
    reward = reward_models.build("spm", model=str(out))
    assert reward.score(_images(2), ["a photo of a circle"] * 2, 0.5).shape == (2,)
    capsys.readouterr()
    # bad input: one line, exit 2, nothing written
    bad = _write_pair_file(tmp_path / "badpairs", n=2, label=2)
    code = run_cli("train-spm", f"output_dir={tmp_path / 'spm2'}", "model.id=tiny:sd15", f"pairs.file={bad}")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "label_0 must be 0, 0.5 or 1" in err[0]
    assert not (tmp_path / "spm2").exists()


# ---------------------------------------------------------------- SPO end to end


def test_spo_trains_on_tiny_sd15(repo_root, tmp_path):
    out = tmp_path / "run"
    code = run_cli("train", TINY_SPO, f"output_dir={out}", "max_iterations=2", "sampling.num_steps=4",
                   "algorithm.num_candidates=3", "train.guard.verifier=brightness", "train.guard.every=2", *FAST)
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert [r["iteration"] for r in train] == [0, 1]
    first = train[0]
    assert first["pairs"] > 0 and first["optimizer_steps"] >= 1 and math.isfinite(first["loss"])
    # before the first update the policy is the reference: both ratios are exactly 1, the loss log 2
    assert first["ratio_win"] == pytest.approx(1.0, abs=1e-4) and first["loss"] == pytest.approx(math.log(2), abs=1e-3)
    for key in ("spm_score_mean", "kept_frac", "margin_mean", "clip_frac", "implicit_acc", "reward_mean", "nfe_per_trajectory"):
        assert key in first, key
    # train.guard: the verifier scores the continued trajectories' finals beside the SPM's score (every 2nd iteration)
    assert first["guard/learned"] == first["spm_score_mean"] and first["guard/verifier_images"] == 2  # 1 prompt x 2
    assert "guard/verifier" not in train[1]
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("override, needle", [
    ("algorithm.num_candidates=1", "'algorithm.num_candidates' must be >= 2"),
    ("algorithm.threshold=1.0", "'algorithm.threshold' must be in [0, 1)"),
    ("algorithm.threshold=-0.1", "'algorithm.threshold' must be in [0, 1)"),
    ("algorithm.spm=jpeg_compressibility", "'algorithm.spm': reward 'jpeg_compressibility' cannot take a timestep"),
    ("algorithm.spm=pickscore", "'algorithm.spm': reward 'pickscore' cannot take a timestep"),  # refused before loading weights
    ("algorithm.spm_kwargs.model=/nonexistent/spm", "does not exist"),
    ("algorithm.resample_start=6", "'algorithm.resample_start' must be < sampling.num_steps"),
])
def test_spo_bad_input_is_one_line_and_exit_2(repo_root, tmp_path, capsys, override, needle):
    out = tmp_path / "run"
    code = run_cli("train", TINY_SPO, f"output_dir={out}", override, *FAST)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not out.exists()
