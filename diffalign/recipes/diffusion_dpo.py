"""Diffusion-DPO recipe: offline preference pairs -> the Diffusion-DPO loss against a frozen reference.

The baseline SPO was designed to beat. Pairs come from a Pick-a-Pic-layout file
(``algorithm.pairs``, see :mod:`diffalign.pairs`) or, when none is given, are generated once
before training: ``algorithm.generate_images_per_prompt`` images per training prompt from the
base model (deterministic sampler, ``sampling.eval_num_steps`` steps), labelled by the run's
``reward`` (e.g. ShapesEval) and written to ``<output_dir>/pairs`` (reused on resume). Ties are
dropped (Diffusion-DPO needs a winner).

Every micro-batch: ``train.batch_size`` pairs, one noise level per pair (uniform), the same noise
for winner and loser, the conditional denoiser (no CFG) of the policy and of the reference (LoRA
disabled, or a frozen copy for full fine-tuning), and :func:`diffalign.algorithms.diffusion_dpo.diffusion_dpo_loss`.
An iteration is ``train.optimizer_steps_per_iteration`` optimizer steps of
``algorithm.accumulation_steps`` micro-batches each. The math lives in
:mod:`diffalign.algorithms.diffusion_dpo`; the noising in :mod:`diffalign.forward_process`.

Multi-process runs draw the global batch of pair indices, noise and noise levels from the shared
generator and take their slice, with losses normalised by the global pair count (as Flow-GRPO):
two gloo processes give the same update as one (``tests/test_distributed.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from diffalign.algorithms.diffusion_dpo import diffusion_dpo_loss, per_sample_mse
from diffalign.config import AlgorithmConfig, check
from diffalign.errors import DiffalignError
from diffalign.forward_process import add_noise, denoising_target, encode_images, model_time
from diffalign.pairs import PairSet, generate_pairs, read_pairs, write_pairs
from diffalign.images import resize
from diffalign.prompts import PromptSampler
from diffalign.recipes import register_recipe
from diffalign.sampling.linear import SampleSpec
from diffalign.trainer import Trainer
from diffalign.training.text_encoders import run_prompt_set

GENERATED_PAIRS_DIR = "pairs"  # under the run directory


@dataclass
class DiffusionDPOConfig(AlgorithmConfig):
    name: str = "diffusion_dpo"
    beta: float = 5000.0  # beta_dpo; the reference uses 5000 for SD1.5 / SDXL latents (scale with the error size)
    pairs: Optional[str] = None  # Pick-a-Pic-layout pair file or folder; None = generate from the base model with `reward`
    pairs_limit: int = 0  # read only the first N pairs of the file (0 = all)
    generate_images_per_prompt: int = 4  # images per training prompt when generating (all within-prompt pairs are used)
    generate_seed: int = 0  # sampler seed of the generated images
    accumulation_steps: int = 1  # micro-batches of train.batch_size pairs per optimizer step
    tau_min: float = 0.0  # noise levels are drawn uniformly in [tau_min, tau_max) (0 clean, 1 noise)
    tau_max: float = 1.0

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.beta > 0, "algorithm.beta", "must be > 0")
        check(self.pairs_limit >= 0, "algorithm.pairs_limit", "must be >= 0")
        check(self.generate_images_per_prompt >= 2, "algorithm.generate_images_per_prompt", "must be >= 2 (pairs need two images)")
        check(self.accumulation_steps >= 1, "algorithm.accumulation_steps", "must be >= 1")
        check(0.0 <= self.tau_min < self.tau_max <= 1.0, "algorithm.tau_min", "and algorithm.tau_max must satisfy 0 <= tau_min < tau_max <= 1")
        super().validate(prefix)

    def rollout_images(self) -> bool:  # trained on a fixed set of pairs, generated once or read from a file
        return False


class DiffusionDPOTrainer(Trainer):
    supports_fsdp = True  # every process runs the same micro-batches (a slice of one global draw)
    needs_reference = True

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.algo: DiffusionDPOConfig = cfg.algorithm
        self.generation: dict = {}

    # ---- setup: pairs -----------------------------------------------------------------------
    def setup(self) -> None:
        algo = self.algo
        file_pairs = None
        if algo.pairs:  # read and check the file before the run directory is touched
            file_pairs = read_pairs(algo.pairs, resolution=self.cfg.model.resolution or None, limit=algo.pairs_limit)
            _check_has_winners(file_pairs)
        self._file_pair_prompts = list(file_pairs.prompts) if file_pairs is not None else []
        super().setup()
        if file_pairs is not None:
            pairs = file_pairs
        else:
            pairs = self._generated_pairs()
        _check_has_winners(pairs)
        strict = pairs.strict()
        winners, losers = strict.oriented()
        self.winners = resize(winners, self.resolution)
        self.losers = resize(losers, self.resolution)
        self.pair_prompts = strict.prompts
        self.pair_sampler = PromptSampler(list(range(len(strict))), self.cfg.seed + 1)  # cycles through pair indices
        if self.resume:
            state = getattr(self, "_pending_sampler_state", None)
            if state is not None:
                self.pair_sampler.load_state_dict(state)
        # ties: those in the pair file, plus those the generation already left out
        ties = len(pairs) - len(strict) + int((self.generation or {}).get("ties", 0))
        self.log(f"  diffusion-dpo: {len(strict)} pairs with a winner ({ties} ties dropped)"
                 + (f"; generated {self.generation}" if self.generation else ""))

    def encoded_prompts(self) -> list[str]:
        """The run's prompts and a pair file's (``model.text_encoders: cache``); generated pairs
        have the training prompts."""
        return run_prompt_set([super().encoded_prompts(), self._file_pair_prompts])

    def _generated_pairs(self) -> PairSet:
        folder = self.run_dir / GENERATED_PAIRS_DIR
        if self.resume and (folder / "pairs.jsonl").is_file():
            return read_pairs(folder)
        # Under FSDP the sampling forwards are collectives: every process samples the same pairs
        # (same seed), the main one writes them.
        if self.accelerator.is_main_process or self.sharded:
            self.adapter.denoiser.eval()
            with self.autocast():
                pairs, stats = generate_pairs(
                    self.adapter, self.train_prompts, self.reward_fn, images_per_prompt=self.algo.generate_images_per_prompt,
                    sampling=SampleSpec(num_steps=self.cfg.sampling.eval_num_steps, guidance_scale=self.cfg.sampling.guidance_scale,
                                        resolution=self.resolution, seed=self.algo.generate_seed, batch_size=self.cfg.eval.batch_size),
                    keep_ties=False, reward_name=self.cfg.reward.name,
                )
            if self.accelerator.is_main_process:
                write_pairs(pairs, folder)
            self.generation = stats
        self.accelerator.wait_for_everyone()
        return pairs if self.accelerator.is_main_process or self.sharded else read_pairs(folder)

    # ---- training ---------------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        cfg, algo = self.cfg, self.algo
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        bs, dev = cfg.train.batch_size, self.device
        stats = {k: [] for k in ("loss", "implicit_acc", "model_diff", "ref_diff", "model_mse", "grad_norm")}
        steps_applied = 0
        self.adapter.denoiser.train()
        latent = self.adapter.latent_shape(self.resolution, self.resolution)
        for _ in range(cfg.train.optimizer_steps_per_iteration):
            bad = False
            for _micro in range(algo.accumulation_steps):
                # Global draws (same on every process), then this process's slice.
                idx = torch.tensor(self.pair_sampler.next(bs * world))
                noise = torch.randn((bs * world, *latent), generator=self.generator)
                tau = algo.tau_min + (algo.tau_max - algo.tau_min) * torch.rand(bs * world, generator=self.generator)
                mine = slice(rank * bs, (rank + 1) * bs)
                idx, noise, tau = idx[mine], noise[mine].to(dev), tau[mine]
                x0_w = encode_images(self.adapter, PairSet.to_float(self.winners[idx]))
                x0_l = encode_images(self.adapter, PairSet.to_float(self.losers[idx]))
                t = model_time(self.adapter, tau).to(dev)
                x_t = torch.cat([add_noise(self.adapter, x0_w, noise, t), add_noise(self.adapter, x0_l, noise, t)])
                target = torch.cat([denoising_target(self.adapter, x0_w, noise), denoising_target(self.adapter, x0_l, noise)])
                prompts = [self.pair_prompts[int(i)] for i in idx]
                embeds = self.adapter.encode_prompts(prompts + prompts, with_uncond=False)
                with self.autocast():
                    pred = self.adapter.predict(x_t, torch.cat([t, t]), embeds, 1.0)
                err_w, err_l = per_sample_mse(pred, target).chunk(2)
                with torch.no_grad(), self.reference_model(), self.autocast():
                    ref = self.adapter.predict(x_t, torch.cat([t, t]), embeds, 1.0)
                ref_w, ref_l = per_sample_mse(ref, target).chunk(2)
                res = diffusion_dpo_loss(err_w, err_l, ref_w, ref_l, beta=algo.beta)
                loss = res.per_pair.sum() / float(bs * world * algo.accumulation_steps)
                if not self.accumulate(loss):
                    bad = True
                    continue
                stats["loss"].append(float(res.loss.detach()))
                stats["implicit_acc"].append(float(res.implicit_accuracy))
                stats["model_diff"].append(float(res.model_diff))
                stats["ref_diff"].append(float(res.ref_diff))
                stats["model_mse"].append(float(torch.cat([err_w, err_l]).mean().detach()))
            _, applied = self.close_step(bad, stats)  # a poisoned step is dropped and counted
            steps_applied += int(applied)
        out = self.mean_stats(stats)
        out["optimizer_steps"] = steps_applied
        out["pairs_seen"] = steps_applied * algo.accumulation_steps * bs * world
        return out

    def print_header(self) -> None:
        cfg, algo = self.cfg, self.algo
        n_train = sum(p.numel() for p in self.trainable)
        per_step = cfg.train.batch_size * algo.accumulation_steps * self.accelerator.num_processes
        self.log(f"diffalign: diffusion_dpo on {cfg.model.id} ({self.adapter.family}, {self.resolution}px) -> {self.run_dir}")
        self.log(f"  pairs per optimizer step {per_step}, optimizer steps per iteration {cfg.train.optimizer_steps_per_iteration}, "
                 f"beta {algo.beta:g}, trainable params {n_train:,}, processes {self.accelerator.num_processes}, device {self.device}")

    # ---- state ------------------------------------------------------------------------------
    def extra_state(self) -> dict:
        return {"pair_sampler": self.pair_sampler.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        # Called from Trainer.setup() (resume) before the pairs exist; applied once they do.
        self._pending_sampler_state = state.get("pair_sampler")


def _check_has_winners(pairs: PairSet) -> None:
    if not bool((pairs.label_0 != 0.5).any()):
        raise DiffalignError(f"no preference pairs with a winner: all {len(pairs)} pairs are ties (label 0.5)")


register_recipe("diffusion_dpo", DiffusionDPOConfig, DiffusionDPOTrainer)
