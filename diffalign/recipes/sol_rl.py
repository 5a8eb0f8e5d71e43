"""Sol-RL recipe: explore many seeds with a cheap low-precision copy, regenerate a contrastive few exactly.

Paper: "Sol-RL" (NVIDIA, arXiv:2604.06916); reference ``train_scripts/sol_rl`` of NVlabs/Sana.
Each iteration, per prompt:

1. **sync** — the low-precision copy (:class:`diffalign.sol_rl.policy_copy.LowPrecisionCopy`: LoRA merged,
   linears quantised, sensitive / small layers kept) is re-merged from the live weights of the
   *sampling* policy after the previous update; nothing is reloaded from disk;
2. **stage 1** — ``algorithm.pool_size`` (N) seeds, deterministic ODE with the copy and
   ``algorithm.stage1_steps`` steps, rewarded;
3. **selection** — ``rollout.group_size`` (K) seeds chosen from the stage-1 rewards
   (``algorithm.selection``: best/worst, random, mean deviation, extremes + random);
4. **stage 2** — exactly those seeds regenerated at full precision with ``sampling.num_steps``
   steps and rewarded; the advantages come from these rewards only and the update sees only
   these samples;
5. **update** with ``algorithm.optimizer``: DiffusionNFT (the reference; ODE regeneration with the
   old adapter, knobs under ``algorithm.diffusion_nft``) or Flow-GRPO (the stage-2 regeneration
   is the SDE of the chosen seeds with the current policy, knobs under ``algorithm.flow_grpo``).

Logged per iteration: ``time/sync``, ``time/stage1``, ``time/stage2``, ``time/update``;
``sol/kendall_tau`` (Kendall tau-b between stage-1 and stage-2 rewards of the selected seeds,
averaged over prompts), ``sol/topk_hit_rate`` (of the K/2 seeds the copy ranked best among the
selected, the fraction that are among the K/2 best at full precision); ``quant/velocity_rel_err``
(the copy's velocity error against the full-precision sampling policy on a few pool samples);
and every ``algorithm.audit_every`` iterations a full-precision regeneration of the whole pool
for the pool-level rank fidelity (``sol/audit_kendall_tau``, ``sol/audit_topk_hit_rate``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from diffalign.algorithms.sol_rl import SELECTION_MODES, kendall_tau, select_indices, topk_hit_rate
from diffalign.config import AlgorithmConfig, check
from diffalign.errors import ConfigError
from diffalign.sol_rl.fidelity import velocity_error
from diffalign.sol_rl.policy_copy import LowPrecisionCopy
from diffalign.sol_rl.quantize import QuantConfig, resolve_format
from diffalign.recipes.diffusion_nft import (
    DEFAULT_ADAPTER, DiffusionNFTConfig, DiffusionNFTTrainer, SeededSamples, draw_prompts_and_seeds, sample_and_score,
)
from diffalign.recipes import register_recipe
from diffalign.recipes.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer
from diffalign.sampling import Trajectory, sde_window_mask
from diffalign.sampling.seeded import sample_seeded, seed_noise
from diffalign.trainer import Trainer
from diffalign.training.rewards import reward_info

FIDELITY_SAMPLES = 4  # pool samples on which quant/velocity_rel_err is measured each iteration


def _sol_rl_quant_defaults() -> QuantConfig:
    # The reference explores in NVFP4 on Blackwell; elsewhere fall back to FP8 (Hopper) or BF16.
    return QuantConfig(format="nvfp4", on_unsupported="fallback", fallback_formats=["fp8", "bf16"])


@dataclass
class SolRLConfig(AlgorithmConfig):
    name: str = "sol_rl"
    optimizer: Literal["diffusion_nft", "flow_grpo"] = "diffusion_nft"  # the update on the stage-2 samples
    pool_size: int = 96  # N: seeds per prompt ranked in stage 1 (rollout.group_size = K of them are regenerated)
    selection: Literal["best_worst", "random", "mean_deviation", "extremes_random"] = "best_worst"  # how the K are chosen
    stage1_steps: int = 6  # ODE steps of the low-precision exploration (stage 2 uses sampling.num_steps)
    stage1_batch_size: int = 0  # samples per stage-1 forward; 0 = rollout.sample_batch_size
    quant: QuantConfig = field(default_factory=_sol_rl_quant_defaults)  # the low-precision copy
    measure_fidelity: bool = True  # log quant/velocity_rel_err each iteration (2 forwards of 4 samples)
    audit_every: int = 0  # every N iterations also regenerate the whole pool at full precision (pool-level tau / hit rate); 0 = never
    diffusion_nft: DiffusionNFTConfig = field(default_factory=DiffusionNFTConfig)  # optimizer=diffusion_nft
    flow_grpo: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)  # optimizer=flow_grpo

    @property
    def update(self) -> AlgorithmConfig:
        """The config of the stage-2 update (``algorithm.optimizer``)."""
        return self.diffusion_nft if self.optimizer == "diffusion_nft" else self.flow_grpo

    def trained_steps_per_sample(self, sde_steps: int) -> int:
        return self.update.trained_steps_per_sample(sde_steps)

    def kernel_reduction(self) -> str:
        return self.flow_grpo.kernel_reduction()

    def rewards_in_groups(self) -> bool:
        return True

    def check_sampling(self, sampling, prefix: str = "algorithm") -> None:
        self.update.check_sampling(sampling, f"{prefix}.{self.optimizer}")
        super().check_sampling(sampling, prefix)

    def apply_reward_defaults(self, groupwise: bool) -> None:
        self.diffusion_nft.apply_reward_defaults(groupwise)
        self.flow_grpo.apply_reward_defaults(groupwise)

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.pool_size >= 2, f"{prefix}.pool_size", "must be >= 2")
        check(self.stage1_steps >= 1, f"{prefix}.stage1_steps", "must be >= 1 (stage-1 ODE steps)")
        check(self.stage1_batch_size >= 0, f"{prefix}.stage1_batch_size", "must be >= 0")
        check(self.audit_every >= 0, f"{prefix}.audit_every", "must be >= 0")
        check(self.selection in SELECTION_MODES, f"{prefix}.selection", f"must be one of {', '.join(SELECTION_MODES)}")
        self.quant.validate(f"{prefix}.quant")
        self.diffusion_nft.validate(f"{prefix}.diffusion_nft")
        self.flow_grpo.validate(f"{prefix}.flow_grpo")
        for name in ("diffusion_nft", "flow_grpo"):  # stage 1 ranks its pool on the one (weighted) reward
            check(getattr(self, name).advantage_aggregation == "sum", f"{prefix}.{name}.advantage_aggregation",
                  "must be sum under Sol-RL (its stage 1 ranks the pool on the weighted reward; gdpo is not supported)")
        check(self.flow_grpo.trust_region == "clip", f"{prefix}.flow_grpo.trust_region",
              "must be clip under Sol-RL (its stage-2 SDE noise comes from the seeds, which kl_mask does not keep)")
        super().validate(prefix)


@dataclass
class StageOne:
    """This process's stage 1 (P local prompts, N pool seeds, K selected per prompt)."""

    all_prompts: list[str]  # the iteration's prompts, all processes
    mine: slice  # this process's prompts in all_prompts
    prompts: list[str]  # (P,)
    pool_seeds: torch.Tensor  # (P, N)
    rewards: torch.Tensor  # (P, N) stage-1 rewards (non-finite ones replaced by the pool's minimum)
    selected: torch.Tensor  # (P, K) indices into the pool
    selected_seeds: torch.Tensor  # (P * K,) prompt-major
    info: dict


class TwoStageRollout:
    """Stage 1, selection and rank-fidelity metrics, shared by the NFT and Flow-GRPO trainers.

    Mixed into a :class:`~diffalign.trainer.Trainer` subclass that provides ``sampling_adapter``
    and ``sampling_policy()`` (the policy whose samples are trained on)."""

    sol: SolRLConfig
    lowp: LowPrecisionCopy | None

    def _init_two_stage(self) -> None:
        cfg = self.cfg
        self.sol = cfg.algorithm
        k, n = cfg.rollout.group_size, self.sol.pool_size
        if k > n:
            raise ConfigError(f"config key 'rollout.group_size' ({k} seeds regenerated per prompt) must be <= "
                              f"algorithm.pool_size ({n} seeds explored per prompt in stage 1)")
        # Decide the format now, before the model loads or anything is sampled (the trainer runs on CUDA when it exists).
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.quant_format = resolve_format(self.sol.quant, device, key="algorithm.quant")
        self.lowp = None
        self._copy_stale = False

    def _build_copy(self) -> None:
        self.lowp = LowPrecisionCopy(self.adapter.denoiser, self.sol.quant, resolved=self.quant_format,
                                     adapter_name=self.sampling_adapter, model_dtype=self.adapter.dtype)
        self._copy_stale = False

    def stage_one(self, iteration: int) -> StageOne:
        cfg, sol, s = self.cfg, self.sol, self.cfg.sampling
        n, k = sol.pool_size, cfg.rollout.group_size
        info: dict = {"time/sync": 0.0}
        if self._copy_stale:
            info["time/sync"] = self.lowp.sync()
            self._copy_stale = False
        all_prompts, seeds, mine = draw_prompts_and_seeds(self, n)
        keys = torch.rand((len(all_prompts), n), generator=self.generator)  # the random selection modes' randomness, drawn globally
        prompts = all_prompts[mine]
        pool_seeds, keys = seeds[mine], keys[mine]
        pool_prompts = [p for p in prompts for _ in range(n)]
        embeds = self.adapter.encode_prompts(prompts, with_uncond=s.guidance_scale > 1)  # one row per prompt
        index = torch.arange(len(prompts)).repeat_interleave(n)  # pool sample -> its prompt's row
        self.adapter.denoiser.eval()
        t0 = time.perf_counter()
        with self.lowp.swapped_into(self.adapter):
            _, _, rewards, _ = sample_and_score(self, embeds, pool_seeds.flatten(), pool_prompts, num_steps=sol.stage1_steps,
                                                guidance_scale=s.guidance_scale, prompt_index=index,
                                                batch_size=sol.stage1_batch_size or cfg.rollout.sample_batch_size,
                                                groups=index + mine.start, group_size=n)  # a group: a prompt's pool
        info["time/stage1"] = time.perf_counter() - t0
        rewards = self.check_rewards(rewards, iteration).float().reshape(len(prompts), n)
        rewards = _fill_nonfinite(rewards)
        selected = torch.stack([select_indices(rewards[i], k, sol.selection, random_keys=keys[i]) for i in range(len(prompts))]) \
            if prompts else torch.empty((0, k), dtype=torch.long)
        info["sol/pool_reward_mean"] = float(rewards.mean()) if rewards.numel() else float("nan")
        info["sol/selected_stage1_reward_mean"] = float(torch.gather(rewards, 1, selected).mean()) if rewards.numel() else float("nan")
        if sol.measure_fidelity and prompts:
            rows = slice(0, min(FIDELITY_SAMPLES, len(pool_prompts)))
            x, _ = seed_noise(pool_seeds.flatten()[rows], self.adapter.latent_shape(self.resolution, self.resolution))
            t = self.adapter.make_schedule(sol.stage1_steps, self.resolution, self.resolution)[0].expand(x.shape[0])
            with self.sampling_policy():
                err = velocity_error(self.adapter, self.lowp, x.to(self.device), t.to(self.device),
                                     embeds.select(index[rows].to(self.adapter.device)), s.guidance_scale)
            info["quant/velocity_rel_err"] = err["rel_l2"]
        sel_seeds = torch.gather(pool_seeds, 1, selected).flatten()
        if sol.audit_every and (iteration + 1) % sol.audit_every == 0:
            info.update(self._audit(embeds, index, pool_seeds, pool_prompts, rewards))
        return StageOne(all_prompts, mine, prompts, pool_seeds, rewards, selected, sel_seeds, info)

    def _audit(self, embeds, index: torch.Tensor, pool_seeds: torch.Tensor, pool_prompts: list[str], stage1: torch.Tensor) -> dict:
        """Whole pool at full precision: the pool-level rank fidelity of the copy (costly: N x stage-2 steps)."""
        s = self.cfg.sampling
        with self.sampling_policy():
            _, _, full, _ = sample_and_score(self, embeds, pool_seeds.flatten(), pool_prompts, num_steps=s.num_steps,
                                             guidance_scale=s.guidance_scale, batch_size=self.cfg.rollout.sample_batch_size,
                                             prompt_index=index, groups=index, group_size=self.sol.pool_size)
        full = full.float().reshape(stage1.shape)
        k = max(1, self.cfg.rollout.group_size // 2)
        taus = [kendall_tau(stage1[i], full[i]) for i in range(len(full))]
        hits = [topk_hit_rate(stage1[i], full[i], k) for i in range(len(full))]
        return {"sol/audit_kendall_tau": self._global_nanmean(taus), "sol/audit_topk_hit_rate": self._global_nanmean(hits)}

    def rank_metrics(self, one: StageOne, stage2: torch.Tensor) -> dict:
        """Kendall tau and top-(K/2) hit rate between stage-1 and stage-2 rewards of the selected seeds."""
        p, k = one.selected.shape
        r2 = _fill_nonfinite(stage2.float().reshape(p, k)) if p else stage2.reshape(0, k)
        r1 = torch.gather(one.rewards, 1, one.selected)
        half = max(1, k // 2)
        taus = [kendall_tau(r1[i], r2[i]) for i in range(p)]
        hits = [topk_hit_rate(r1[i], r2[i], half) for i in range(p)]
        return {"sol/kendall_tau": self._global_nanmean(taus), "sol/topk_hit_rate": self._global_nanmean(hits)}

    def _global_nanmean(self, values: list[float]) -> float:
        v = torch.tensor(values, dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            v = self.accelerator.gather(v.to(self.device)).cpu()
        v = v[torch.isfinite(v)]
        return float(v.mean()) if v.numel() else float("nan")

    def two_stage_header(self) -> None:
        sol, cfg = self.sol, self.cfg
        self.log(f"  Sol-RL: stage 1 {sol.pool_size} seeds/prompt x {sol.stage1_steps} ODE steps with {self.quant_format.describe()}; "
                 f"{cfg.rollout.group_size} selected ({sol.selection}); stage 2 {cfg.sampling.num_steps} steps at full precision; "
                 f"optimizer {sol.optimizer}")
        if self.lowp is not None:
            self.log("  low-precision copy: " + self.lowp.report.summary())


def _fill_nonfinite(r: torch.Tensor) -> torch.Tensor:
    """Non-finite rewards (counted by check_rewards, reward.nonfinite=skip) rank last: the row's finite minimum."""
    bad = ~torch.isfinite(r)
    if not bad.any():
        return r
    r = r.clone()
    for i in range(r.shape[0]):
        finite = r[i][~bad[i]]
        r[i][bad[i]] = finite.min() if finite.numel() else 0.0
    return r


# --------------------------------------------------------------------------------------------
# Optimiser 1: DiffusionNFT (the reference)
# --------------------------------------------------------------------------------------------


class SolRLTrainer(TwoStageRollout, DiffusionNFTTrainer):
    """Sol-RL with the DiffusionNFT update (``algorithm.optimizer: diffusion_nft``)."""

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self._init_two_stage()

    def nft_config(self) -> DiffusionNFTConfig:
        return self.cfg.algorithm.diffusion_nft

    def setup(self) -> None:
        super().setup()
        self._build_copy()

    def rollout(self, iteration: int) -> SeededSamples:
        cfg, s = self.cfg, self.cfg.sampling
        k = cfg.rollout.group_size
        one = self.stage_one(iteration)
        sample_prompts = [p for p in one.prompts for _ in range(k)]
        embeds = self.adapter.encode_prompts(one.prompts, with_uncond=s.guidance_scale > 1).repeat_interleave(k)
        groups = torch.arange(one.mine.start, one.mine.start + len(one.prompts)).repeat_interleave(k)
        t0 = time.perf_counter()
        with self.sampling_policy():
            x0, images, rewards, info = sample_and_score(self, embeds, one.selected_seeds, sample_prompts, num_steps=s.num_steps,
                                                         guidance_scale=s.guidance_scale, batch_size=cfg.rollout.sample_batch_size,
                                                         groups=groups, group_size=k)
        self.guard_finals(images, sample_prompts, iteration)  # train.guard's verifier
        info = self.gather_info(info)
        info["time/stage2"] = time.perf_counter() - t0
        info.update(one.info)
        info.update(self.rank_metrics(one, rewards))
        first = one.mine.start * k
        return SeededSamples(x0, images, embeds, sample_prompts, one.selected_seeds, torch.arange(first, first + len(sample_prompts)),
                             len(one.all_prompts) * k, rewards, info)

    def iteration(self, iteration: int) -> dict:
        record = super().iteration(iteration)
        self._copy_stale = True  # the old adapter (the copy's source) moved
        return record

    def print_header(self) -> None:
        super().print_header()
        self.two_stage_header()


# --------------------------------------------------------------------------------------------
# Optimiser 2: Flow-GRPO on the SDE regeneration of the chosen seeds
# --------------------------------------------------------------------------------------------


class SolRLGRPOTrainer(TwoStageRollout, FlowGRPOTrainer):
    """Sol-RL with the Flow-GRPO update (``algorithm.optimizer: flow_grpo``): stage 2 regenerates
    the chosen seeds with the SDE of ``sampling.kernel`` (initial noise and SDE noise from the
    seed; ``sampling.window_*`` for ODE outside a window), and Flow-GRPO's clipped loss trains on it."""

    supports_fsdp = False  # the low-precision copy is built from the policy's full weights
    supports_context_parallel = False  # its two-stage rollout has its own data layout

    sampling_adapter = DEFAULT_ADAPTER  # on-policy: the current policy samples

    def __init__(self, cfg, **kwargs):
        Trainer.__init__(self, cfg, **kwargs)  # FlowGRPOTrainer.__init__ would read cfg.algorithm as a FlowGRPOConfig
        self.algo = cfg.algorithm.flow_grpo  # what FlowGRPOTrainer's methods read
        self.needs_reference = self.algo.beta > 0
        self._checked = False  # on-policy self-check done
        self._init_two_stage()

    def sampling_policy(self):
        return contextlib.nullcontext()

    def setup(self) -> None:
        super().setup()
        self._build_copy()

    def rollout(self, iteration: int):
        cfg, s = self.cfg, self.cfg.sampling
        k = cfg.rollout.group_size
        one = self.stage_one(iteration)
        sample_prompts = [p for p in one.prompts for _ in range(k)]
        n_local, n_global = len(sample_prompts), len(one.all_prompts) * k
        first = one.mine.start * k
        sde_mask = sde_window_mask(s.num_steps, s.window_size, mode=s.window_mode, start=s.window_start, iteration=iteration,
                                   slide_every=s.window_slide_every, stride=s.window_stride, generator=self.generator)
        embeds = self.adapter.encode_prompts(one.prompts, with_uncond=s.guidance_scale > 1).repeat_interleave(k)
        groups = torch.arange(one.mine.start, one.mine.start + len(one.prompts)).repeat_interleave(k)
        t0 = time.perf_counter()
        trajs, futures = [], []
        bs = cfg.rollout.sample_batch_size
        for start in range(0, n_local, bs):
            rows = slice(start, start + bs)
            with self.autocast():
                traj = sample_seeded(self.adapter, embeds.select(rows), one.selected_seeds[rows], num_steps=s.num_steps,
                                     guidance_scale=s.guidance_scale, resolution=self.resolution, batch_size=bs,
                                     kernel=self.kernel, sde_mask=sde_mask, keep_latents=True)
            trajs.append(traj)
            futures.append(self.score_async(traj.images, sample_prompts[rows], groups[rows], k))
            self.guard_finals(traj.images, sample_prompts[rows], iteration)  # train.guard's verifier
        results = self.reward_results(futures)
        rewards = torch.cat([r for r, _ in results]) if results else torch.empty(0)
        info = self.gather_info(reward_info(results))
        info["time/stage2"] = time.perf_counter() - t0
        info.update(one.info)
        info.update(self.rank_metrics(one, rewards))
        self._t_rollout_end = time.perf_counter()
        return Trajectory.cat(trajs), embeds, torch.arange(first, first + n_local), n_global, rewards, info

    def iteration(self, iteration: int) -> dict:
        record = super().iteration(iteration)
        record["time/update"] = time.perf_counter() - self._t_rollout_end
        self._copy_stale = True  # the policy (the copy's source) moved
        return record

    def print_header(self) -> None:
        super().print_header()
        self.two_stage_header()


def build_sol_rl_trainer(cfg, **kwargs):
    """The registered Sol-RL recipe: the trainer of ``algorithm.optimizer``."""
    if cfg.algorithm.optimizer == "flow_grpo":
        return SolRLGRPOTrainer(cfg, **kwargs)
    return SolRLTrainer(cfg, **kwargs)


register_recipe("sol_rl", SolRLConfig, build_sol_rl_trainer)

__all__ = ["SolRLConfig", "SolRLTrainer", "SolRLGRPOTrainer", "TwoStageRollout", "StageOne", "build_sol_rl_trainer"]
