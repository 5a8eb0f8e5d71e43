"""Training a DRM with the Bradley-Terry loss on pairs noised with the same noise at the same t.

``diffalign train-reward CONFIG [key=value ...] [--overwrite]`` runs :func:`train_drm` (CONFIG: a
DRM config, or a ``drm_step_grpo`` run config whose ``algorithm.drm_train`` section is the recipe,
see :func:`load_drm_config`):

1. pairs: generated (sample ``pairs.model``, label with ``pairs.reward``; training pairs from the
   training prompts, evaluation pairs from the held-out prompts) or read from a Pick-a-Pic-layout
   file (``pairs.file``; evaluation pairs from ``pairs.eval_file`` or a held-out share of prompts);
2. the DRM is built from ``drm.base`` (the policy's base checkpoint), its last
   ``drm.drop_last_blocks`` blocks dropped;
3. each step draws a batch of pairs, one noise fraction ``u ~ U(0, t_max)`` and one noise ``eps``
   per pair, noises **both** images with that same ``eps`` at that same ``t``, and minimises
   ``-log sigmoid(s_w - s_l)`` (soft labels for ties);
4. pairwise accuracy on the evaluation pairs is measured at every ``t`` of ``eval.t_grid`` (same
   noise per pair for every t), written to ``accuracy_vs_t.json`` and plotted in
   ``accuracy_vs_t.png``; the model is saved as ``drm.json`` + ``model.safetensors``, which
   ``reward.name: drm`` with ``reward.kwargs.path`` loads.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

import torch

import reward_models
from diffalign import progress, runs
from diffalign.adapters import load_adapter
from diffalign.algorithms.drm_step_grpo import bradley_terry_loss, pairwise_accuracy
from diffalign.config import LogConfig, PromptsConfig, check
from diffalign.config_files import apply_overrides, dump_config, from_dict, load_config, read_yaml, to_dict
from diffalign.drm.model import DiffusionRewardModel
from diffalign.errors import ConfigError, DiffalignError
from diffalign.forward_process import add_noise, model_time
from diffalign.pairs import LatentPairs, generate_latent_pairs, load_latent_pairs
from diffalign.prompts import resolve_prompts
from diffalign.recipes.drm_step_grpo import DRMStepGRPOConfig


# ---- config -----------------------------------------------------------------------------------
@dataclass
class DRMModelConfig:
    base: str = "shapes"  # backbone checkpoint: the policy's base model (hub id, folder, tiny:<family>, shapes)
    family: str = "auto"  # as model.family
    resolution: int = 0  # image side the DRM is trained at; 0 = the base model's default
    drop_last_blocks: int = 1  # blocks cut from the end of the denoiser (UNet: up blocks; DiT: transformer blocks)
    head_width: int = 128  # channels of the head (MLP -> conv -> pool -> MLP)
    pretrained: bool = True  # False: same architecture from random weights (the paper's ablation: far worse)
    train_backbone: bool = True  # False: train the head only on frozen backbone features

    def validate(self) -> None:
        check(self.resolution >= 0 and self.resolution % 8 == 0, "drm.resolution", "must be 0 or a positive multiple of 8")
        check(self.drop_last_blocks >= 0, "drm.drop_last_blocks", "must be >= 0")
        check(self.head_width >= 1, "drm.head_width", "must be >= 1")


@dataclass
class DRMPairsConfig:
    source: Literal["generate", "file"] = "generate"  # generate: sample + label with a reward; file: Pick-a-Pic layout
    file: Optional[str] = None  # source=file: training pairs (.jsonl/.json/.csv/.parquet)
    eval_file: Optional[str] = None  # source=file: evaluation pairs; None = a held-out share of the file's prompts
    eval_fraction: float = 0.1  # share of prompts held out when eval_file is None
    drop_ties: bool = False  # skip pairs labelled 0.5 (else trained with a soft label, never counted in accuracy)
    model: str = ""  # source=generate: model to sample; "" = drm.base
    samples_per_prompt: int = 4  # images per prompt; pairs come from images of the same prompt
    num_steps: int = 10  # ODE steps per generated image
    guidance_scale: float = 4.0
    batch_size: int = 32  # images per sampling batch
    reward: str = "shapes_eval"  # any registered reward (or dotted path) labels the pairs
    reward_kwargs: dict = field(default_factory=lambda: {"partial_credit": True})  # denser labels than pass/fail
    max_pairs_per_prompt: int = 6  # of the n(n-1)/2 possible pairs with different rewards
    num_train_prompts: int = 0  # first N training prompts (0 = all)
    num_eval_prompts: int = 0  # first N evaluation prompts (0 = all)

    def validate(self) -> None:
        if self.source == "file":
            check(self.file is not None, "pairs.file", "is required when pairs.source=file")
        check(0 < self.eval_fraction < 1, "pairs.eval_fraction", "must be in (0, 1)")
        check(self.samples_per_prompt >= 2, "pairs.samples_per_prompt", "must be >= 2 (pairs need two images of a prompt)")
        check(self.num_steps >= 1, "pairs.num_steps", "must be >= 1")
        check(self.batch_size >= 1, "pairs.batch_size", "must be >= 1")
        check(self.max_pairs_per_prompt >= 1, "pairs.max_pairs_per_prompt", "must be >= 1")


@dataclass
class DRMOptimConfig:
    steps: int = 400  # optimizer steps
    batch_size: int = 32  # pairs per step (2x images through the backbone)
    lr: float = 3.0e-4  # head
    backbone_lr: float = 3.0e-5  # backbone (pretrained: a smaller step keeps its features)
    weight_decay: float = 1.0e-4
    grad_clip: float = 1.0  # 0 disables
    t_max: float = 1.0  # training noise fractions u ~ U(0, t_max) (0 = clean, 1 = pure noise)

    def validate(self) -> None:
        check(self.steps >= 0, "train.steps", "must be >= 0")
        check(self.batch_size >= 1, "train.batch_size", "must be >= 1")
        check(self.lr > 0, "train.lr", "must be > 0")
        check(self.backbone_lr > 0, "train.backbone_lr", "must be > 0")
        check(self.grad_clip >= 0, "train.grad_clip", "must be >= 0")
        check(0 < self.t_max <= 1, "train.t_max", "must be in (0, 1]")


@dataclass
class DRMEvalConfig:
    t_grid: list[float] = field(default_factory=lambda: [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])  # noise fractions
    every: int = 100  # steps between evaluations (0 = only at the end)
    seed: int = 1234  # evaluation noise
    batch_size: int = 64

    def validate(self) -> None:
        check(len(self.t_grid) > 0 and all(0 <= t <= 1 for t in self.t_grid), "eval.t_grid", "must be a non-empty list in [0, 1]")
        check(self.every >= 0, "eval.every", "must be >= 0")


@dataclass
class DRMRunConfig:
    output_dir: str = "runs/drm"  # DRM folder: drm.json, model.safetensors, metrics.jsonl, accuracy_vs_t.{json,png}
    seed: int = 0
    drm: DRMModelConfig = field(default_factory=DRMModelConfig)
    pairs: DRMPairsConfig = field(default_factory=DRMPairsConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)  # source=generate: train / eval prompts
    train: DRMOptimConfig = field(default_factory=DRMOptimConfig)
    eval: DRMEvalConfig = field(default_factory=DRMEvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> None:
        check(bool(self.output_dir), "output_dir", "must not be empty")
        for section in (self.drm, self.pairs, self.prompts, self.train, self.eval):
            section.validate()


def load_drm_config(path: str | None, overrides=()) -> DRMRunConfig:
    """A DRM training config: a plain :class:`DRMRunConfig` YAML, or a run config (one with an
    ``algorithm`` section, e.g. ``configs/shapes/drm_step_grpo.yaml``) whose ``algorithm.drm_train``
    section holds the DRM recipe, with defaults taken from the run: ``output_dir`` = the run's
    ``reward.kwargs.path`` (where Step-GRPO will look for the DRM), ``drm.base`` / ``drm.family`` /
    ``drm.resolution`` = the run's model, ``prompts`` and ``seed`` = the run's. ``overrides``
    (``key=value``) always address the DRM config."""
    data = read_yaml(path) if path is not None else {}
    if "algorithm" in data:
        run = load_config(path)
        if not isinstance(run.algorithm, DRMStepGRPOConfig):
            raise ConfigError(f"config key 'algorithm.name': {run.algorithm.name!r} has no drm_train section; "
                              "use a drm_step_grpo config or a plain DRM config")
        defaults = {
            "output_dir": run.reward.kwargs.get("path") or f"{run.output_dir}_drm", "seed": run.seed,
            "drm": {"base": run.model.id, "family": run.model.family, "resolution": run.model.resolution},
            "prompts": to_dict(run.prompts),
        }
        data = _merge(defaults, run.algorithm.drm_train)
    cfg = from_dict(DRMRunConfig, apply_overrides(data, list(overrides)))
    cfg.validate()
    return cfg


def _merge(base: dict, update: dict) -> dict:
    """``base`` updated by ``update``, recursing into nested mappings."""
    out = dict(base)
    for key, value in (update or {}).items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# ---- evaluation -------------------------------------------------------------------------------
@torch.no_grad()
def accuracy_vs_t(drm: DiffusionRewardModel, pairs: LatentPairs, t_grid, *, seed: int = 1234, batch_size: int = 64) -> list[dict]:
    """Pairwise accuracy of ``drm`` on ``pairs`` at each noise fraction of ``t_grid``; both images of
    a pair get the same noise, and a pair keeps its noise across the grid."""
    if len(pairs) == 0:
        return [{"t": float(u), "accuracy": float("nan"), "pairs": 0} for u in t_grid]
    was_training = drm.training
    drm.eval()
    gen = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn((len(pairs), *pairs.latents.shape[1:]), generator=gen)
    out = []
    for u in t_grid:
        s0, s1, labels = [], [], []
        for start in range(0, len(pairs), batch_size):
            idx = torch.arange(start, min(start + batch_size, len(pairs)))
            xa, xb, prompts, y = pairs.batch(idx)
            t = model_time(drm.adapter, torch.full((len(idx),), float(u)))
            eps = noise[idx]
            scores = drm.score_latents(torch.cat([add_noise(drm.adapter, xa, eps, t), add_noise(drm.adapter, xb, eps, t)]),
                                       torch.cat([t, t]), prompts + prompts)
            s0.append(scores[: len(idx)].cpu())
            s1.append(scores[len(idx) :].cpu())
            labels.append(y)
        acc, n = pairwise_accuracy(torch.cat(s0), torch.cat(s1), torch.cat(labels))
        out.append({"t": float(u), "accuracy": acc, "pairs": n})
    drm.train(was_training)
    return out


def plot_accuracy_vs_t(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, rows in curves.items():
        ax.plot([r["t"] for r in rows], [r["accuracy"] for r in rows], marker="o", label=name)
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=1, label="chance")
    ax.set_xlabel("noise level t (0 = clean, 1 = pure noise)")
    ax.set_ylabel("pairwise accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_accuracy_table(rows: list[dict]) -> str:
    lines = ["     t  accuracy  pairs"]
    lines += [f"{r['t']:6.2f}  {r['accuracy']:8.3f}  {r['pairs']:5d}" for r in rows]
    return "\n".join(lines)


# ---- training ---------------------------------------------------------------------------------
def build_pairs(cfg: DRMRunConfig, drm: DiffusionRewardModel, log: Callable[[str], None]) -> tuple[LatentPairs, LatentPairs]:
    p = cfg.pairs
    if p.source == "file":
        pairs = load_latent_pairs(p.file, drm.adapter, drm.resolution, drop_ties=p.drop_ties)
        if p.eval_file:
            return pairs, load_latent_pairs(p.eval_file, drm.adapter, drm.resolution, drop_ties=p.drop_ties)
        return pairs.split(p.eval_fraction, torch.Generator().manual_seed(cfg.seed))

    train_prompts, eval_prompts = resolve_prompts(cfg)
    train_prompts = train_prompts[: p.num_train_prompts] if p.num_train_prompts else train_prompts
    eval_prompts = eval_prompts[: p.num_eval_prompts] if p.num_eval_prompts else eval_prompts
    reward_fn = reward_models.build(p.reward, device=str(drm.device), **p.reward_kwargs)
    sampler = load_adapter(p.model or cfg.drm.base, family=cfg.drm.family if not p.model else "auto", device=drm.device)
    if sampler.family != drm.family:
        raise ConfigError(f"config key 'pairs.model': a {sampler.family} model cannot make pairs for a DRM on {drm.family}")
    common = dict(samples_per_prompt=p.samples_per_prompt, num_steps=p.num_steps, guidance_scale=p.guidance_scale,
                  resolution=drm.resolution, batch_size=p.batch_size, max_pairs_per_prompt=p.max_pairs_per_prompt, log=log)
    log(f"generating pairs: {len(train_prompts)} training + {len(eval_prompts)} evaluation prompts x {p.samples_per_prompt} samples, "
        f"labelled by {p.reward}")
    train = generate_latent_pairs(sampler, train_prompts, reward_fn, seed=cfg.seed, **common)
    held = generate_latent_pairs(sampler, eval_prompts, reward_fn, seed=cfg.seed + 1, **common)
    del sampler
    return train, held


def train_drm(cfg: DRMRunConfig, *, overwrite: bool = False, log: Optional[Callable[[str], None]] = None) -> dict:
    """Train and save a DRM (see the module docstring). Returns the summary written to drm.json."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(cfg.output_dir)
    runs.check_run_dir(out, resume=False, overwrite=overwrite)
    torch.manual_seed(cfg.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = cfg.drm
    drm = DiffusionRewardModel.from_base(m.base, drop_last_blocks=m.drop_last_blocks, head_width=m.head_width,
                                        resolution=m.resolution, pretrained=m.pretrained, family=m.family, device=device)
    t0 = time.perf_counter()
    train_pairs, eval_pairs = build_pairs(cfg, drm, log)
    pair_seconds = time.perf_counter() - t0
    if len(train_pairs) == 0:
        raise DiffalignError("no training pairs: every image of a prompt got the same reward (use more samples_per_prompt or a denser reward)")
    runs.prepare_run_dir(out, resume=False, overwrite=overwrite)
    runs.atomic_write_text(out / "config.yaml", dump_config(cfg))
    metrics = runs.MetricsLog(out / "metrics.jsonl")
    drm.backbone.requires_grad_(m.train_backbone)
    drm.head.requires_grad_(True)
    groups = [{"params": list(drm.head.parameters()), "lr": cfg.train.lr}]
    if m.train_backbone:
        groups.append({"params": [p for p in drm.backbone.parameters() if p.requires_grad], "lr": cfg.train.backbone_lr})
    opt = torch.optim.AdamW(groups, weight_decay=cfg.train.weight_decay)
    trainable = [p for g in groups for p in g["params"]]
    log(f"diffalign: DRM on {m.base} ({drm.family}, {drm.resolution}px, {m.drop_last_blocks} block(s) dropped, "
        f"{drm.feature_channels} feature channels) -> {out}")
    log(f"  pairs: {len(train_pairs)} train, {len(eval_pairs)} eval ({pair_seconds:.0f} s to build); {cfg.train.steps} steps x "
        f"{cfg.train.batch_size} pairs; trainable params {sum(p.numel() for p in trainable):,}")
    gen = torch.Generator("cpu").manual_seed(cfg.seed + 7)
    order, pos = torch.randperm(len(train_pairs), generator=gen), 0
    drm.train()
    t_start = time.perf_counter()
    bar = progress.bar(total=cfg.train.steps, desc="drm training", unit="step", disable=not cfg.log.progress_bar)
    for step in range(cfg.train.steps):
        if pos + cfg.train.batch_size > len(order):
            order, pos = torch.randperm(len(train_pairs), generator=gen), 0
        idx = order[pos : pos + cfg.train.batch_size]
        pos += len(idx)
        xa, xb, prompts, label = train_pairs.batch(idx)
        u = torch.rand(len(idx), generator=gen) * cfg.train.t_max
        t = model_time(drm.adapter, u)
        eps = torch.randn(xa.shape, generator=gen)  # the same noise for both images of a pair
        xa, xb = add_noise(drm.adapter, xa.to(device), eps, t), add_noise(drm.adapter, xb.to(device), eps, t)
        scores = drm.score_latents(torch.cat([xa, xb]), torch.cat([t, t]), prompts + prompts)
        s0, s1 = scores[: len(idx)], scores[len(idx) :]
        loss = bradley_terry_loss(s0, s1, label)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.train.grad_clip) if cfg.train.grad_clip > 0 else torch.tensor(0.0)
        opt.step()
        acc, _ = pairwise_accuracy(s0, s1, label)
        record = {"step": step, "loss": float(loss.detach()), "accuracy": acc, "grad_norm": float(norm), "u_mean": float(u.mean()),
                  "seconds": time.perf_counter() - t_start}
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.train.steps:
            curve = accuracy_vs_t(drm, eval_pairs, cfg.eval.t_grid, seed=cfg.eval.seed, batch_size=cfg.eval.batch_size)
            record.update({f"eval/accuracy@t={r['t']:g}": r["accuracy"] for r in curve})
        metrics.write(record)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc=f"{acc:.2f}", refresh=False)
        bar.update(1)
    bar.close()
    progress.phase("  drm: held-out and training accuracy vs t ...")
    train_seconds = time.perf_counter() - t_start
    curve = accuracy_vs_t(drm, eval_pairs, cfg.eval.t_grid, seed=cfg.eval.seed, batch_size=cfg.eval.batch_size)
    train_curve = accuracy_vs_t(drm, train_pairs.subset(torch.arange(min(len(train_pairs), len(eval_pairs) or 1))), cfg.eval.t_grid,
                                seed=cfg.eval.seed, batch_size=cfg.eval.batch_size)
    summary = {
        "accuracy_vs_t": curve, "train_accuracy_vs_t": train_curve,
        "pairs": {"train": len(train_pairs), "eval": len(eval_pairs), "source": cfg.pairs.source,
                  "reward": cfg.pairs.reward if cfg.pairs.source == "generate" else None},
        "train_seconds": train_seconds, "pair_seconds": pair_seconds, "steps": cfg.train.steps,
    }
    metrics.write({"step": cfg.train.steps, "eval": True, **{f"eval/accuracy@t={r['t']:g}": r["accuracy"] for r in curve}})
    drm.save(out, extra={"training": summary})
    (out / "accuracy_vs_t.json").write_text(json.dumps(summary, indent=2))
    plot_accuracy_vs_t({"held-out pairs": curve, "training pairs": train_curve}, out / "accuracy_vs_t.png",
                       f"DRM on {m.base}: pairwise accuracy vs t ({len(eval_pairs)} held-out pairs)")
    log("  held-out pairwise accuracy by noise level:\n" + format_accuracy_table(curve))
    return summary
