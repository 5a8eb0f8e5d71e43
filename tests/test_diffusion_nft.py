"""DiffusionNFT: the loss on hand-computed numbers, the old adapter (second peft adapter, EMA), end to end."""

import json

import pytest
import torch

from diffalign.algorithms.diffusion_nft import ema_update_, nft_loss, old_policy_decay, optimality_probability
from diffalign.config_files import load_config
from diffalign.trainer import build_trainer
from diffalign.recipes.diffusion_nft import OLD_ADAPTER, DiffusionNFTTrainer
from diffalign.training.checks import SelfCheckError
from tests.helpers.tiny_run import FAST, ROOT, run_cli

CONFIG = "configs/tiny/diffusion_nft_sd3.yaml"


# ---- the loss, by hand ---------------------------------------------------------------------
# Two samples of two elements each.
# Sample 1: t = 0.5, x_t = [1, 1], x0 = [0.2, 0], v_theta = [1, 2], v_old = [2, 2], v_ref = [1, 1], A = 2.5.
#   b = 1: v+ = v_theta -> x0+ = x_t - t v+ = [0.5, 0]; x0+ - x0 = [0.3, 0]: mean sq 0.045, mean |.| 0.15 -> L+ = 0.3
#          v- = 2 v_old - v_theta = [3, 2] -> x0- = [-0.5, 0]; x0- - x0 = [-0.7, 0]: 0.245 / 0.35 -> L- = 0.7
#          r = 2.5 / 10 + 0.5 = 0.75; policy = 5 * (0.75 * 0.3 + 0.25 * 0.7) / 1 = 2.0
#          KL = mean([0, 1]^2) = 0.5
# Sample 2: t = 1, x_t = [1, -1], x0 = [0, 0], v_theta = [1, -2], v_old = [1, -1], v_ref = [0, -2], A = -10 (-> -5).
#   b = 1: x0+ = [0, 1] -> L+ = 0.5 / 0.5 = 1; v- = [1, 0] -> x0- = [0, -1] -> L- = 1; r = 0 -> policy = 5
#          KL = mean([1, 0]^2) = 0.5
# kl_beta 0.1: per sample [2.05, 5.05], loss 3.55.


def _example():
    v_theta = torch.tensor([[1.0, 2.0], [1.0, -2.0]], requires_grad=True)
    v_old = torch.tensor([[2.0, 2.0], [1.0, -1.0]])
    v_ref = torch.tensor([[1.0, 1.0], [0.0, -2.0]])
    x_t = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    x0 = torch.tensor([[0.2, 0.0], [0.0, 0.0]])
    t = torch.tensor([0.5, 1.0])
    adv = torch.tensor([2.5, -10.0])
    return v_theta, v_old, v_ref, x_t, x0, t, adv


def test_nft_loss_hand_computed():
    v_theta, v_old, v_ref, x_t, x0, t, adv = _example()
    out = nft_loss(v_theta, v_old, x_t, x0, t, adv, v_ref=v_ref, nft_beta=1.0, adv_clip=5.0, policy_loss_scale=5.0, kl_beta=0.1)
    torch.testing.assert_close(out.per_sample, torch.tensor([2.05, 5.05]))
    torch.testing.assert_close(out.loss, torch.tensor(3.55))
    torch.testing.assert_close(out.policy_loss, torch.tensor(3.5))
    torch.testing.assert_close(out.kl, torch.tensor(0.5))
    torch.testing.assert_close(out.positive_loss, torch.tensor(0.65))  # mean(0.3, 1)
    torch.testing.assert_close(out.negative_loss, torch.tensor(0.85))  # mean(0.7, 1)
    torch.testing.assert_close(out.r_mean, torch.tensor(0.375))
    # old_deviation: mean((v_theta - v_old)^2) over all elements = (1 + 0 + 0 + 1) / 4
    torch.testing.assert_close(out.old_deviation, torch.tensor(0.5))
    # scale 1 is algorithms.md's formula; no KL without kl_beta
    plain = nft_loss(v_theta, v_old, x_t, x0, t, adv, policy_loss_scale=1.0)
    torch.testing.assert_close(plain.per_sample, torch.tensor([0.4, 1.0]))


def test_nft_loss_gradient_treats_the_adaptive_weight_as_constant():
    # Sample 1 with b = 1: dL+/dv = -2 t (x0+ - x0) / (n w+) = -2 * 0.5 * [0.3, 0] / (2 * 0.15) = [-1, 0];
    # dL-/dv = +2 t (x0- - x0) / (n w-) = 2 * 0.5 * [-0.7, 0] / (2 * 0.35) = [-1, 0];
    # policy: 5 * (0.75 [-1, 0] + 0.25 [-1, 0]) = [-5, 0]; KL: 0.1 * 2 (v - v_ref) / n = [0, 0.1];
    # the loss is the mean over 2 samples: [-2.5, 0.05].
    # Sample 2: dL+/dv = -2 * 1 * [0, 1] / (2 * 0.5) = [0, -2]; dL-/dv = 2 * [0, -1] / 1 = [0, -2];
    # policy 5 * (0 * [0, -2] + 1 * [0, -2]) = [0, -10]; KL 0.1 * 2 * [1, 0] / 2 = [0.1, 0]; / 2 -> [0.05, -5].
    v_theta, v_old, v_ref, x_t, x0, t, adv = _example()
    nft_loss(v_theta, v_old, x_t, x0, t, adv, v_ref=v_ref, kl_beta=0.1).loss.backward()
    torch.testing.assert_close(v_theta.grad, torch.tensor([[-2.5, 0.05], [0.05, -5.0]]))


def test_nft_loss_with_a_softer_mix():
    # b = 0.5, sample 1: v+ = 0.5 v_theta + 0.5 v_old = [1.5, 2] -> x0+ = [0.25, 0], error [0.05, 0]:
    # 0.00125 / 0.025 = 0.05; v- = 1.5 v_old - 0.5 v_theta = [2.5, 2] -> x0- = [-0.25, 0], error
    # [-0.45, 0]: 0.10125 / 0.225 = 0.45; policy = 5 * (0.75 * 0.05 + 0.25 * 0.45) / 0.5 = 1.5.
    v_theta, v_old, _, x_t, x0, t, adv = _example()
    out = nft_loss(v_theta[:1], v_old[:1], x_t[:1], x0[:1], t[:1], adv[:1], nft_beta=0.5)
    torch.testing.assert_close(out.per_sample, torch.tensor([1.5]))


def test_nft_loss_bad_input():
    v_theta, v_old, v_ref, x_t, x0, t, adv = _example()
    with pytest.raises(ValueError, match="v_ref"):
        nft_loss(v_theta, v_old, x_t, x0, t, adv, kl_beta=0.1)
    with pytest.raises(ValueError, match="nft_beta"):
        nft_loss(v_theta, v_old, x_t, x0, t, adv, nft_beta=0.0)


def test_optimality_probability_decay_and_ema():
    a = torch.tensor([-7.0, -5.0, 0.0, 2.5, 5.0, 9.0])
    torch.testing.assert_close(optimality_probability(a, 5.0), torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0, 1.0]))
    # decay type 1: min(0.001 step, 0.5); type 2: 0 for 75 steps, then min(0.0075 (step - 75), 0.999)
    assert old_policy_decay(0) == 0.0
    assert old_policy_decay(100) == pytest.approx(0.1)
    assert old_policy_decay(1000) == 0.5
    assert old_policy_decay(50, rate=0.0075, max_decay=0.999, flat=75) == 0.0
    assert old_policy_decay(175, rate=0.0075, max_decay=0.999, flat=75) == pytest.approx(0.75)
    assert old_policy_decay(1000, rate=0.0075, max_decay=0.999, flat=75) == 0.999
    old, new = [torch.tensor([1.0, -2.0])], [torch.tensor([3.0, 2.0])]
    ema_update_(old, new, 0.25)  # 0.25 * old + 0.75 * new
    torch.testing.assert_close(old[0], torch.tensor([2.5, 1.0]))


# ---- the old adapter on a real (tiny) model ------------------------------------------------


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    out = tmp_path_factory.mktemp("nft") / "run"
    cfg = load_config(ROOT / CONFIG, [f"output_dir={out}", *FAST])
    tr = build_trainer(cfg)
    assert isinstance(tr, DiffusionNFTTrainer)
    tr.setup()
    return tr


def _predict(tr, adapter_name=None):
    a = tr.adapter
    embeds = a.encode_prompts(["a cat"], with_uncond=False)
    x = torch.randn((1, *a.latent_shape(32, 32)), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        if adapter_name is None:
            return a.predict(x, torch.tensor([0.6]), embeds)
        with tr.adapter_active(adapter_name):
            return a.predict(x, torch.tensor([0.6]), embeds)


def test_old_adapter_is_a_second_frozen_peft_adapter(trainer):
    tr = trainer
    assert tr.old_params and len(tr.old_params) == len(tr.trainable)
    assert all(f".{OLD_ADAPTER}." in n for n in tr.old_names)
    assert all(not p.requires_grad for p in tr.old_params)
    optimised = {id(p) for group in tr.optimizer.param_groups for p in group["params"]}
    assert not optimised & {id(p) for p in tr.old_params}
    # it starts as a copy of the trained adapter: same velocity
    torch.testing.assert_close(_predict(tr, OLD_ADAPTER), _predict(tr))
    # the export holds only the trained adapter
    from diffalign.export import lora_state_dict

    keys = lora_state_dict(tr.adapter)
    assert keys and not any(OLD_ADAPTER in k for k in keys)


def test_old_adapter_ema_and_switching(trainer):
    tr = trainer
    saved_new = [p.detach().clone() for p in tr.trainable]
    saved_old = [p.detach().clone() for p in tr.old_params]
    try:
        with torch.no_grad():  # an "update" of the trained adapter
            for p in tr.trainable:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.1)
        v_new, v_old = _predict(tr), _predict(tr, OLD_ADAPTER)
        assert (v_new - v_old).abs().max() > 1e-4  # the two adapters now differ
        assert all(p.requires_grad for p in tr.trainable)  # switching back re-enabled the trained adapter
        assert all(not p.requires_grad for p in tr.old_params)
        tr.optimizer_steps_done = 300  # d = min(0.001 * 300, 0.5) = 0.3
        d = tr.update_old_adapter()
        assert d == pytest.approx(0.3)
        for o, o0, n in zip(tr.old_params, saved_old, tr.trainable):
            torch.testing.assert_close(o, 0.3 * o0 + 0.7 * n.detach())
        # checkpoint state round trip
        state = tr.extra_state()
        for p in tr.old_params:
            p.data.zero_()
        tr.load_extra_state(state)
        assert tr.optimizer_steps_done == 300
        for o, o0, n in zip(tr.old_params, saved_old, tr.trainable):
            torch.testing.assert_close(o, 0.3 * o0 + 0.7 * n.detach())
    finally:
        with torch.no_grad():
            for p, s in zip(tr.trainable, saved_new):
                p.copy_(s)
            for p, s in zip(tr.old_params, saved_old):
                p.copy_(s)
        tr.optimizer_steps_done = 0
        tr._checked = False


def test_self_check_catches_a_broken_old_adapter(trainer):
    tr = trainer
    saved = [p.detach().clone() for p in tr.old_params]
    try:
        with torch.no_grad():
            for p in tr.old_params:
                p.add_(0.5)
        tr._checked = False
        with pytest.raises(SelfCheckError, match="old adapter"):
            tr.iteration(0)
    finally:
        with torch.no_grad():
            for p, s in zip(tr.old_params, saved):
                p.copy_(s)
        tr.optimizer.zero_grad(set_to_none=True)


def test_rollout_samples_are_seeded_odes_of_the_old_policy(trainer):
    from diffalign.sampling.seeded import sample_seeded

    tr = trainer
    samples = tr.rollout(0)
    k = tr.cfg.rollout.group_size
    assert samples.x0.shape[0] == len(samples.seeds) == tr.cfg.rollout.prompts_per_iteration * k
    # regenerating the first prompt's seeds with the old adapter gives the same clean samples
    embeds = samples.embeds.select(slice(0, k))
    with tr.adapter_active(OLD_ADAPTER):
        again = sample_seeded(tr.adapter, embeds, samples.seeds[:k], num_steps=tr.cfg.sampling.num_steps,
                              guidance_scale=tr.cfg.sampling.guidance_scale, resolution=tr.resolution, batch_size=k)
    torch.testing.assert_close(again.latents[:, -1], samples.x0[:k], atol=1e-5, rtol=1e-5)


# ---- end to end ------------------------------------------------------------------------------


def test_train_end_to_end(repo_root, tmp_path):
    out = tmp_path / "run"
    code = run_cli("train", CONFIG, f"output_dir={out}", "max_iterations=1", *FAST)
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert len(train) == 1
    for key in ("reward_mean", "loss", "policy_loss", "kl", "positive_loss", "negative_loss", "r_mean", "old_decay",
                "grad_norm", "time/rollout", "time/update"):
        assert key in train[0], key
    assert train[0]["optimizer_steps"] == 1 and train[0]["old_decay"] == pytest.approx(0.001)
    from diffalign import runs

    ckpt = runs.load_checkpoint(runs.latest_checkpoint(out))
    assert ckpt["extra"]["optimizer_steps_done"] == 1 and ckpt["extra"]["old"]
    from diffalign.export import load_trained_adapter

    assert any("lora" in n for n, _ in load_trained_adapter(out).denoiser.named_parameters())


def test_bad_input_is_refused_before_anything_runs(repo_root, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", CONFIG, f"output_dir={out}", "lora.enabled=false", *FAST) == 2
    assert "lora.enabled" in capsys.readouterr().err and not out.exists()
    assert run_cli("train", CONFIG, f"output_dir={out}", "algorithm.nft_beta=0", *FAST) == 2
    assert "algorithm.nft_beta" in capsys.readouterr().err and not out.exists()
    assert run_cli("train", CONFIG, f"output_dir={out}", "sampling.num_steps=0", *FAST) == 2
    assert "sampling.num_steps" in capsys.readouterr().err and not out.exists()
    code = run_cli("train", CONFIG, f"output_dir={out}", "model.id=tiny:sd15", "model.resolution=32", *FAST)
    assert code == 2 and "flow-matching" in capsys.readouterr().err and not out.exists()
