"""The trainer: everything an algorithm needs that is not the algorithm.

:class:`Trainer` composes the parts in :mod:`diffalign.training` (the policy with its LoRA and
reference, the optimisation backend for one process / DDP / ZeRO / FSDP, the reward pool,
evaluation, checkpoints) around accelerate, seeding, the model adapter, prompts and the loop. An
algorithm subclasses it and implements :meth:`Trainer.iteration` (rollout -> rewards ->
advantages -> update) using pure functions from :mod:`diffalign.algorithms` and samplers from
:mod:`diffalign.sampling`; its update needs only :meth:`~Trainer.accumulate`,
:meth:`~Trainer.close_step` and :meth:`~Trainer.check_log_ratio`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

import reward_models
from reward_models.combine import WeightedSum
from diffalign import distributed, progress, recipes, runs
from diffalign.adapters import load_adapter
from diffalign.adapters.base import DTYPES, ModelAdapter
from diffalign.config import RunConfig
from diffalign.config_files import dump_config, to_dict
from diffalign.errors import ConfigError, DiffalignError, GuardStop, Interrupted, RewardError
from diffalign.images import prompt_metadata, prompt_record
from diffalign.prompts import PromptSampler, resolve_probe_prompts, resolve_prompts
from diffalign.report import write_report
from diffalign.sampling import build_kernel
from diffalign.training import checkpoints, evaluator, groups, metrics, samples, text_encoders, tracking
from diffalign.training.backend import Backend, OptimizerStep, allow_precision, lr_factor
from diffalign.training.checks import check_config, check_on_policy, max_log_ratio
from diffalign.training.guard import RewardGuard
from diffalign.training.interrupts import StopSignals
from diffalign.training.policy import prepare_denoiser
from diffalign.training.rewards import RewardFailures, RewardPool, agree_on_failure, call_with_retries, collect, reward_info

__all__ = ["Trainer", "build_trainer", "reward_info"]


def build_trainer(cfg: RunConfig, **kwargs) -> "Trainer":
    """The trainer of ``cfg.algorithm.name`` for ``cfg``, after :func:`check_config` (every name and
    file checked before a model loads). ``kwargs``: ``resume``, ``overwrite``, ``allow_config_change``, ``log``."""
    check_config(cfg)
    return recipes.trainer_class(cfg.algorithm.name)(cfg, **kwargs)


class _Finished(Exception):
    """Raised by :meth:`Trainer.setup` when a resumed run had already finished (see :meth:`Trainer.train`)."""


class Trainer:
    """Base trainer; subclasses implement :meth:`iteration`. See the module docstring."""

    #: algorithms whose reference model is needed (KL) set this from their config
    needs_reference: bool = False

    #: the update loop keeps every process's forwards in lockstep (``lockstep_counts``): FSDP may shard it
    supports_fsdp = False

    #: the update loop reads its data layout from ``self.layout`` and its rewards through
    #: ``groups.gathered_group_advantages``: ``train.context_parallel`` may split its samples' tokens
    supports_context_parallel = False

    #: the update moves each micro-batch to the device itself (:meth:`to_device`), so a rollout's
    #: samples may wait in CPU memory (``rollout.offload_samples``, :meth:`stash_samples`)
    supports_sample_offload = False

    #: the iteration record's key of the reward the method trains on, which the reward-hacking guard
    #: (``train.guard``) sets beside its verifier; a method trained on a judge's score names that score
    learned_reward_key = "reward_mean"

    def __init__(self, cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, allow_config_change: bool = False,
                 log: Callable[[str], None] | None = None):
        if cfg.rollout.offload_samples and not self.supports_sample_offload:
            raise ConfigError(f"config key 'rollout.offload_samples' is not supported by algorithm {cfg.algorithm.name!r} "
                              "(docs/text_encoders.md#rollout-samples lists those that support it)")
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.resume = resume
        self.overwrite = overwrite
        self.allow_config_change = allow_config_change  # resume with another model / algorithm / LoRA shape / prompts
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.stats: dict = {"nonfinite_rewards": 0, "nonfinite_losses": 0, "skipped_steps": 0}
        self.start_iteration = 0
        self.reward_pool: Optional[RewardPool] = None
        self.reward_weights: Optional[torch.Tensor] = None  # (K,) the weighted reward's weights under GDPO (setup)
        self.self_check_log_ratio: Optional[float] = None  # max |log ratio| of the on-policy self-check
        self._saved_iteration: Optional[int] = None  # the iteration of the last checkpoint written (or resumed from)
        self._updated_in_iteration = False  # an optimizer step was taken in this iteration (guarded_iteration)
        self.finished: Optional[int] = None  # a resumed run that had already finished: the iterations it trained
        self.guard: Optional[RewardGuard] = None  # train.guard with a verifier (built in setup)
        self._guard_stop: Optional[str] = None  # the guard's stop message, carried out after the iteration's record
        self._iteration = 0  # the iteration running (its number in reward messages)

    # ---- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        # Validate everything that needs no model before touching the run directory.
        self.train_prompts, self.eval_prompts = resolve_prompts(cfg)
        self.probe_prompts = resolve_probe_prompts(cfg)
        tracking.check_trackers(cfg.log.trackers)
        self.reward_fn = reward_models.build(cfg.reward.name, device="cpu", **cfg.reward.kwargs)
        if reward_models.is_groupwise(self.reward_fn) and not cfg.algorithm.rewards_in_groups():
            raise ConfigError(f"config key 'reward.name': reward {cfg.reward.name!r} compares the images of a prompt group, "
                              f"which algorithm {cfg.algorithm.name!r} does not hand to its reward (docs/rewards.md#pairwise-preference-rewards)")
        cfg.algorithm.apply_reward_defaults(reward_models.is_groupwise(self.reward_fn))  # e.g. Pref-GRPO's advantages
        self.reward_weights = self._reward_weights()  # (K,) with advantage_aggregation gdpo, else None
        if cfg.algorithm.needs_differentiable_reward() and not reward_models.is_differentiable(self.reward_fn):
            raise ConfigError(f"config key 'reward.name': {cfg.reward.name!r} is not differentiable (it does not declare "
                              f"differentiable = True), and {cfg.algorithm.name} trains through the reward's gradient")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.mixed_precision = cfg.train.resolved_mixed_precision(device)
        allow_precision(self.mixed_precision)
        if distributed.fsdp_requested(cfg.train.fsdp, cfg.train.zero_stage):
            distributed.fsdp_settings()  # FSDP1 and unapplied keys stop before accelerate builds its FSDP plugin
        self.accelerator = Accelerator(mixed_precision=self.mixed_precision, cpu=device.type == "cpu",
                                       log_with=tracking.log_with(cfg) or None)
        # the data layout: processes of a context-parallel group hold the same samples
        self.layout = distributed.process_layout(self.accelerator.process_index, self.accelerator.num_processes,
                                                 cfg.train.context_parallel)
        runs.check_run_dir(self.run_dir, resume=self.resume, overwrite=self.overwrite)  # every process: same verdict
        if self.resume:  # before the model loads: a changed setup is a one-line error
            checkpoints.check_resume_config(self.run_dir, cfg, self.allow_config_change)
            self.finished = runs.finished_iterations(self.run_dir, cfg.max_iterations, report=cfg.log.report)
            if self.finished is not None:
                raise _Finished  # nothing to load, train, evaluate or write: train() says so
        self.device = self.accelerator.device
        set_seed(cfg.seed)  # same on every process: identical initial (LoRA) weights

        # no finer progress inside diffusers' loading: the bar's clock keeps ticking through it (on a
        # terminal only, and cleared after: a config error found later still ends in one line)
        with progress.bar(desc=f"loading {cfg.model.id}", unit="",
                          disable=not (self.accelerator.is_main_process and progress.interactive())):
            self.adapter: ModelAdapter = load_adapter(cfg.model.id, family=cfg.model.family, device=self.device,
                                                      dtype=DTYPES[cfg.model.dtype], **cfg.model.options)
        if cfg.model.text_encoders == "offload":  # to CPU memory before the LoRA and the optimizer take the device's
            text_encoders.use_placement(self.adapter, "offload")
            self.log(f"text encoders: {', '.join(self.adapter.text_encoders())} in CPU memory between encodings")
        self.resolution = cfg.model.resolution or self.adapter.default_resolution
        if self.device.type != "cpu" and cfg.reward.name:
            # rebuild on the accelerator when it has one (rewards take a device argument)
            self.reward_fn = reward_models.build(cfg.reward.name, device=str(self.device), **cfg.reward.kwargs)
        if cfg.train.guard.verifier:
            verifier = reward_models.build(cfg.train.guard.verifier, device=str(self.device), **cfg.train.guard.verifier_kwargs)
            self.guard = RewardGuard(cfg.train.guard, verifier, self.learned_reward_key)
        score = self.score if self.reward_weights is None else self.score_components  # GDPO: each component's reward
        self.reward_pool = RewardPool(score, asynchronous=cfg.reward.async_, reward_name=cfg.reward.name,
                                      nonfinite=cfg.reward.nonfinite, stats=self.stats,
                                      groupwise=reward_models.is_groupwise(self.reward_fn))
        self._setup_trainable()
        if self.layout.degree > 1:  # after LoRA: the split and gather hooks wrap the adapted modules
            problem = distributed.context_parallel_problem(self.adapter.family, self.layout.degree)
            if problem:  # a hub id's family is known once it has loaded
                raise ConfigError(problem)
            distributed.enable_context_parallel(list(self.adapter.denoiser_parts().values()), self.layout, self.device)
        self.kernel = build_kernel(
            self.adapter, cfg.sampling.kernel, cfg.sampling.noise_level,
            std_schedule=cfg.sampling.std_schedule, reduction=cfg.algorithm.kernel_reduction(),
            noise_pool=cfg.sampling.noise_pool,
        )
        # Everything is validated and loaded: now the run directory may change.
        if self.accelerator.is_main_process:
            runs.prepare_run_dir(self.run_dir, resume=self.resume, overwrite=self.overwrite)
        self.accelerator.wait_for_everyone()
        self.prompt_cache = None
        if cfg.model.text_encoders == "cache":  # the whole prompt set encoded once (or read back on resume), encoders freed
            self.prompt_cache = text_encoders.cache_prompt_embeddings(
                self.adapter, self.run_dir, self.encoded_prompts(), self._encoding_model(), rank=self.accelerator.process_index,
                world=self.accelerator.num_processes, barrier=self.accelerator.wait_for_everyone, log=self.log)
            text_encoders.use_placement(self.adapter, "cache", cache=self.prompt_cache, keep_encoders=not cfg.lora.enabled)
        # One stream shared by all processes (prompts, noise, shuffles are drawn globally, then sliced).
        self.generator = torch.Generator("cpu").manual_seed(cfg.seed * 1000 + 17)
        self.prompt_sampler = PromptSampler(self.train_prompts, cfg.seed)
        self.metrics = runs.MetricsLog(self.run_dir / "metrics.jsonl")
        if self.resume:
            resumed = checkpoints.load_latest(self)
            self.start_iteration = resumed or 0
            self._saved_iteration = resumed
        elif self.accelerator.is_main_process:
            runs.atomic_write_text(self.run_dir / "config.yaml", dump_config(cfg))
            # the prompts as resolved at start: a prompt file may change after the run
            runs.atomic_write_text(self.run_dir / "prompts.json",
                                   json.dumps({"train": [prompt_record(p) for p in self.train_prompts],
                                               "eval": [prompt_record(p) for p in self.eval_prompts]}, indent=0) + "\n")
        self.tracking = tracking.Tracking(self.accelerator, cfg)
        self.tracking.start(to_dict(cfg))

    def _setup_trainable(self) -> None:
        """LoRA / full fine-tuning and the reference (:mod:`~diffalign.training.policy`), then the
        optimizer, ZeRO / FSDP and EMA (:mod:`~diffalign.training.backend`). Recipes extend it."""
        self.policy = prepare_denoiser(self.adapter, self.cfg, self.needs_reference)
        self._lora_layers = self.policy.lora_layers
        self.backend = Backend(self.adapter.denoiser, self.cfg, self.accelerator, self.device,
                               supports_fsdp=self.supports_fsdp, stats=self.stats, log=self.log)
        self.trainable, self.trainable_names = self.backend.trainable, self.backend.trainable_names
        self.optimizer, self.ema = self.backend.optimizer, self.backend.ema
        if self.cfg.train.attention == "xformers":
            distributed.enable_xformers(self.adapter)

    def encoded_prompts(self) -> list[str]:
        """Every prompt this run encodes, for ``model.text_encoders: cache``: the training, evaluation
        and probe prompts, and the validation prompts of ``eval.best_scale``. A recipe that encodes
        other prompts adds them."""
        validation = evaluator.validation_prompts(self.eval_prompts) if self.cfg.eval.best_scale else []
        return text_encoders.run_prompt_set([self.train_prompts, self.eval_prompts, self.probe_prompts, validation])

    def _encoding_model(self) -> dict:
        """The ``model.*`` entries that change a prompt's embeddings (the embedding cache's key)."""
        m = self.cfg.model
        return {"id": m.id, "revision": m.revision, "dtype": m.dtype, "options": m.options}

    def stash_samples(self, *items):
        """A rollout's samples (tensors, trajectories, prompt embeddings) kept until the update: moved
        to CPU memory with ``rollout.offload_samples``, else returned as they are. The update then
        moves each micro-batch back with :meth:`to_device`."""
        if not self.cfg.rollout.offload_samples:
            return items
        return tuple(samples.to_device(item, torch.device("cpu")) for item in items)

    def to_device(self, item):
        """``item`` (a micro-batch's tensors, trajectory rows or prompt embeddings) on this run's device."""
        return samples.to_device(item, self.device)

    def reference_model(self):
        """The frozen reference: the same network with the LoRA adapter disabled (no second copy),
        or for full fine-tuning a frozen copy taken at the start."""
        return self.policy.reference_model()

    # ---- helpers for algorithms -------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            self._log(message)

    def autocast(self):
        """The forwards' autocast (rollouts and updates alike). Decided by this trainer's precision,
        not by accelerate's process-wide state (DeepSpeed's ZeRO path keeps fp32 master weights and
        autocasts the same way)."""
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The forwards' autocast dtype (None: fp32), from ``train.mixed_precision`` as resolved."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision)

    def call_reward(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """The reward's own output for ``images`` (its graph kept: DRaFT / ReFL descend it), called
        again after a failure up to ``reward.max_failures`` (:func:`~diffalign.training.rewards.call_with_retries`;
        one failure more raises ``RewardFailures``, which :meth:`guarded_iteration` turns into a stop
        with a checkpoint). Videos ``(B, F, 3, H, W)`` get the mean of the per-frame rewards
        (:func:`reward_models.call_reward`). Each sample's metadata is
        :func:`~diffalign.images.prompt_metadata` of its prompt (an edit's ``source_image``) plus
        its entry of ``metadata`` (the reward pool's ``group``)."""
        metadata = [{**base, **extra} for base, extra in zip(prompt_metadata(prompts), metadata or [{} for _ in prompts])]
        return call_with_retries(lambda: reward_models.call_reward(self.reward_fn, images, prompts, metadata),
                                 self.reward_fn, self.stats, self.cfg.reward.max_failures, self._log)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> tuple[torch.Tensor, dict]:
        """:meth:`call_reward`, its output validated (shape) and detached: (rewards (B,), info)."""
        value = self.call_reward(images, prompts, metadata)
        rewards = reward_models.check_reward_output(self.cfg.reward.name, value, len(prompts))
        return rewards, dict(getattr(self.reward_fn, "last_info", None) or {})

    def _reward_weights(self) -> torch.Tensor | None:
        """The weights of the reward's components when the method normalises each on its own
        (``algorithm.advantage_aggregation: gdpo``), else None."""
        if self.cfg.algorithm.reward_aggregation() != "gdpo":
            return None
        if not isinstance(self.reward_fn, WeightedSum) or len(self.reward_fn.components) < 2:
            raise ConfigError("config key 'algorithm.advantage_aggregation': gdpo normalises each reward of a weighted sum "
                              "on its own and needs reward.name: weighted with at least two components (docs/gdpo.md)")
        return self.reward_fn.weights

    def score_components(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None
                         ) -> tuple[torch.Tensor, dict]:
        """:meth:`score` for GDPO's advantages: (the unweighted component rewards (B, K), info);
        their weighted sum is ``components @ reward_weights``."""
        _, info = self.score(images, prompts, metadata)
        return self.reward_fn.last_components.detach().float().cpu(), info

    def score_async(self, images: torch.Tensor, prompts: list[str], groups: torch.Tensor | None = None,
                    group_size: int | None = None):
        """Score a rollout chunk through the reward pool: on its worker thread while the next chunk
        samples (``reward.async``), else now. ``groups`` (B,): each image's prompt-group id, unique
        within the iteration; ``group_size``: images per group (default ``rollout.group_size``).
        Returns a future-like object whose ``result()`` is (rewards (B,), info)."""
        if groups is not None and group_size is None:
            group_size = self.cfg.rollout.group_size
        return self.reward_pool.submit(images, prompts, groups, group_size)

    def guard_finals(self, images: torch.Tensor, prompts: list[str], iteration: int) -> None:
        """Hand the final images ``(B, 3, H, W)`` of this iteration's rollouts (in [0, 1]) to the
        reward-hacking guard's verifier (``train.guard``; only at the iterations it scores). Every
        recipe that samples calls it where its final images exist."""
        if self.guard is not None and self.guard.scores_at(iteration):
            self.guard.observe(images, prompts)

    def guard_step(self, iteration: int, record: dict, *, act: bool = True) -> dict:
        """After an iteration the verifier scored: its mean over processes beside the learned reward
        (``record[learned_reward_key]``), the divergence test on the window, and (``act``) the
        action: a warning, a lower learning rate, or a checkpoint and :class:`GuardStop`. Returns the
        ``guard/*`` keys for the record ({} without a guard or at an iteration it does not score).
        A stop is carried out by :meth:`stop_if_guarded` once the record is written. A collective:
        every process calls it."""
        guard = self.guard
        if guard is None or not guard.scores_at(iteration):
            return {}
        sums = torch.tensor(guard.local_sums(), dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums.to(self.device), reduction="sum").cpu()
        done = iteration + 1  # the curves count iterations done, as the log's "iteration k/N" lines and the report
        decision = guard.close(done, record.get(self.learned_reward_key, float("nan")), sums.tolist())
        self.stats["guard_nonfinite"] = guard.nonfinite
        out = dict(decision.record)
        if act and decision.action == "warn":
            self.log(f"warning: reward-hacking guard after iteration {done}: {decision.message}")
        elif act and decision.action == "lower_lr":
            self.log(f"reward-hacking guard after iteration {done}: {decision.message}; learning rate x "
                     f"{guard.cfg.lr_factor:g} (drop {guard.lr_drops} of train.guard.max_lr_drops={guard.cfg.max_lr_drops})")
            lr = self.backend.set_lr_factor(self.lr_factor_at(iteration + 1))
            out.update({"guard/lr_drop": guard.lr_drops, "guard/lr": lr})  # the rate of the iterations that follow
        elif act and decision.action == "stop":
            self._guard_stop = (f"reward-hacking guard stopped the run after iteration {done}: {decision.message}; "
                                f"checkpoint at iteration {done} in {self.run_dir} (train.guard.action=stop)")
            out["guard/stop"] = 1
        out["guard/lr_scale"] = guard.lr_scale
        return out

    def stop_if_guarded(self, done: int) -> None:
        """After :meth:`guard_step` decided to stop: a checkpoint after ``done`` iterations, then
        :class:`~diffalign.errors.GuardStop` with the message naming both trends."""
        if self._guard_stop is None:
            return
        if self._saved_iteration != done:
            self.save_checkpoint(done)
        raise GuardStop(self._guard_stop)

    def reward_results(self, futures) -> list[tuple[torch.Tensor, dict]]:
        """The (rewards (B,), info) of a rollout's :meth:`score_async` calls, once every process
        has them: a collective, called by every process once its rollout is sampled. A reward that
        failed on any process (or, with ``reward.nonfinite=error``, returned NaN / inf) stops every
        process here together (:func:`~diffalign.training.rewards.agree_on_failure`), before any
        of them gathers rewards or updates."""
        results, error = collect(futures)
        if error is None and self.cfg.reward.nonfinite == "error" and results:
            try:
                self.reward_pool.check(torch.cat([r.flatten() for r, _ in results]), self._iteration)
            except RewardError as exc:
                error = exc
        agree_on_failure(error, self.accelerator, self.device)
        return results

    def check_rewards(self, rewards: torch.Tensor, iteration: int) -> torch.Tensor:
        """Count non-finite rewards; stop (``reward.nonfinite=error``) or leave them for masking."""
        return self.reward_pool.check(rewards, iteration)

    @property
    def sharded(self) -> bool:
        """FSDP: every process must run the same forwards (evaluation included)."""
        return self.backend.sharded

    def lockstep_counts(self, counts: list[int]) -> list[int]:
        """Micro-batches per optimizer step every process runs (the global maximum under FSDP)."""
        return self.backend.lockstep_counts(counts)

    def plan_optimizer_steps(self, terms: list[int]) -> list[OptimizerStep]:
        """An epoch's micro-batches (``terms[m]`` loss terms each on this process) split into the
        iteration's optimizer steps, each with its global number of terms (a collective); see
        :meth:`~diffalign.training.backend.Backend.plan_steps`."""
        return self.backend.plan_steps(terms)

    def idle_forward(self, x: torch.Tensor, t: torch.Tensor, embeds, guidance_scale: float, *, reference: bool) -> None:
        """A zero-loss training forward and backward (plus the reference forward when the loss has a
        KL term): under FSDP a process with fewer micro-batches joins the others' collectives."""
        with self.autocast():
            out = self.adapter.predict(x, t, embeds, guidance_scale)
        if reference:
            with torch.no_grad(), self.reference_model(), self.autocast():
                self.adapter.predict(x, t, embeds, guidance_scale)
        self.backend.backward(out.float().sum() * 0.0)

    def plan_group_rollout(self, iteration: int, *, with_step_noise: bool = True) -> groups.GroupRollout:
        """This iteration's prompts and noise for a group rollout (:func:`diffalign.training.groups.plan_group_rollout`)."""
        return groups.plan_group_rollout(self.cfg, iteration, adapter=self.adapter, prompt_sampler=self.prompt_sampler,
                                         generator=self.generator, resolution=self.resolution, world=self.layout.dp_world,
                                         rank=self.layout.dp_rank, with_step_noise=with_step_noise)

    def guarded_iteration(self, it: int) -> dict:
        """:meth:`iteration`; when the reward fails for good before any update of the iteration,
        the random streams go back to where the iteration began and a checkpoint is written there,
        so that ``diffalign resume`` repeats the iteration exactly once the reward works again.

        With several processes the failure reaches every process at the same point
        (:meth:`reward_results`), so all of them write that one checkpoint together (a collective
        under ZeRO and FSDP) and stop with the same message, printed once."""
        self._updated_in_iteration = False
        if self.guard is not None:
            self.guard.begin()
        self._iteration = it
        boundary = checkpoints.stream_state(self)
        try:
            return self.iteration(it)
        except RewardFailures as exc:
            if self.reward_pool is not None:
                self.reward_pool.shutdown()
            if not self._updated_in_iteration and self._saved_iteration != it:
                checkpoints.load_stream_state(self, boundary)
                self.save_checkpoint(it)
            saved = self._saved_iteration
            kept = f"checkpoint at iteration {saved}" if saved is not None else "no checkpoint"
            stop = DiffalignError(f"stopped: {exc}; {kept}; fix the reward, then: diffalign resume {self.run_dir}")
            stop.agreed = exc.agreed
            raise stop from None

    def accumulate(self, loss: torch.Tensor) -> bool:
        """Backward one micro-batch's loss (normalised by the global number of terms of the step);
        False when it was non-finite and poisons the step (see :meth:`close_step`)."""
        self._updated_in_iteration = True
        return self.backend.accumulate(loss)

    def close_step(self, poisoned: bool, stats: dict[str, list[float]] | None = None) -> tuple[float, bool]:
        """Apply (or, when any process saw a non-finite loss, drop and count) the accumulated
        step. Returns (grad_norm, applied); an applied step's norm is appended to ``stats["grad_norm"]``."""
        self._updated_in_iteration = True
        norm, applied = self.backend.close_step(poisoned)
        if applied and stats is not None:
            stats["grad_norm"].append(norm)
        return norm, applied

    def mean_stats(self, stats: dict[str, list[float]]) -> dict[str, float]:
        """Per-key means of an update's micro-batch statistics over every process (a collective)."""
        return metrics.mean_stats(self.accelerator, self.device, stats)

    def gather_info(self, info: dict[str, float]) -> dict[str, float]:
        """Per-key mean over processes of a process-local info dict (a collective)."""
        return metrics.gather_info(self.accelerator, info)

    def check_log_ratio(self, new_logp: torch.Tensor, old_logp: torch.Tensor, where: str, sampler: str = "sampler") -> None:
        """The on-policy self-check (:mod:`~diffalign.training.checks`) when ``train.self_check``."""
        if not self.cfg.train.self_check or new_logp.numel() == 0:
            return
        self.self_check_log_ratio = max_log_ratio(new_logp, old_logp)
        check_on_policy(self.self_check_log_ratio, self.cfg.train.self_check_tolerance, where, sampler)

    def eval_weights(self):
        """Context: EMA weights when enabled and configured, else the current weights."""
        if self.ema is not None and self.cfg.eval.use_ema:
            return self.ema.swapped_in()
        return contextlib.nullcontext()

    # ---- evaluation, state, export ----------------------------------------------------------
    def eval_setup(self) -> evaluator.EvalSetup:
        """What :func:`~diffalign.training.evaluator.evaluate` reads from this run."""
        cfg = self.cfg
        return evaluator.EvalSetup(
            adapter=self.adapter, eval=cfg.eval, shapes=cfg.prompts.source == "shapes",
            num_steps=cfg.sampling.eval_num_steps, guidance_scale=cfg.sampling.guidance_scale,
            resolution=self.resolution, eval_prompts=self.eval_prompts, probe_prompts=self.probe_prompts,
            score=self.score, eval_weights=self.eval_weights, autocast=self.autocast, run_dir=self.run_dir,
            accelerator=self.accelerator, sharded=self.sharded or self.layout.degree > 1, progress_bar=cfg.log.progress_bar,
            log_image=self.tracking.log_image, load_base=self.load_base, autocast_dtype=self.autocast_dtype,
            base_model=cfg.model.id)

    def load_base(self) -> ModelAdapter:
        """A fresh copy of the base model (``model.*``) on this run's device, as setup loads it."""
        cfg = self.cfg
        adapter = load_adapter(cfg.model.id, family=cfg.model.family, device=self.device, dtype=DTYPES[cfg.model.dtype],
                               **cfg.model.options)
        text_encoders.use_placement(adapter, cfg.model.text_encoders, cache=self.prompt_cache)
        return adapter

    def evaluate(self, iteration: int, *, save_grid: bool = True, probe: bool = False, best_scale: bool = False) -> dict:
        """See :func:`diffalign.training.evaluator.evaluate`."""
        return evaluator.evaluate(self.eval_setup(), iteration, save_grid=save_grid, probe=probe, best_scale=best_scale)

    def extra_state(self) -> dict:
        """Algorithm-specific state to checkpoint (override, with :meth:`load_extra_state`)."""
        return {}

    def load_extra_state(self, state: dict) -> None: ...

    def write_metrics(self, record: dict) -> None:
        """Append ``record`` to metrics.jsonl and send it to the trackers (main process)."""
        if self.accelerator.is_main_process and record:
            self.metrics.write(record)
            self.tracking.log_record(record)

    def save_checkpoint(self, next_iteration: int) -> None:
        checkpoints.save_checkpoint(self, next_iteration)
        self._saved_iteration = next_iteration

    def save_final(self, iteration: int) -> Path:
        return checkpoints.save_final(self, iteration)

    # ---- main loop --------------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        raise NotImplementedError

    def after_training(self) -> None:
        """Called once after the final evaluation, export and report, while the trackers are
        still open (a recipe adds its own pictures to the report here)."""

    def print_header(self) -> None:
        """What a run prints when it starts (:func:`~diffalign.training.metrics.header_lines`; recipes add lines)."""
        for line in metrics.header_lines(self):
            self.log(line)

    def train(self) -> dict:
        """Run to ``max_iterations``; returns the last eval record (or {}). A resumed run that had
        already finished (:func:`diffalign.runs.finished_iterations`) is left as it is: one line says
        so and how to extend it, and {} is returned. A launched run ends its process group on every
        process before it returns, and when every process stops together (``agreed``: a reward
        failure, non-finite losses, a signal); after an error on one process alone the others may
        still wait in a collective, and the group is left as it is."""
        try:
            self.setup()
        except _Finished:  # resumed after it finished: final/ and the report stay as they are
            self.log(f"run {str(self.run_dir)!r} is finished: {self.finished} iterations trained (max_iterations="
                     f"{self.cfg.max_iterations}), final/ and its evaluation written; nothing was changed. To train "
                     f"it further: diffalign resume {self.run_dir} max_iterations={2 * self.finished}")
            return {}
        self.print_header()
        self.stop_signals = StopSignals(self._log)
        try:
            with self.stop_signals.installed():
                last_eval = self._train_loop()
        except (DiffalignError, Interrupted) as exc:
            if exc.agreed:
                distributed.end_process_group()
            raise
        distributed.end_process_group()
        return last_eval

    def apply_lr_schedule(self, iteration: int) -> float | None:
        """Set this iteration's learning rate from ``optim.lr_schedule`` / ``warmup_iterations``;
        returns it, or None when the rate is constant (the optimizer is left untouched)."""
        opt = self.cfg.optim
        if opt.lr_schedule == "constant" and opt.warmup_iterations == 0 and (self.guard is None or self.guard.lr_drops == 0):
            return None
        return self.backend.set_lr_factor(self.lr_factor_at(iteration))

    def lr_factor_at(self, iteration: int) -> float:
        """The multiplier of ``optim.lr`` at ``iteration``: the schedule's, times the reward-hacking
        guard's (``train.guard.lr_factor`` per drop)."""
        opt = self.cfg.optim
        factor = lr_factor(iteration, self.cfg.max_iterations, opt.lr_schedule, opt.warmup_iterations, opt.min_lr_fraction)
        return factor * (self.guard.lr_scale if self.guard is not None else 1.0)

    def _train_loop(self) -> dict:
        cfg = self.cfg
        last_eval: dict = {}
        try:
            if self._saved_iteration is None and self.start_iteration == 0 and cfg.eval.at_start:  # not after a checkpoint at 0
                last_eval = self.evaluate(0, probe=True)
                self.write_metrics(last_eval)
                self.log("  eval before training: " + metrics.format_eval(last_eval))
            signum = self.stop_signals.requested(self.accelerator, self.device)
            if signum is not None:  # nothing trained yet: no checkpoint, a resume starts over
                raise Interrupted(signum, self.start_iteration, str(self.run_dir), checkpoint=self._saved_iteration is not None)
            bar = progress.bar(total=cfg.max_iterations, desc="iterations", leave=True,
                               disable=not (cfg.log.progress_bar and self.accelerator.is_main_process))
            bar.update(self.start_iteration)
            for it in range(self.start_iteration, cfg.max_iterations):
                t0 = time.perf_counter()
                lr = self.apply_lr_schedule(it)
                record = self.guarded_iteration(it)
                record = {"iteration": it, **record, "seconds": time.perf_counter() - t0}
                if lr is not None:
                    record["lr"] = lr
                record.update(self.guard_step(it, record))
                record.update(self.stats)
                self.write_metrics(record)
                bar.set_postfix(reward=f"{record.get('reward_mean', float('nan')):.3f}", loss=f"{record.get('loss', float('nan')):.4f}",
                                refresh=False)
                bar.update(1)
                if not (progress.interactive() or progress.is_quiet()) and cfg.log.progress_bar:
                    self.log(f"  iteration {it + 1}/{cfg.max_iterations}: reward {record.get('reward_mean', float('nan')):.3f}, "
                             f"{record['seconds']:.1f} s")
                done = it + 1
                if self._guard_stop is not None:  # train.guard.action=stop: a checkpoint, then GuardStop
                    bar.close()
                    self.stop_if_guarded(done)
                if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.max_iterations:
                    last_eval = self.evaluate(done)
                    self.write_metrics(last_eval)
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0:
                    self.save_checkpoint(done)
                signum = self.stop_signals.requested(self.accelerator, self.device)
                if signum is not None:
                    bar.close()
                    if self._saved_iteration != done:
                        self.save_checkpoint(done)
                    raise Interrupted(signum, done, str(self.run_dir))
            bar.close()
            final_iteration = max(cfg.max_iterations, self.start_iteration)
            if self._saved_iteration != final_iteration:  # decided in memory: every process takes the same branch
                self.save_checkpoint(final_iteration)
            last_eval = self.evaluate(final_iteration, probe=True, best_scale=cfg.eval.best_scale)
            self.write_metrics(last_eval)
            self.log("  eval after training: " + metrics.format_eval(last_eval))
            if self.accelerator.is_main_process and cfg.log.progress_bar:
                progress.phase("  writing final/" + (" and report.md" if cfg.log.report else "") + " ...")
            self.save_final(final_iteration)
            if cfg.log.report and self.accelerator.is_main_process:
                write_report(self.run_dir)
            self.after_training()
        finally:
            if self.reward_pool is not None:
                self.reward_pool.shutdown()
            if getattr(self, "tracking", None) is not None:
                self.tracking.finish()
        return last_eval
