"""Diffusion-DPO: the loss on hand-computed numbers, the forward process it noises with, and the
recipe end to end (a pair file, pairs generated from the base model, bad input)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from diffalign.algorithms.diffusion_dpo import diffusion_dpo_loss, per_sample_mse
from tests.helpers.tiny_run import FAST, run_cli

CONFIG = "configs/shapes/diffusion_dpo.yaml"
TINY = ["model.id=tiny:sd15", "model.resolution=32", "sampling.kernel=ddim", "sampling.noise_level=1.0", "train.batch_size=4",
        "train.optimizer_steps_per_iteration=1", "prompts.source=list", "prompts.train=[a cat,a dog]", "prompts.eval=[a cat]",
        "reward.name=jpeg_compressibility", "reward.kwargs={}"]


# ---------------------------------------------------------------- the loss


def test_per_sample_mse():
    pred = torch.tensor([[[1.0, 2.0]], [[0.0, 0.0]]])
    target = torch.tensor([[[0.0, 0.0]], [[3.0, 1.0]]])
    torch.testing.assert_close(per_sample_mse(pred, target), torch.tensor([2.5, 5.0]))


def test_diffusion_dpo_loss_hand_computed():
    # model: e_w - e_l = -0.02; reference: 0 -> inside = -0.5 * 100 * (-0.02 - 0) = 1
    res = diffusion_dpo_loss(torch.tensor([0.10]), torch.tensor([0.12]), torch.tensor([0.11]), torch.tensor([0.11]), beta=100.0)
    assert res.inside.item() == pytest.approx(1.0)
    assert res.loss.item() == pytest.approx(math.log1p(math.exp(-1.0)))
    assert res.implicit_accuracy.item() == 1.0
    assert res.model_diff.item() == pytest.approx(-0.02) and res.ref_diff.item() == pytest.approx(0.0)


def test_diffusion_dpo_gradient_at_the_reference():
    # policy == reference: loss log 2; d loss / d e_w = 0.25 * beta (raise the winner's error: worse),
    # d loss / d e_l = -0.25 * beta; no gradient reaches the reference errors
    e_w = torch.tensor([0.3], requires_grad=True)
    e_l = torch.tensor([0.4], requires_grad=True)
    r_w = torch.tensor([0.3], requires_grad=True)
    res = diffusion_dpo_loss(e_w, e_l, r_w, torch.tensor([0.4]), beta=8.0)
    assert res.loss.item() == pytest.approx(math.log(2))
    res.loss.backward()
    assert e_w.grad.item() == pytest.approx(2.0) and e_l.grad.item() == pytest.approx(-2.0)
    assert r_w.grad is None


# ---------------------------------------------------------------- the forward process


def test_forward_process_flow_and_epsilon():
    from diffalign.adapters import load_adapter
    from diffalign.forward_process import add_noise, denoising_target, encode_images, model_time, noise_level

    flow = load_adapter("tiny:sd3")
    x0, eps = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    t = torch.tensor([0.25, 1.0])
    torch.testing.assert_close(add_noise(flow, x0, eps, t), torch.stack([0.75 * x0[0] + 0.25 * eps[0], eps[1]]))
    torch.testing.assert_close(denoising_target(flow, x0, eps), eps - x0)
    torch.testing.assert_close(noise_level(flow, model_time(flow, torch.tensor([0.0, 0.3]))), torch.tensor([0.0, 0.3]))

    eps_model = load_adapter("tiny:sd15")
    t = model_time(eps_model, torch.tensor([0.0, 0.5, 0.9999]))
    assert t.tolist() == [0.0, 500.0, 999.0]  # DDPM indices
    abar = eps_model.alphas_cumprod[500]
    torch.testing.assert_close(add_noise(eps_model, x0[:1], eps[:1], t[1:2]), abar.sqrt() * x0[:1] + (1 - abar).sqrt() * eps[:1])
    assert noise_level(eps_model, torch.tensor([-1.0, 500.0])).tolist() == [0.0, 0.5]  # the final clean state is 0
    torch.testing.assert_close(denoising_target(eps_model, x0, eps), eps)
    # predicting with the true noise recovers x0 exactly (the noising matches the adapter's Tweedie)
    x_t = add_noise(eps_model, x0[:1], eps[:1], t[1:2])
    torch.testing.assert_close(eps_model.to_x0(eps[:1], x_t, t[1:2]), x0[:1], rtol=1e-4, atol=1e-4)
    images = torch.rand(2, 3, 32, 32)
    assert encode_images(eps_model, images).shape == (2, *eps_model.latent_shape(32, 32))


class InvertibleVAE(torch.nn.Module):
    """A "VAE" whose decoder inverts its encoder exactly (pixel unshuffle, then an affine map), with
    SD's latent scaling and a shift, and a posterior whose sample differs from its mean."""

    def __init__(self, shift_factor=None):
        super().__init__()
        self.config = SimpleNamespace(scaling_factor=0.18215, shift_factor=shift_factor, latents_mean=None, latents_std=None)
        self.register_buffer("anchor", torch.zeros(1))

    @property
    def dtype(self):
        return self.anchor.dtype

    @property
    def device(self):
        return self.anchor.device

    def encode(self, x):
        mean = torch.nn.functional.pixel_unshuffle(x, 8) * 3.0 + 0.5
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=mean, sample=lambda: mean + torch.randn_like(mean)))

    def decode(self, z, return_dict=False):
        return (torch.nn.functional.pixel_shuffle((z - 0.5) / 3.0, 8),)


@pytest.mark.parametrize("shift", [None, 0.1159])
def test_encode_images_inverts_the_adapters_decode(shift):
    """decode(encode(images)) gives the images back to fp32 rounding when the VAE itself is
    invertible: the latent normalisation, the posterior mean and the [0, 1] -> [-1, 1] map are
    those the adapter's decode undoes. Each way of getting one of them wrong misses by more than 0.01 (a thousand times that)."""
    from diffalign.adapters import load_adapter
    from diffalign.forward_process import encode_images

    adapter = load_adapter("tiny:sd15")
    vae = InvertibleVAE(shift)
    adapter.pipeline.vae = vae
    images = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(adapter.decode(encode_images(adapter, images)), images, rtol=0, atol=1e-5)
    shift = shift or 0.0
    post = vae.encode(images * 2 - 1).latent_dist
    broken = {"unscaled": post.mean - shift, "sampled": (post.sample() - shift) * 0.18215,
              "unshifted": post.mean * 0.18215, "no 2x - 1": (vae.encode(images).latent_dist.mean - shift) * 0.18215}
    if not shift:
        del broken["unshifted"]
    for name, z in broken.items():
        assert float((adapter.decode(z) - images).abs().mean()) > 0.01, name


# ---------------------------------------------------------------- the recipe


def _pair_file(folder, labels):
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, label in enumerate(labels):
        for j, value in enumerate((200, 40)):
            Image.new("RGB", (32, 32), (value, value // 2, value)).save(folder / f"{i}_{j}.png")
        lines.append(json.dumps({"caption": ["a cat", "a dog"][i % 2], "jpg_0": f"{i}_0.png", "jpg_1": f"{i}_1.png", "label_0": label}))
    (folder / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "pairs.jsonl"


def test_dpo_trains_from_a_pair_file_starting_at_the_reference(repo_root, tmp_path):
    pairs = _pair_file(tmp_path / "pairs", [1, 0, 0.5, 1])
    out = tmp_path / "run"
    code = run_cli("train", CONFIG, f"output_dir={out}", f"algorithm.pairs={pairs}", "max_iterations=2", *TINY, *FAST)
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert [r["iteration"] for r in train] == [0, 1]
    # the first micro-batch sees policy == reference (LoRA B = 0): loss log 2, equal error differences
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert train[0]["model_diff"] == pytest.approx(train[0]["ref_diff"], abs=1e-6)
    assert train[1]["model_diff"] != pytest.approx(train[1]["ref_diff"], abs=1e-9)  # the policy moved
    assert train[0]["optimizer_steps"] == 1 and train[0]["pairs_seen"] == 4
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_dpo_generates_pairs_from_the_base_model(repo_root, tmp_path):
    out = tmp_path / "run"
    code = run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", "algorithm.generate_images_per_prompt=2",
                   *TINY, *FAST)
    assert code == 0
    lines = (out / "pairs" / "pairs.jsonl").read_text().splitlines()
    assert len(lines) == 2  # one pair per prompt (2 images), labelled by the reward; no ties with jpeg sizes
    record = json.loads(lines[0])
    assert record["label_0"] in (0.0, 1.0) and (out / "pairs" / record["jpg_0"]).is_file()


@pytest.mark.parametrize("extra, needle", [
    (["algorithm.pairs=/nonexistent/pairs.jsonl"], "pair file '/nonexistent/pairs.jsonl' does not exist"),
    (["algorithm.beta=0"], "'algorithm.beta' must be > 0"),
    (["algorithm.generate_images_per_prompt=1"], "'algorithm.generate_images_per_prompt' must be >= 2"),
])
def test_dpo_bad_input_is_one_line_and_exit_2(repo_root, tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    code = run_cli("train", CONFIG, f"output_dir={out}", *TINY, *extra, *FAST)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_dpo_refuses_bad_labels_and_only_ties(repo_root, tmp_path, capsys):
    bad = _pair_file(tmp_path / "bad", [1, 0.7])
    code = run_cli("train", CONFIG, f"output_dir={tmp_path / 'run'}", f"algorithm.pairs={bad}", *TINY, *FAST)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pairs.jsonl:2: label_0 must be 0, 0.5 or 1, got 0.7" in err[0], err
    assert not (tmp_path / "run").exists()
    ties = _pair_file(tmp_path / "ties", [0.5, 0.5])
    code = run_cli("train", CONFIG, f"output_dir={tmp_path / 'run2'}", f"algorithm.pairs={ties}", *TINY, *FAST)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no preference pairs with a winner" in err[0], err
    assert not (tmp_path / "run2").exists()
