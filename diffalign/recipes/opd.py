"""OPD recipe (DiffusionOPD): student rollouts -> every routed teacher re-scores the student's own
states -> per-step mean-matching KL -> student update.

Paper: Li et al. 2026 (arXiv:2605.15055), reference ``scripts/train_sd3_opd.py`` and
``config/opd.py`` of ali-vilab/DiffusionOPD. The math lives in :mod:`diffalign.algorithms.opd`;
this file loads the teachers, routes prompts to them and orchestrates.

A teacher is a frozen copy of the denoiser that is swapped into the pipeline for its forwards
(``ModelAdapter.swapped_denoiser``), so the student's text encoders, VAE and schedule serve both and
a LoRA or fully fine-tuned student is trained the same way. ``algorithm.teachers[i].model`` is a
diffalign run (or its ``final/``: a LoRA run is fused into a copy of the base denoiser, a full run
loaded whole), a folder holding a diffusers LoRA (``pytorch_lora_weights.safetensors``) of the
student's base model, or any model id ``model.id`` takes (hub id, pipeline folder, ``tiny:<family>``).

Rewards are scored on the rollouts for monitoring only (the reference's proxy rewards); the loss
does not see them. Multi-process runs follow Flow-GRPO's scheme (global prompts, noise and
shuffles sliced per process, losses divided by the global number of terms).
"""

from __future__ import annotations

import copy
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch

from diffalign.adapters import load_adapter
from diffalign.adapters.base import DTYPES
from diffalign.algorithms.opd import Route, opd_loss, routing_weights
from diffalign.config import AlgorithmConfig, SamplingConfig, check, fraction_of_steps
from diffalign.errors import ConfigError, DiffalignError
from diffalign.export import LORA_WEIGHTS_FILE, fuse_lora
from diffalign.recipes import register_recipe
from diffalign.runs import METADATA_FILE
from diffalign.sampling import Trajectory
from diffalign.sampling.linear import SQRT_DT_KERNELS
from diffalign.shapes import prompt_family
from diffalign.shapes.world import FAMILIES
from diffalign.trainer import Trainer
from diffalign.training.checks import SelfCheckError
from diffalign.training.groups import reward_summary, sample_group_chunks, sample_level_batches, shuffled_share
from diffalign.training.rewards import reward_info


@dataclass
class TeacherConfig:
    """One entry of ``algorithm.teachers``."""

    model: str = ""  # a diffalign run (or its final/), a LoRA folder of the base model, or a model id (hub, folder, tiny:<family>)
    name: str = ""  # label in the metrics (teacher_kl/<name>); "" = teacher<i>
    family: str = "auto"  # model family when `model` is a pipeline / hub id (as model.family)
    options: dict = field(default_factory=dict)  # adapter options when loading `model` (e.g. {seed: 1} for a tiny: build)
    guidance_scale: Optional[float] = None  # CFG of the teacher's forwards; None = sampling.guidance_scale (reference: per teacher)
    weight: float = 1.0  # its KL's weight; the KLs of the teachers routed to a prompt are summed (reference: 1 each)
    families: list[str] = field(default_factory=list)  # prompts.source=shapes: the task families it teaches
    match: list[str] = field(default_factory=list)  # regular expressions: prompts whose text matches one go to it


@dataclass
class OPDConfig(AlgorithmConfig):
    """``algorithm.*`` of OPD (docs/opd.md)."""

    name: str = "opd"
    teachers: list[TeacherConfig] = field(default_factory=list)  # one or more; routing by families / match, else every prompt
    rollout: Literal["ode", "sde"] = "ode"  # student rollouts: deterministic (reference: noise_level 0, loss 0.5 ||dmu||^2) or the SDE kernel's
    train_timestep_fraction: float = 0.99  # the first int(num_steps x fraction) steps are trained (reference: 0.99 of 10 -> 9)

    def validate(self, prefix: str = "algorithm") -> None:
        check(len(self.teachers) >= 1, f"{prefix}.teachers", "must list at least one teacher ({model: ...})")
        names = []
        for i, t in enumerate(self.teachers):
            key = f"{prefix}.teachers[{i}]"
            check(bool(t.model), f"{key}.model", "is required (a run folder, a LoRA folder or a model id)")
            check(t.weight > 0, f"{key}.weight", "must be > 0")
            check(t.guidance_scale is None or t.guidance_scale >= 1, f"{key}.guidance_scale", "must be >= 1 (1 = no CFG)")
            unknown = sorted(set(t.families) - set(FAMILIES))
            check(not unknown, f"{key}.families", f"has unknown families {unknown} (known: {', '.join(FAMILIES)})")
            for j, pattern in enumerate(t.match):
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ConfigError(f"config key '{key}.match[{j}]' is not a regular expression: {exc}") from None
            names.append(t.name or f"teacher{i}")
        check(len(set(names)) == len(names), f"{prefix}.teachers", f"names must be distinct, got {names}")
        check(0 < self.train_timestep_fraction <= 1, f"{prefix}.train_timestep_fraction", "must be in (0, 1]")
        super().validate(prefix)

    def check_sampling(self, sampling: SamplingConfig, prefix: str = "algorithm") -> None:
        if self.rollout == "sde":
            check(sampling.kernel in SQRT_DT_KERNELS, f"{prefix}.rollout",
                  f"sde needs sampling.kernel {' or '.join(SQRT_DT_KERNELS)} (the KL divides by the kernel's sigma_t^2)")
            check(sampling.noise_level > 0, f"{prefix}.rollout", "sde needs sampling.noise_level > 0 (else use rollout: ode)")
            check(sampling.window_size == 0, f"{prefix}.rollout", "sde trains every step: sampling.window_size must be 0")
            check(sampling.noise_pool == 1, f"{prefix}.rollout", "sde compares full-resolution means: sampling.noise_pool must be 1")

    def teacher_names(self) -> list[str]:
        return [t.name or f"teacher{i}" for i, t in enumerate(self.teachers)]

    def trained_steps_per_sample(self, sde_steps: int) -> int:
        return fraction_of_steps(sde_steps, self.train_timestep_fraction)


# ---- teachers -------------------------------------------------------------------------------
def _lora_teacher(adapter, folder: Path) -> torch.nn.Module:
    """A copy of ``adapter``'s (untrained) denoiser with the diffusers LoRA of ``folder`` fused in."""
    denoiser = copy.deepcopy(adapter.denoiser)
    with adapter.swapped_denoiser(denoiser):
        adapter.pipeline.load_lora_weights(str(folder))
        fuse_lora(adapter)
    return denoiser


def load_teacher(spec: TeacherConfig, adapter, *, device, dtype) -> torch.nn.Module:
    """The frozen denoiser of teacher ``spec``; ``adapter`` is the student's, before its LoRA is added."""
    path = Path(spec.model).expanduser()
    final = path / "final" if (path / "final" / METADATA_FILE).is_file() else path
    if (final / METADATA_FILE).is_file():  # a diffalign run or its final/
        meta = json.loads((final / METADATA_FILE).read_text())
        if meta.get("format") == "lora":
            denoiser = _lora_teacher(adapter, final)
        else:
            denoiser = load_adapter(str(final), family=meta.get("family", "auto"), device=device, dtype=dtype,
                                    **(meta.get("model_options") or {})).denoiser
    elif path.is_dir() and (path / LORA_WEIGHTS_FILE).is_file() and not (path / "model_index.json").is_file():
        denoiser = _lora_teacher(adapter, path)
    else:
        denoiser = load_adapter(spec.model, family=spec.family, device=device, dtype=dtype, **spec.options).denoiser
    return denoiser.to(device).requires_grad_(False).eval()


class OPDTrainer(Trainer):
    """Student rollouts, teacher transition means at the student's states, mean matching."""

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: OPDConfig = cfg.algorithm
        self._checked = False  # on-policy self-check done
        specs = self.algo.teachers
        self.routes = [Route(tuple(t.families), tuple(t.match)) for t in specs]
        self.teacher_weights = [t.weight for t in specs]
        g = cfg.sampling.guidance_scale
        self.teacher_scales = [g if t.guidance_scale is None else t.guidance_scale for t in specs]
        if any(t.families for t in specs) and cfg.prompts.source != "shapes":
            i = next(i for i, t in enumerate(specs) if t.families)
            raise ConfigError(f"config key 'algorithm.teachers[{i}].families' routes ShapesWorld families; "
                              f"prompts.source is {cfg.prompts.source!r} (route with match: [regex, ...])")

    # ---- setup ------------------------------------------------------------------------------
    def _setup_trainable(self) -> None:
        self.check_routing(self.train_prompts)
        self.teachers = []
        for i, spec in enumerate(self.algo.teachers):  # before the student's LoRA: LoRA teachers copy the base denoiser
            try:
                self.teachers.append(load_teacher(spec, self.adapter, device=self.device, dtype=DTYPES[self.cfg.model.dtype]))
            except DiffalignError as exc:
                raise ConfigError(f"config key 'algorithm.teachers[{i}].model': {exc} (a teacher is a run folder, a LoRA "
                                  f"folder or a model id; train a run first: docs/opd.md#teachers)") from None
            except Exception as exc:  # a LoRA that does not fit the base, a file that is no model
                raise ConfigError(f"config key 'algorithm.teachers[{i}].model': cannot load {spec.model!r} "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        super()._setup_trainable()

    def prompt_labels(self, prompts: list[str]) -> list[Optional[str]]:
        """Each prompt's task label for routing: its ShapesWorld family (None for other prompt sources)."""
        if self.cfg.prompts.source != "shapes":
            return [None] * len(prompts)
        return [prompt_family(p) for p in prompts]

    def routing(self, prompts: list[str]) -> torch.Tensor:
        """(B, K) teacher weights of ``prompts`` (0 where a teacher does not take the prompt)."""
        return routing_weights(prompts, self.prompt_labels(prompts), self.routes, self.teacher_weights)

    def check_routing(self, prompts: list[str]) -> None:
        """Every training prompt goes to at least one teacher, and every teacher gets some prompt."""
        w = self.routing(list(prompts))
        orphans = [p for p, row in zip(prompts, w) if not bool((row > 0).any())]
        if orphans:
            raise ConfigError(f"config key 'algorithm.teachers': {len(orphans)} training prompt(s) go to no teacher, "
                              f"e.g. {orphans[0]!r} (add families / match, or a teacher without either)")
        idle = [name for name, col in zip(self.algo.teacher_names(), w.T) if not bool((col > 0).any())]
        if idle:
            raise ConfigError(f"config key 'algorithm.teachers': teacher {idle[0]!r} gets no training prompt")

    # ---- rollout ----------------------------------------------------------------------------
    def rollout(self, iteration: int):
        """This process's share of the iteration's rollouts (ODE or SDE) and their monitoring rewards."""
        sde = self.algo.rollout == "sde"
        plan = self.plan_group_rollout(iteration, with_step_noise=sde)
        if not sde:
            plan.sde_mask = torch.zeros_like(plan.sde_mask)
        trajs, futures = [], []
        for idx, traj in sample_group_chunks(self, plan):
            trajs.append(traj)
            futures.append(self.score_async(traj.images, plan.sample_prompts[idx]))
            self.guard_finals(traj.images, plan.sample_prompts[idx], iteration)
        results = self.reward_results(futures)
        rewards = self.check_rewards(torch.cat([r for r, _ in results]), iteration)
        record = reward_summary(self.accelerator.gather(rewards.to(self.device)).cpu())
        record.update(self.gather_info(reward_info(results)))
        embeds = plan.embeds
        if embeds.uncond is None and any(g > 1 for g in self.teacher_scales):  # a teacher guides where the student does not
            embeds = self.adapter.encode_prompts(plan.prompts, with_uncond=True).repeat_interleave(self.cfg.rollout.group_size)
        return Trajectory.cat(trajs), plan, embeds, record

    def iteration(self, iteration: int) -> dict:
        t0 = time.perf_counter()
        traj, plan, embeds, record = self.rollout(iteration)
        t_rollout = time.perf_counter() - t0
        t0 = time.perf_counter()
        record.update(self.update(traj, plan, embeds))
        record.update({"time/rollout": t_rollout, "time/update": time.perf_counter() - t0})
        return record

    # ---- update -----------------------------------------------------------------------------
    def teacher_means(self, k: int, x, t, t_next, embeds, x_next):
        """Teacher k's transition means at the student's states (no grad)."""
        with torch.no_grad(), self.adapter.swapped_denoiser(self.teachers[k]), self.autocast():
            out = self.adapter.predict(x, t, embeds, self.teacher_scales[k])
        return self.kernel.step(out, x, t, t_next, sde=self.algo.rollout == "sde", prev_sample=x_next).mean

    def self_check(self, step, x_next: torch.Tensor, old_logp: torch.Tensor, where: str) -> None:
        """Before the first update the student's training forward reproduces its rollout: the SDE
        log-ratio is 0, and an ODE step's mean is the stored next state."""
        if self.algo.rollout == "sde":
            self.check_log_ratio(step.log_prob.detach(), old_logp, where)
        elif self.cfg.train.self_check:
            worst = float((step.mean.detach() - x_next).abs().max())
            self.self_check_log_ratio = worst
            if not worst <= self.cfg.train.self_check_tolerance:
                raise SelfCheckError(f"on-policy self-check failed: the training forward's ODE step is {worst:.3g} away from "
                                     f"the rollout's next state before any update (tolerance {self.cfg.train.self_check_tolerance:g}) "
                                     f"{where}; check the adapter's predict, CFG batching and dtype")

    def update(self, traj: Trajectory, plan, embeds) -> dict:
        """Distillation steps on this process's samples (global shuffle, global term counts)."""
        cfg, algo, dev = self.cfg, self.algo, self.device
        g, sde = cfg.sampling.guidance_scale, algo.rollout == "sde"
        steps = list(range(fraction_of_steps(cfg.sampling.num_steps, algo.train_timestep_fraction)))
        weights = self.routing(plan.sample_prompts)  # (n_local, K)
        names = algo.teacher_names()
        stats = {"loss": [], "grad_norm": [], **{f"teacher_kl/{n}": [] for n in names}}
        cond_device = embeds.cond[next(iter(embeds.cond))].device
        n_local, first = plan.n_local, plan.first
        steps_applied = 0
        self.adapter.denoiser.train()
        for _epoch in range(cfg.train.inner_epochs):
            perm = torch.randperm(plan.n_global, generator=self.generator)
            _, order = shuffled_share(perm, first, n_local, torch.ones(plan.n_global, dtype=torch.bool))
            micro = sample_level_batches(len(order), cfg.train.batch_size, len(steps))
            for group in self.plan_optimizer_steps([len(order[b]) for b, _ in micro]):
                bad = False
                for m in group.micro:
                    b, j = micro[m]
                    rows, i = order[b], steps[j]
                    x = traj.latents[rows, i].to(dev)
                    x_next = traj.latents[rows, i + 1].to(dev)
                    t = traj.timesteps[i].expand(len(rows)).to(dev)
                    t_next = traj.timesteps[i + 1].expand(len(rows)).to(dev)
                    emb = embeds.select(rows.to(cond_device))
                    w = weights[rows]
                    with self.autocast():
                        out = self.adapter.predict(x, t, emb, g)
                    step = self.kernel.step(out, x, t, t_next, sde=sde, prev_sample=x_next)
                    if not self._checked:
                        self.self_check(step, x_next, traj.log_probs[rows, i].to(dev), f"at step {i}")
                    means = [self.teacher_means(k, x, t, t_next, emb, x_next) if bool((w[:, k] > 0).any()) else None
                             for k in range(len(self.teachers))]
                    # SDE: the reference divides by the kernel's sigma_t^2 = std^2 / |dt| (Flow-GRPO's KL convention)
                    variance = (step.std.reshape(len(rows)) ** 2 / self.kernel.abs_dt(t, t_next)) if sde else None
                    loss = opd_loss(step.mean, means, w, variance)
                    if not self.accumulate(loss.per_sample.sum() / group.global_terms):
                        bad = True
                    stats["loss"].append(float(loss.per_sample.detach().mean()))
                    for k, n in enumerate(names):
                        routed = w[:, k] > 0
                        if bool(routed.any()):
                            stats[f"teacher_kl/{n}"].append(float((loss.per_teacher[:, k][routed.to(dev)] / w[routed, k].to(dev)).mean()))
                _, applied = self.close_step(bad, stats)
                steps_applied += int(applied)
                self._checked |= applied
        out = self.mean_stats(stats)  # NaN for a teacher no process's samples went to
        out["optimizer_steps"] = steps_applied
        return out

    def print_header(self) -> None:
        super().print_header()
        a = self.algo
        for name, spec, g in zip(a.teacher_names(), a.teachers, self.teacher_scales):
            route = ", ".join([*spec.families, *(f"/{p}/" for p in spec.match)]) or "every prompt"
            self.log(f"  OPD teacher {name}: {spec.model} (CFG {g:g}, weight {spec.weight:g}) <- {route}")
        self.log(f"  OPD: {a.rollout.upper()} rollouts, the first {self.cfg.algorithm.trained_steps_per_sample(self.cfg.sampling.num_steps)} "
                 f"of {self.cfg.sampling.num_steps} steps trained")


register_recipe("opd", OPDConfig, OPDTrainer)

__all__ = ["TeacherConfig", "OPDConfig", "OPDTrainer", "load_teacher"]
