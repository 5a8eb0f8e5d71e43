"""DiffusionNFT recipe: seeded ODE rollouts -> rewards -> group advantages -> NFT updates -> old-adapter EMA.

Paper: Zheng et al. 2025 (arXiv:2509.16117), reference ``train_nft_sd3.py`` of NVlabs/DiffusionNFT.
The math lives in :mod:`diffalign.algorithms.diffusion_nft`; this file orchestrates:

1. rollout: G seeds per prompt, deterministic ODE with the *sampling* policy — the "old" LoRA
   adapter (``algorithm.sample_with: old``, the reference) or the current one — keeping only the
   clean final samples ``x0`` (no trajectory, no log-probabilities; any solver would do);
2. rewards -> per-prompt advantages (Flow-GRPO's estimator, global or group std);
3. for each sample a fraction of the rollout's noise levels (a random subset per sample), fresh
   noise ``x_t = (1 - t) x0 + t eps``, forwards of the old adapter (no grad), the trained adapter
   and the reference (adapter disabled, for the KL), the NFT loss; gradients accumulate over
   samples x noise levels between optimizer steps;
4. the old adapter moves towards the trained one: ``old <- d old + (1 - d) theta``,
   ``d = min(0.001 * optimizer_steps, 0.5)``.

The old policy is a second named peft adapter (``"old"``) on the same denoiser: switching
adapters costs a flag per LoRA layer, no second model. Multi-process runs follow Flow-GRPO's
scheme: global prompts / seeds / shuffles / noise seeds sliced per process, losses normalised by
global term counts, gradients summed.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Optional

import torch

from diffalign.adapters.base import PromptEmbeds
from diffalign.algorithms.diffusion_nft import ema_update_, nft_loss, old_policy_decay
from diffalign.config import AlgorithmConfig, GroupAdvantageOptions, check_ranges, fraction_of_steps, method_defaults
from diffalign.errors import ConfigError
from diffalign.recipes import register_recipe
from diffalign.sampling.seeded import SEED_HIGH, sample_seeded, seed_noise
from diffalign.trainer import Trainer
from diffalign.training.checks import SelfCheckError
from diffalign.training.groups import gathered_group_advantages, sample_level_batches, shuffled_share
from diffalign.training.rewards import reward_info

OLD_ADAPTER = "old"  # name of the old / sampling policy's LoRA adapter (as in the reference)
DEFAULT_ADAPTER = "default"  # the trained adapter (peft's default name, the one the trainer optimises)


@dataclass
@method_defaults(filter_zero_std_groups=False)  # the reference keeps them (A = 0 -> r = 0.5)
class DiffusionNFTConfig(GroupAdvantageOptions, AlgorithmConfig):
    """``algorithm.*`` of DiffusionNFT; the advantage keys (``advantage_clip`` is ``c`` of
    ``r = clip(A) / (2 c) + 0.5``) from the shared mixin of :mod:`diffalign.config`."""

    name: str = "diffusion_nft"
    nft_beta: float = 1.0  # b: v+ = b v_theta + (1 - b) v_old, v- = (1 + b) v_old - b v_theta (reference: 1.0)
    policy_loss_scale: float = 5.0  # the reference code multiplies the policy loss by adv_clip_max (5); 1 = algorithms.md's formula
    kl_beta: float = 1.0e-4  # weight of mean((v_theta - v_ref)^2), reference = adapter disabled; 0 skips that forward
    train_timestep_fraction: float = 0.6  # noise levels trained per sample: int(num_steps * fraction) (Sol-RL base: 0.6)
    timestep_selection: Literal["random", "first"] = "random"  # per sample a random subset of the rollout's sigmas (reference), or the first
    old_decay_rate: float = 0.001  # d = min(rate * optimizer_steps, old_decay_max) ...
    old_decay_max: float = 0.5  # ... (reference decay_type 1)
    old_decay_flat: int = 0  # d = 0 for the first `flat` optimizer steps (decay_type 2: 75)
    sample_with: Literal["old", "current"] = "old"  # rollout policy: the old adapter (reference) or the trained one
    train_guidance_scale: float = 1.0  # CFG in the training forwards; 1 = conditional only (DiffusionNFT is CFG-free)
    weight_min: float = 1.0e-5  # floor of the adaptive weight (mean |x0_hat - x0|)

    renamed_keys = {"adv_clip": "advantage_clip"}

    def validate(self, prefix: str = "algorithm") -> None:
        check_ranges(self, prefix, positive=("nft_beta", "policy_loss_scale", "weight_min"),
                     nonnegative=("kl_beta", "old_decay_rate", "old_decay_flat", "train_guidance_scale"),
                     fraction=("train_timestep_fraction",), decay=("old_decay_max",))
        super().validate(prefix)

    def trained_steps_per_sample(self, sde_steps: int) -> int:
        return fraction_of_steps(sde_steps, self.train_timestep_fraction)

    def rewards_in_groups(self) -> bool:
        return True


@dataclass
class SeededSamples:
    """This process's share of an iteration's final (trained-on) samples; n = n_local.

    ``x0``: (n, *latent) fp32 clean final ODE states. ``images``: (n, 3, H, W) in [0, 1].
    ``embeds``: prompt embeddings, n rows. ``seeds``: (n,) the seeds that fixed them.
    ``sample_ids``: (n,) global sample indices (``n_global`` in all processes together).
    ``rewards``: (n,). ``info``: reward info and rollout statistics for the metrics.
    """

    x0: torch.Tensor
    images: torch.Tensor
    embeds: PromptEmbeds
    prompts: list[str]
    seeds: torch.Tensor
    sample_ids: torch.Tensor
    n_global: int
    rewards: torch.Tensor
    info: dict


def draw_prompts_and_seeds(trainer: Trainer, per_prompt: int) -> tuple[list[str], torch.Tensor, slice]:
    """Global prompts and seeds (identical on every process) and this process's slice of prompts.

    Returns (all prompts, seeds (n_prompts_global, per_prompt), local prompt slice)."""
    world, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
    per_proc = trainer.cfg.rollout.prompts_per_iteration
    all_prompts = trainer.prompt_sampler.next(per_proc * world)
    seeds = torch.randint(0, SEED_HIGH, (len(all_prompts), per_prompt), generator=trainer.generator)
    return all_prompts, seeds, slice(rank * per_proc, (rank + 1) * per_proc)


def sample_and_score(trainer: Trainer, embeds: PromptEmbeds, seeds: torch.Tensor, prompts: list[str], *, num_steps: int,
                     guidance_scale: float, batch_size: int, prompt_index: Optional[torch.Tensor] = None,
                     groups: Optional[torch.Tensor] = None, group_size: Optional[int] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """ODE samples of (embeds[i], seeds[i]) with whatever denoiser the adapter holds, in chunks of
    ``batch_size``, each scored while the next one samples. With ``prompt_index`` (n,), ``embeds``
    holds one row per prompt and sample i uses row ``prompt_index[i]`` (a pool of many seeds per
    prompt then never holds n copies of the text embeddings). ``groups`` (n,) / ``group_size``: each
    sample's prompt group, told to the reward (:meth:`~diffalign.trainer.Trainer.score_async`).

    Returns (x0 (n, *latent), images (n, 3, H, W), rewards (n,), reward info)."""
    x0, images, futures = [], [], []
    if prompt_index is not None:
        prompt_index = prompt_index.to(next(iter(embeds.cond.values())).device)
    for start in range(0, len(seeds), batch_size):
        rows = slice(start, start + batch_size)
        chunk = embeds.select(prompt_index[rows]) if prompt_index is not None else embeds.select(rows)
        with trainer.autocast():
            traj = sample_seeded(trainer.adapter, chunk, seeds[rows], num_steps=num_steps,
                                 guidance_scale=guidance_scale, resolution=trainer.resolution, batch_size=batch_size)
        x0.append(traj.latents[:, -1])
        images.append(traj.images)
        futures.append(trainer.score_async(traj.images, prompts[rows], None if groups is None else groups[rows], group_size))
    results = trainer.reward_results(futures)
    rewards = torch.cat([r for r, _ in results]) if results else torch.empty(0)
    return torch.cat(x0), torch.cat(images), rewards, reward_info(results)


def seeded_group_rollout(trainer: Trainer, iteration: int, policy=None) -> SeededSamples:
    """This process's share of an iteration's groups: ``rollout.group_size`` seeded ODE samples of
    each of its prompts (``sampling.num_steps``, CFG ``sampling.guidance_scale``) under the context
    ``policy`` (the adapter that samples; None: the current one), scored in prompt groups and
    handed to ``train.guard``'s verifier (DiffusionNFT, AWM, DGPO)."""
    cfg, s = trainer.cfg, trainer.cfg.sampling
    group = cfg.rollout.group_size
    all_prompts, seeds, mine = draw_prompts_and_seeds(trainer, group)
    prompts = all_prompts[mine]
    local_seeds = seeds[mine].flatten()
    sample_prompts = [p for p in prompts for _ in range(group)]
    n_local, n_global = len(sample_prompts), len(all_prompts) * group
    first = mine.start * group
    embeds = trainer.adapter.encode_prompts(prompts, with_uncond=s.guidance_scale > 1).repeat_interleave(group)
    trainer.adapter.denoiser.eval()
    t0 = time.perf_counter()
    with policy or contextlib.nullcontext():
        x0, images, rewards, info = sample_and_score(trainer, embeds, local_seeds, sample_prompts, num_steps=s.num_steps,
                                                     guidance_scale=s.guidance_scale, batch_size=cfg.rollout.sample_batch_size,
                                                     groups=torch.arange(first, first + n_local) // group)
    trainer.guard_finals(images, sample_prompts, iteration)  # train.guard's verifier
    info = trainer.gather_info(info)
    info["time/rollout"] = time.perf_counter() - t0
    return SeededSamples(x0, images, embeds, sample_prompts, local_seeds, torch.arange(first, first + n_local), n_global, rewards, info)


class DiffusionNFTTrainer(Trainer):
    supports_sample_offload = True  # matching_update moves each micro-batch to the device

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: DiffusionNFTConfig = self.nft_config()
        if not cfg.lora.enabled:
            raise ConfigError("config key 'lora.enabled' must be true for DiffusionNFT: the old (sampling) policy is a second LoRA adapter")
        self.needs_reference = self.algo.kl_beta > 0
        self.optimizer_steps_done = 0  # the reference's global_step: drives the old adapter's decay
        self._checked = False  # old == trained check done (before the first update)

    def nft_config(self) -> DiffusionNFTConfig:
        return self.cfg.algorithm

    # ---- the two adapters -------------------------------------------------------------------
    def _setup_trainable(self) -> None:
        if self.adapter.prediction_type != "flow":
            raise ConfigError(f"config key 'model.id': DiffusionNFT needs a flow-matching model (x_t = (1 - t) x0 + t eps); "
                              f"{self.adapter.family} predicts {self.adapter.prediction_type}")
        super()._setup_trainable()
        from peft import LoraConfig

        cfg = self.cfg
        denoiser = self.adapter.denoiser
        targets = cfg.lora.targets or list(self.adapter.default_lora_targets)
        with warnings.catch_warnings():  # peft warns that a second adapter is being added: that is the point
            warnings.filterwarnings("ignore", message=".*multiple adapters.*")
            denoiser.add_adapter(LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                            target_modules=targets), adapter_name=OLD_ADAPTER)
        for layer in self._lora_layers:  # diffusers' add_adapter activated the new one
            layer.set_adapter(DEFAULT_ADAPTER)
        named = dict(denoiser.named_parameters())
        self.old_names, self.old_params = [], []
        for name, p in zip(self.trainable_names, self.trainable):
            old_name = name.replace(f".{DEFAULT_ADAPTER}.", f".{OLD_ADAPTER}.")
            if old_name == name or old_name not in named:
                raise ConfigError(f"config key 'lora': cannot pair trainable parameter {name!r} with an old-adapter parameter")
            old = named[old_name]
            old.requires_grad_(False)
            old.data = p.detach().clone().float()  # the old policy starts as the initial policy
            self.old_names.append(old_name)
            self.old_params.append(old)

    @contextlib.contextmanager
    def adapter_active(self, name: str) -> Iterator[None]:
        """Context: the denoiser runs with LoRA adapter ``name`` (no gradient into it)."""
        if name == DEFAULT_ADAPTER:
            yield
            return
        for layer in self._lora_layers:
            layer.set_adapter(name)  # callers run it under no_grad; switching back freezes it again
        try:
            yield
        finally:
            for layer in self._lora_layers:
                layer.set_adapter(DEFAULT_ADAPTER)  # also restores requires_grad on the trained adapter

    @property
    def sampling_adapter(self) -> str:
        return OLD_ADAPTER if self.algo.sample_with == "old" else DEFAULT_ADAPTER

    def sampling_policy(self):
        return self.adapter_active(self.sampling_adapter)

    @torch.no_grad()
    def update_old_adapter(self) -> float:
        """``old <- d old + (1 - d) theta`` after an iteration's updates; returns d."""
        a = self.algo
        d = old_policy_decay(self.optimizer_steps_done, rate=a.old_decay_rate, max_decay=a.old_decay_max, flat=a.old_decay_flat)
        ema_update_(self.old_params, self.trainable, d)
        return d

    # ---- rollout ----------------------------------------------------------------------------
    def rollout(self, iteration: int) -> SeededSamples:
        return seeded_group_rollout(self, iteration, self.sampling_policy())

    # ---- one iteration ----------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        algo = self.algo
        samples = self.rollout(iteration)
        t_update = time.perf_counter()
        adv, record = gathered_group_advantages(self, samples.rewards, samples.n_global, iteration, algo)
        record.update(samples.info)
        record.update(self.update(samples, adv.advantages, adv.keep))
        record["old_decay"] = self.update_old_adapter()
        record["time/update"] = time.perf_counter() - t_update
        return record

    # ---- policy update ----------------------------------------------------------------------
    def trained_noise_levels(self, n_global: int, num_steps: int) -> torch.Tensor:
        """(n_global, K) indices into the rollout schedule's first ``num_steps`` sigmas, K = fraction x steps."""
        frac = self.algo.train_timestep_fraction
        k = num_steps if frac >= 1 else max(1, int(num_steps * frac + 1e-9))
        if self.algo.timestep_selection == "first":
            return torch.arange(k).expand(n_global, k).clone()
        return torch.stack([torch.randperm(num_steps, generator=self.generator)[:k] for _ in range(n_global)])

    def update(self, samples: SeededSamples, advantages: torch.Tensor, keep: torch.Tensor) -> dict:
        """NFT updates on this process's samples; ``advantages`` / ``keep`` are global (n_global,)."""
        algo, g = self.algo, self.algo.train_guidance_scale

        def batch_loss(x0, eps, t, x_t, emb, adv):
            with torch.no_grad(), self.adapter_active(OLD_ADAPTER), self.autocast():
                v_old = self.adapter.predict(x_t, t, emb, g)
            with self.autocast():
                v_theta = self.adapter.predict(x_t, t, emb, g)
            if not self._checked:
                self._self_check(v_theta.detach(), v_old)
            v_ref = None
            if algo.kl_beta > 0:
                with torch.no_grad(), self.reference_model(), self.autocast():
                    v_ref = self.adapter.predict(x_t, t, emb, g)
            return nft_loss(v_theta, v_old, x_t, x0, t, adv, v_ref=v_ref, nft_beta=algo.nft_beta, adv_clip=algo.advantage_clip,
                            policy_loss_scale=algo.policy_loss_scale, kl_beta=algo.kl_beta, weight_min=algo.weight_min)

        keys = ("loss", "policy_loss", "kl", "positive_loss", "negative_loss", "r_mean", "old_deviation")
        levels = lambda n: self.trained_noise_levels(n, self.cfg.sampling.num_steps)  # noqa: E731
        return self.matching_update(samples, advantages, keep, levels, batch_loss, keys)

    def matching_update(self, samples: SeededSamples, advantages: torch.Tensor, keep: torch.Tensor,
                        draw_levels: Callable[[int], torch.Tensor], batch_loss: Callable, keys: tuple[str, ...]) -> dict:
        """The update loop of the recipes that train a matching loss on the policy's own clean
        samples (DiffusionNFT, AWM). Per epoch a global shuffle, ``draw_levels(n_global)`` (noise
        level indices into the rollout schedule, ``(n_global, K)``) and one noise seed per (sample,
        level), drawn the same on every process; this process's samples go in micro-batches of
        (sample batch, level), each noised on the forward process ``x_t = (1 - t) x0 + t eps`` and
        scored by ``batch_loss(x0, eps, t, x_t, embeds, advantages) -> result`` (``per_sample`` and
        the ``keys`` statistics); ``train.optimizer_steps_per_iteration`` optimizer steps."""
        cfg, dev = self.cfg, self.device
        samples, = self.stash_samples(samples)  # CPU memory until a micro-batch uses them (rollout.offload_samples)
        schedule = self.adapter.make_schedule(cfg.sampling.num_steps, self.resolution, self.resolution)
        latent = tuple(samples.x0.shape[1:])
        n_global, first_local, n_local = samples.n_global, int(samples.sample_ids[0]), len(samples.sample_ids)
        stats: dict[str, list] = {k: [] for k in keys + ("grad_norm",)}
        steps_applied = 0
        self.adapter.denoiser.train()
        for _epoch in range(cfg.train.inner_epochs):
            # Global shuffle, noise levels and noise seeds (same RNG use on every process), then our share.
            perm = torch.randperm(n_global, generator=self.generator)
            level_idx = draw_levels(n_global)  # (n_global, K)
            noise_seeds = torch.randint(0, SEED_HIGH, tuple(level_idx.shape), generator=self.generator)
            order_global, order = shuffled_share(perm, first_local, n_local, keep)
            micro = sample_level_batches(len(order), cfg.train.batch_size, level_idx.shape[1])
            for group in self.plan_optimizer_steps([len(order[b]) for b, _ in micro]):
                bad = False
                for m in group.micro:
                    b, j = micro[m]
                    rows, grows = order[b], order_global[b]
                    x0 = samples.x0[rows].to(dev).float()
                    t = schedule[level_idx[grows, j]].to(dev)
                    eps, _ = seed_noise(noise_seeds[grows, j], latent)
                    eps = eps.to(dev)
                    tb = t.reshape(-1, *([1] * len(latent)))
                    x_t = (1 - tb) * x0 + tb * eps  # fresh noise on the forward process
                    emb = self.to_device(samples.embeds.select(rows.to(samples.embeds.cond[next(iter(samples.embeds.cond))].device)))
                    res = batch_loss(x0, eps, t, x_t, emb, advantages[grows].to(dev))
                    if not self.accumulate(res.per_sample.sum() / group.global_terms):
                        bad = True
                        continue
                    for key in keys:
                        stats[key].append(float(getattr(res, key).detach()))
                _, applied = self.close_step(bad, stats)  # a poisoned step is dropped and counted
                steps_applied += int(applied)
                self.optimizer_steps_done += int(applied)
                self._checked |= applied  # the trained adapter has moved away from the old one
        out = self.mean_stats(stats)
        out["optimizer_steps"] = steps_applied
        return out

    def _self_check(self, v_theta: torch.Tensor, v_old: torch.Tensor) -> None:
        """Before the first update the old adapter is a copy of the trained one: same velocity."""
        if not self.cfg.train.self_check:
            return
        diff = float((v_theta.float() - v_old.float()).abs().max())
        scale = 1.0 + float(v_old.float().abs().max())
        if not math.isfinite(diff) or diff > self.cfg.train.self_check_tolerance * scale:
            raise SelfCheckError(
                f"DiffusionNFT self-check failed: before any update the old adapter should reproduce the trained one, but "
                f"max |v_theta - v_old| = {diff:.3g}; the adapter switch does not work for this model (check its LoRA layers)"
            )

    # ---- state ------------------------------------------------------------------------------
    def extra_state(self) -> dict:
        return {"old": {n: p.detach().cpu().clone() for n, p in zip(self.old_names, self.old_params)},
                "optimizer_steps_done": self.optimizer_steps_done}

    def load_extra_state(self, state: dict) -> None:
        old = state.get("old") or {}
        missing = set(self.old_names) - set(old)
        if missing:
            raise ConfigError(f"checkpoint has no old-adapter weights for {len(missing)} tensors (was it written by diffusion_nft?)")
        with torch.no_grad():
            for n, p in zip(self.old_names, self.old_params):
                p.copy_(old[n].to(p.device, p.dtype))
        self.optimizer_steps_done = int(state.get("optimizer_steps_done", 0))
        self._checked = True  # the old adapter may differ from the trained one now

    def print_header(self) -> None:
        super().print_header()
        a = self.algo
        self.log(f"  DiffusionNFT: rollouts with the {self.sampling_adapter!r} adapter (ODE, {self.cfg.sampling.num_steps} steps), "
                 f"b {a.nft_beta}, KL {a.kl_beta}, old adapter decay min({a.old_decay_rate} x steps, {a.old_decay_max})")


register_recipe("diffusion_nft", DiffusionNFTConfig, DiffusionNFTTrainer)
