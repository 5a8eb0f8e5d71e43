"""Training a step-aware preference model (``diffalign train-spm``) and its accuracy-vs-t curve.

Recipe (SPO's SPM training, on any diffalign model): take preference pairs (a Pick-a-Pic-layout
file, or images sampled from the model and labelled by any registered reward), encode both
images of a pair to latents, noise them with the **same** noise to the **same** random noise
level ``tau ~ U[tau_min, tau_max)``, let the frozen diffusion model predict x0 of each (with
CFG), decode, and train the SPM with the pair cross-entropy
(:func:`diffalign.algorithms.spo.spm_pair_loss`, ties 0.5) on those predictions at ``tau``.

``train.x0_views_per_pair``: 0 draws a fresh (tau, noise) for every pair in every batch (the
reference); ``N > 0`` precomputes N draws per pair once and samples batches from that pool, which
moves all diffusion-model forwards out of the training loop (on a CPU the difference between
minutes and an hour for the ShapesWorld).

Configuration: :class:`SPMTrainConfig`, from its own YAML / overrides or from the
``algorithm.spm_train`` section of an SPO run config (``diffalign train-spm configs/shapes/spo.yaml``
trains the SPM that ``diffalign train configs/shapes/spo.yaml`` then uses).

Outputs in ``output_dir``: the SPM (``spm_config.json`` + weights; load it with the ``spm``
reward), ``config.yaml``, ``metrics.jsonl`` (training loss / accuracy; held-out accuracy at
``eval.taus``), ``accuracy_vs_t.json`` and ``accuracy_vs_t.png`` (held-out pairwise accuracy
against the noise level, before and after training), and ``pairs/`` when the pairs were generated.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

import reward_models
from diffalign import progress, progress as progress_bars, runs
from diffalign.adapters import load_adapter
from diffalign.adapters.base import DTYPES
from diffalign.algorithms.spo import pair_accuracy, spm_pair_loss
from diffalign.config import ModelConfig, PromptsConfig, RewardConfig, check
from diffalign.config_files import apply_overrides, dump_config, from_dict, read_yaml
from diffalign.errors import ConfigError
from diffalign.forward_process import add_noise, encode_images, model_time
from diffalign.images import resize
from diffalign.pairs import PairSet, generate_pairs, read_pairs, write_pairs
from diffalign.prompts import resolve_prompts
from diffalign.sampling.linear import SampleSpec
from diffalign.spm.model import build_spm

# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass
class SPMPairsConfig:
    file: Optional[str] = None  # Pick-a-Pic-layout pair file or folder; None = generate with `model` and `reward`
    limit: int = 0  # read only the first N pairs of the file (0 = all)
    images_per_prompt: int = 4  # generation: images per prompt; every within-prompt pair is labelled
    num_steps: int = 20  # generation: deterministic sampler steps
    guidance_scale: float = 4.0  # generation: CFG scale
    seed: int = 0  # generation: sampler seed
    keep_ties: bool = True  # generation: keep pairs with equal rewards (label 0.5)
    heldout_fraction: float = 0.15  # pairs of this fraction of the prompts are held out for evaluation

    def validate(self) -> None:
        check(self.limit >= 0, "pairs.limit", "must be >= 0")
        check(self.images_per_prompt >= 2, "pairs.images_per_prompt", "must be >= 2")
        check(self.num_steps >= 1, "pairs.num_steps", "must be >= 1")
        check(0.0 <= self.heldout_fraction < 1.0, "pairs.heldout_fraction", "must be in [0, 1)")


@dataclass
class SPMBackboneConfig:
    backbone: str = "shapes"  # shapes (new ShapesSPM) | tiny:clip | tiny:shapes | an SPM folder | a CLIP / PickScore hub id or folder
    processor: Optional[str] = None  # tokenizer + preprocessing for a CLIP backbone (PickScore: laion/CLIP-ViT-H-14-laion2B-s32B-b79K)


@dataclass
class SPMOptimConfig:
    steps: int = 2000  # optimizer steps
    batch_size: int = 64  # pairs per step
    lr: float = 1e-3
    weight_decay: float = 1e-4
    grad_clip: float = 1.0  # 0 disables
    tau_min: float = 0.0  # noise levels drawn uniformly in [tau_min, tau_max)
    tau_max: float = 1.0
    x0_guidance_scale: float = 4.0  # CFG of the frozen model's x0 predictions (reference: 5)
    x0_views_per_pair: int = 0  # 0 = fresh (tau, noise) every batch; N = a pool of N precomputed draws per pair
    x0_batch_size: int = 64  # images per diffusion-model forward

    def validate(self) -> None:
        check(self.steps >= 0, "train.steps", "must be >= 0")
        check(self.batch_size >= 1, "train.batch_size", "must be >= 1")
        check(self.lr > 0, "train.lr", "must be > 0")
        check(0.0 <= self.tau_min < self.tau_max <= 1.0, "train.tau_min", "and train.tau_max must satisfy 0 <= tau_min < tau_max <= 1")
        check(self.x0_views_per_pair >= 0, "train.x0_views_per_pair", "must be >= 0")
        check(self.x0_batch_size >= 1, "train.x0_batch_size", "must be >= 1")


@dataclass
class SPMEvalConfig:
    every: int = 500  # held-out accuracy at `taus` every N steps (0 = before and after only)
    taus: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.7, 0.95])  # reference: t = 0, 251, 501, 701, 951 of 1000
    curve_points: int = 11  # noise levels of the final accuracy-vs-t curve, evenly spaced in [0, 0.95]
    seed: int = 1234  # noise of the evaluation (same before and after)

    def validate(self) -> None:
        check(all(0.0 <= t < 1.0 for t in self.taus) and len(self.taus) > 0, "eval.taus", "must be noise levels in [0, 1)")
        check(self.curve_points >= 2, "eval.curve_points", "must be >= 2")


@dataclass
class SPMTrainConfig:
    output_dir: str = "runs/spm"  # the SPM, config.yaml, metrics.jsonl, accuracy_vs_t.{json,png}, pairs/
    seed: int = 0  # seeds the SPM init, batches and noise
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    model: ModelConfig = field(default_factory=ModelConfig)  # the diffusion model whose x0 predictions are judged
    spm: SPMBackboneConfig = field(default_factory=SPMBackboneConfig)
    pairs: SPMPairsConfig = field(default_factory=SPMPairsConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)  # generation prompts (pairs.file unset)
    reward: RewardConfig = field(default_factory=RewardConfig)  # labels of generated pairs (any registered reward)
    train: SPMOptimConfig = field(default_factory=SPMOptimConfig)
    eval: SPMEvalConfig = field(default_factory=SPMEvalConfig)

    def validate(self) -> None:
        check(bool(self.output_dir), "output_dir", "must not be empty")
        for name in ("model", "pairs", "prompts", "train", "eval"):
            getattr(self, name).validate()


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def spm_config_data(run: dict) -> dict:
    """SPMTrainConfig data from an SPO run config mapping: the run's ``seed``, ``model``, ``prompts``
    and ``reward``, overridden by ``algorithm.spm_train``; ``output_dir`` defaults to the SPM folder
    the run loads (``algorithm.spm_kwargs.model``), so that the two cannot disagree."""
    algorithm = run.get("algorithm") or {}
    data = {k: run[k] for k in ("seed", "model", "prompts", "reward") if run.get(k) is not None}
    spm_model = (algorithm.get("spm_kwargs") or {}).get("model")
    if spm_model is not None:
        data["output_dir"] = str(spm_model)
    return _deep_merge(data, algorithm.get("spm_train") or {})


def load_spm_config(path: Optional[str], overrides: list[str]) -> SPMTrainConfig:
    """YAML file (optional) + ``key=value`` overrides -> validated :class:`SPMTrainConfig`.

    The file is either an SPM training config (the :class:`SPMTrainConfig` keys) or an SPO run
    config, whose ``algorithm.spm_train`` section says how to train the SPM that run uses (see
    :func:`spm_config_data`). Overrides are SPMTrainConfig keys in both cases.
    """
    data = read_yaml(path) if path is not None else {}
    if "algorithm" in data:
        name = (data.get("algorithm") or {}).get("name")
        if name != "spo":
            raise ConfigError(f"config file {str(path)!r} is a run config of algorithm {name!r}; train-spm reads an SPM training "
                              "config or the algorithm.spm_train section of an spo run config")
        data = spm_config_data(data)
    cfg = from_dict(SPMTrainConfig, apply_overrides(data, list(overrides)))
    cfg.validate()
    return cfg


# ---------------------------------------------------------------------------------------------
# x0 predictions of noised pairs
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def predict_x0_images(adapter, images: torch.Tensor, prompts: list[str], tau: torch.Tensor, noise: torch.Tensor,
                      guidance_scale: float) -> torch.Tensor:
    """Decoded x0 predictions ``(B, 3, H, W)`` in [0, 1] of ``images`` noised to ``tau`` with ``noise``
    (``tau == 0`` rows are returned as they are: the clean image)."""
    x0 = encode_images(adapter, images)
    t = model_time(adapter, tau).to(x0.device)
    x_t = add_noise(adapter, x0, noise.to(x0.device), t)
    embeds = adapter.encode_prompts(prompts, with_uncond=guidance_scale > 1)
    out = adapter.predict(x_t, t, embeds, guidance_scale)
    pred = adapter.decode(adapter.to_x0(out, x_t, t)).float().clamp(0, 1).cpu()
    clean = (tau == 0).cpu()
    if clean.any():
        pred[clean] = images[clean].float().cpu()
    return pred


def noised_pair_views(adapter, pairs, index: torch.Tensor, tau: torch.Tensor, noise_gen: torch.Generator,
                      guidance_scale: float, batch_size: int, progress: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x0-prediction images of both images of pairs ``index`` at noise levels ``tau`` (one per pair),
    the two images of a pair with the **same** noise. Returns two uint8 ``(B, 3, H, W)`` tensors.
    ``progress``: a bar with this description (:mod:`diffalign.progress`)."""
    latent = adapter.latent_shape(pairs.images_0.shape[-2], pairs.images_0.shape[-1])
    out0, out1 = [], []
    half = max(1, batch_size // 2)
    bar = progress_bars.bar(total=len(index), desc=progress or "", unit="pair", disable=progress is None)
    for s in range(0, len(index), half):
        idx = index[s : s + half]
        noise = torch.randn((len(idx), *latent), generator=noise_gen)
        images = torch.cat([PairSet.to_float(pairs.images_0[idx]), PairSet.to_float(pairs.images_1[idx])])
        prompts = [pairs.prompts[int(i)] for i in idx]
        pred = predict_x0_images(adapter, images, prompts + prompts, torch.cat([tau[s : s + half]] * 2),
                                 torch.cat([noise, noise]), guidance_scale)
        p0, p1 = pred.chunk(2)
        out0.append((p0 * 255).round().to(torch.uint8))
        out1.append((p1 * 255).round().to(torch.uint8))
        bar.update(len(idx))
    bar.close()
    return torch.cat(out0), torch.cat(out1)


@torch.no_grad()
def accuracy_at(spm, adapter, pairs, tau_value: float, *, seed: int, guidance_scale: float, batch_size: int,
                views: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[float, int]:
    """(pairwise accuracy, number of decided pairs) of ``spm`` on ``pairs`` noised to one noise level."""
    idx = torch.arange(len(pairs))
    if views is None:
        tau = torch.full((len(pairs),), float(tau_value))
        views = noised_pair_views(adapter, pairs, idx, tau, torch.Generator().manual_seed(seed), guidance_scale, batch_size)
    correct, decided = [], []
    spm.eval()
    dev = next(spm.parameters()).device
    for s in range(0, len(pairs), batch_size):
        sl = slice(s, s + batch_size)
        prompts = pairs.prompts[sl]
        tau = torch.full((len(prompts),), float(tau_value), device=dev)
        s0 = spm(PairSet.to_float(views[0][sl]).to(dev), prompts, tau)
        s1 = spm(PairSet.to_float(views[1][sl]).to(dev), prompts, tau)
        c, d = pair_accuracy(s0.cpu(), s1.cpu(), pairs.label_0[sl])
        correct.append(c)
        decided.append(d)
    c, d = torch.cat(correct), torch.cat(decided)
    n = int(d.sum())
    return (float(c.sum() / n) if n else float("nan")), n


def plot_accuracy_vs_t(curves: dict[str, tuple[list[float], list[float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for label, (taus, accs) in curves.items():
        ax.plot(taus, accs, marker="o", ms=3, label=label)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":", label="chance")
    ax.set_xlabel("noise level t (0 = clean, 1 = noise)")
    ax.set_ylabel("held-out pairwise accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"config key 'device' is not a device: {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"config key 'device' is {name!r} but no CUDA device is available")
    return dev


def train_spm(cfg: SPMTrainConfig, *, overwrite: bool = False, log: Optional[Callable[[str], None]] = None) -> dict:
    """Train an SPM (see the module docstring); returns a summary dict (also in ``accuracy_vs_t.json``)."""
    import json


    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(cfg.output_dir)
    device = _device(cfg.device)
    # Everything that can fail on bad input happens before the output directory is touched.
    runs.check_run_dir(out, resume=False, overwrite=overwrite)
    file_pairs = None
    if cfg.pairs.file:
        file_pairs = read_pairs(cfg.pairs.file, resolution=cfg.model.resolution or None, limit=cfg.pairs.limit)
        reward_fn, prompts = None, []
    else:
        prompts, _ = resolve_prompts(cfg)
        reward_fn = reward_models.build(cfg.reward.name, device=str(device), **cfg.reward.kwargs)
    adapter = load_adapter(cfg.model.id, family=cfg.model.family, device=device, dtype=DTYPES[cfg.model.dtype])
    resolution = cfg.model.resolution or adapter.default_resolution
    spm = build_spm(cfg.spm.backbone, processor=cfg.spm.processor, seed=cfg.seed).to(device)
    if not getattr(spm, "takes_timestep", False):
        raise ConfigError(f"config key 'spm.backbone': {cfg.spm.backbone!r} is not a step-aware preference model")
    runs.prepare_run_dir(out, resume=False, overwrite=overwrite)
    runs.atomic_write_text(out / "config.yaml", dump_config(cfg))
    metrics = runs.MetricsLog(out / "metrics.jsonl")
    t_start = time.perf_counter()

    # ---- pairs ------------------------------------------------------------------------------
    generation: dict = {}
    if file_pairs is not None:
        pairs = file_pairs
    else:
        log(f"train-spm: generating pairs: {len(prompts)} prompts x {cfg.pairs.images_per_prompt} images, labelled by {cfg.reward.name!r}")
        pairs, generation = generate_pairs(
            adapter, prompts, reward_fn, images_per_prompt=cfg.pairs.images_per_prompt,
            sampling=SampleSpec(num_steps=cfg.pairs.num_steps, guidance_scale=cfg.pairs.guidance_scale, resolution=resolution,
                                seed=cfg.pairs.seed, batch_size=cfg.train.x0_batch_size),
            keep_ties=cfg.pairs.keep_ties, reward_name=cfg.reward.name,
        )
        write_pairs(pairs, out / "pairs")
        log(f"train-spm: {generation['pairs']} pairs ({generation['ties']} ties) from {generation['images']} images, "
            f"mean reward {generation['reward_mean']:.3f}; written to {out / 'pairs'}")
    if pairs.images_0.shape[-1] != resolution or pairs.images_0.shape[-2] != resolution:
        pairs = PairSet(resize(pairs.images_0, resolution), resize(pairs.images_1, resolution), pairs.prompts, pairs.label_0)
    train_set, held = pairs.split(cfg.pairs.heldout_fraction, seed=cfg.seed)
    if len(train_set) == 0:
        raise ConfigError("config key 'pairs.heldout_fraction' leaves no training pairs")
    eval_set = held if len(held) else train_set
    log(f"train-spm: {len(train_set)} training pairs, {len(held)} held-out pairs "
        f"({'by prompt' if len(held) else 'none held out: evaluating on the training pairs'})")

    g = torch.Generator().manual_seed(cfg.seed * 1000 + 3)
    tc = cfg.train

    def draw_tau(n: int) -> torch.Tensor:
        return tc.tau_min + (tc.tau_max - tc.tau_min) * torch.rand(n, generator=g)

    # ---- optional pool of precomputed x0 views ------------------------------------------------
    pool = None
    if tc.x0_views_per_pair > 0:
        index = torch.arange(len(train_set)).repeat(tc.x0_views_per_pair)
        tau = draw_tau(len(index))
        log(f"train-spm: precomputing {len(index)} x0 views of noised pairs ...")
        v0, v1 = noised_pair_views(adapter, train_set, index, tau, g, tc.x0_guidance_scale, tc.x0_batch_size,
                                   progress="train-spm: x0 views")
        pool = (index, tau, v0, v1)

    # ---- evaluation ---------------------------------------------------------------------------
    eval_views: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}  # same noisy views before and after

    def evaluate(taus: list[float]) -> dict[float, float]:
        result = {}
        for tau in progress.bar(taus, desc=f"train-spm: held-out accuracy at {len(taus)} noise levels", unit="level"):
            key = round(float(tau), 6)
            if key not in eval_views:
                eval_views[key] = noised_pair_views(adapter, eval_set, torch.arange(len(eval_set)), torch.full((len(eval_set),), key),
                                                    torch.Generator().manual_seed(cfg.eval.seed), tc.x0_guidance_scale, tc.x0_batch_size)
            result[key], _ = accuracy_at(spm, adapter, eval_set, key, seed=cfg.eval.seed, guidance_scale=tc.x0_guidance_scale,
                                         batch_size=tc.x0_batch_size, views=eval_views[key])
        return result

    curve_taus = [round(float(x), 4) for x in np.linspace(0.0, 0.95, cfg.eval.curve_points)]
    before = evaluate(sorted(set(curve_taus) | {round(t, 6) for t in cfg.eval.taus}))
    metrics.write({"step": 0, "eval": True, **{f"eval/acc@{k:g}": v for k, v in before.items()}})
    log("train-spm: held-out accuracy before training: " + ", ".join(f"t={k:g} {v:.3f}" for k, v in before.items() if k in cfg.eval.taus))

    # ---- training loop ------------------------------------------------------------------------
    params = [p for p in spm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    losses, accs = [], []
    bar = progress.bar(total=tc.steps, desc="train-spm: training", unit="step")
    for step in range(1, tc.steps + 1):
        bar.update(1)
        spm.train()
        if pool is not None:
            pick = torch.randint(0, len(pool[0]), (tc.batch_size,), generator=g)
            idx, tau, v0, v1 = pool[0][pick], pool[1][pick], pool[2][pick], pool[3][pick]
        else:
            idx = torch.randint(0, len(train_set), (tc.batch_size,), generator=g)
            tau = draw_tau(len(idx))
            v0, v1 = noised_pair_views(adapter, train_set, idx, tau, g, tc.x0_guidance_scale, tc.x0_batch_size)
        prompts_b = [train_set.prompts[int(i)] for i in idx]
        label = train_set.label_0[idx]
        both = torch.cat([PairSet.to_float(v0), PairSet.to_float(v1)]).to(device)
        scores = spm(both, prompts_b + prompts_b, torch.cat([tau, tau]).to(device))
        s0, s1 = scores.chunk(2)
        loss = spm_pair_loss(s0, s1, label.to(device)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        optimizer.step()
        c, d = pair_accuracy(s0.detach().cpu(), s1.detach().cpu(), label)
        losses.append(float(loss.detach()))
        accs.append(float(c.sum() / d.sum()) if d.any() else float("nan"))
        if step % 50 == 0 or step == tc.steps:
            metrics.write({"step": step, "loss": float(np.mean(losses[-50:])), "train_acc": float(np.nanmean(accs[-50:])),
                           "seconds": time.perf_counter() - t_start})
        if cfg.eval.every and step % cfg.eval.every == 0 and step < tc.steps:
            mid = evaluate(cfg.eval.taus)
            metrics.write({"step": step, "eval": True, **{f"eval/acc@{k:g}": v for k, v in mid.items()}})
            log(f"train-spm: step {step}/{tc.steps}, loss {np.mean(losses[-50:]):.4f}, held-out accuracy "
                + ", ".join(f"t={k:g} {v:.3f}" for k, v in mid.items()))

    bar.close()

    # ---- final evaluation, curve, weights -----------------------------------------------------
    after = evaluate(sorted(set(curve_taus) | {round(t, 6) for t in cfg.eval.taus}))
    metrics.write({"step": tc.steps, "eval": True, **{f"eval/acc@{k:g}": v for k, v in after.items()}})
    spm.eval()
    spm.save_pretrained(out)
    summary = {
        "backbone": cfg.spm.backbone, "model": cfg.model.id, "steps": tc.steps, "train_pairs": len(train_set),
        "heldout_pairs": len(held), "heldout_decided_pairs": int((eval_set.label_0 != 0.5).sum()), "generation": generation,
        "taus": curve_taus, "accuracy_before": [before[t] for t in curve_taus], "accuracy_after": [after[t] for t in curve_taus],
        "seconds": time.perf_counter() - t_start,
        "final_train_loss": float(np.mean(losses[-50:])) if losses else float("nan"),
    }
    runs.atomic_write_text(out / "accuracy_vs_t.json", json.dumps(summary, indent=2))
    plot_accuracy_vs_t({"before training": (curve_taus, summary["accuracy_before"]),
                        "after training": (curve_taus, summary["accuracy_after"])},
                       out / "accuracy_vs_t.png",
                       f"SPM ({cfg.spm.backbone}) on {cfg.model.id}: {summary['heldout_decided_pairs']} pairs"
                       + ("" if len(held) else " (training pairs)"))
    log("train-spm: held-out accuracy after training: " + ", ".join(f"t={k:g} {after[k]:.3f}" for k in sorted(after) if k in cfg.eval.taus))
    log(f"train-spm: wrote {out} ({summary['seconds'] / 60:.1f} min)")
    if not math.isfinite(summary["final_train_loss"]) and tc.steps:
        log("train-spm: warning: the training loss is not finite")
    return summary
