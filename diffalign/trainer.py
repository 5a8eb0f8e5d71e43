"""The trainer: everything an algorithm needs that is not the algorithm.

:class:`Trainer` owns devices, precision and processes (accelerate), seeding, the model adapter,
LoRA or full fine-tuning, the optimiser, EMA weights, prompts, rewards, evaluation, metrics,
checkpoints, resume and the final export. An algorithm subclasses it and implements
:meth:`Trainer.iteration` (rollout -> rewards -> advantages -> update) using pure functions from
:mod:`diffalign.algorithms` and samplers from :mod:`diffalign.sampling`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch

import reward_models
from diffalign import distributed, runs
from diffalign.adapters import load_adapter
from diffalign.adapters.base import ModelAdapter
from diffalign.config import RunConfig, dump_config, to_dict
from diffalign.errors import ConfigError, DiffalignError, NonFiniteError, RewardError
from diffalign.sampling import build_kernel, sample_images

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SelfCheckError(DiffalignError):
    """The on-policy ratio before any update was not 1: sampler and training forward disagree."""


# --------------------------------------------------------------------------------------------
# Small stateful helpers (all with state_dict / load_state_dict for exact resume)
# --------------------------------------------------------------------------------------------


class PromptSampler:
    """Cycles through the prompts in a fresh random order every epoch; deterministic per seed."""

    def __init__(self, prompts: Sequence[str], seed: int):
        if not prompts:
            raise ConfigError("config key 'prompts' yields no training prompts")
        self.prompts = list(prompts)
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(len(self.prompts))
        self.pos = 0
        self.epoch = 0

    def next(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if self.pos == len(self.order):
                self.order = self.rng.permutation(len(self.prompts))
                self.pos = 0
                self.epoch += 1
            out.append(self.prompts[self.order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "order": self.order.tolist(), "pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = np.asarray(state["order"])
        self.pos = state["pos"]
        self.epoch = state["epoch"]


class EMA:
    """Exponential moving average of the trainable parameters, for evaluation and export.

    Flow-GRPO applies ``ema = decay * ema + (1 - decay) * theta`` every ``every`` optimizer steps
    (decay 0.9, every 8), i.e. a short memory that smooths the last few updates.
    """

    def __init__(self, params: list[torch.nn.Parameter], decay: float, every: int):
        self.params = params
        self.decay = decay
        self.every = every
        self.shadow = [p.detach().clone().float() for p in params]
        self.steps = 0

    @torch.no_grad()
    def update(self) -> None:
        self.steps += 1
        if self.steps % self.every:
            return
        for s, p in zip(self.shadow, self.params):
            s.mul_(self.decay).add_(p.detach().float(), alpha=1 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Temporarily load the EMA weights into the model."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for b, p in zip(backup, self.params):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"shadow": [s.clone() for s in self.shadow], "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        for s, v in zip(self.shadow, state["shadow"]):
            s.copy_(v)
        self.steps = state["steps"]


def _allow_precision(mixed_precision: str) -> None:
    """accelerate keeps one precision per process. A single, unlaunched process may run trainers of
    different precisions in turn (benchmarks, tests): forget the earlier one's. A launched
    multi-process run keeps accelerate's check."""
    from accelerate.state import AcceleratorState, PartialState

    if not AcceleratorState._shared_state or AcceleratorState._shared_state.get("_mixed_precision") in (None, mixed_precision):
        return
    if PartialState().num_processes == 1:
        AcceleratorState._reset_state()


def resolve_prompts(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(train prompts, eval prompts) from ``cfg.prompts``."""
    p = cfg.prompts
    if p.source == "shapes":
        from diffalign.shapes import prompt_family, split_prompts, validation_split

        split = split_prompts()
        train, heldout = validation_split(split) if p.evaluate_on == "validation" else (split.train, split.evaluation())
        if p.families:
            unknown = sorted(set(p.families) - {prompt_family(x) for x in train + heldout})
            if unknown:
                raise ConfigError(f"config key 'prompts.families' has unknown families: {', '.join(unknown)}")
            train = [x for x in train if prompt_family(x) in p.families]
            heldout = [x for x in heldout if prompt_family(x) in p.families]
        if p.balance_families:
            # Repeat each family's prompts up to the largest family's count, so that an epoch of the
            # prompt sampler visits every family about equally often.
            by_family: dict[str, list[str]] = {}
            for x in train:
                by_family.setdefault(prompt_family(x), []).append(x)
            largest = max(len(v) for v in by_family.values())
            train = [v[i % len(v)] for v in by_family.values() for i in range(largest)]
        return train, heldout
    if p.source == "list":
        return list(p.train), list(p.eval or p.train)

    def read(path: str, key: str) -> list[str]:
        f = Path(path)
        if not f.is_file():
            raise ConfigError(f"config key '{key}': prompt file {path!r} does not exist")
        lines = [line.strip() for line in f.read_text().splitlines() if line.strip()]
        if not lines:
            raise ConfigError(f"config key '{key}': prompt file {path!r} is empty")
        return lines

    train = read(p.file, "prompts.file")
    return train, read(p.eval_file, "prompts.eval_file") if p.eval_file else train


def resolve_probe_prompts(cfg: RunConfig) -> list[str]:
    """The generalisation probe's prompts (``split_prompts().probe``, restricted to
    ``prompts.families`` when set) for ``prompts.source: shapes`` with ``eval.probe``; else [] (also
    when tuning on validation prompts: the probe informs no choice)."""
    if cfg.prompts.source != "shapes" or not cfg.eval.probe or cfg.prompts.evaluate_on == "validation":
        return []
    from diffalign.shapes import prompt_family, split_prompts

    probe = split_prompts().probe
    return [x for x in probe if prompt_family(x) in cfg.prompts.families] if cfg.prompts.families else list(probe)


def eval_records_path(run_dir: Path, iteration: int) -> Path:
    """Where the trainer keeps one evaluation's per-image records (``eval_records/iter-N.json``)."""
    return Path(run_dir) / "eval_records" / f"iter-{iteration:06d}.json"


def image_grid(images: torch.Tensor, nrow: int) -> np.ndarray:
    """(N, 3, H, W) in [0, 1] -> uint8 (rows*H + pad, nrow*W + pad, 3) grid with 1px gaps."""
    n, _, h, w = images.shape
    rows = math.ceil(n / nrow)
    grid = np.ones((rows * (h + 1) + 1, nrow * (w + 1) + 1, 3), dtype=np.uint8) * 255
    arr = (images.clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    for i in range(n):
        r, c = divmod(i, nrow)
        grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) : 1 + c * (w + 1) + w] = arr[i]
    return grid


def save_png(array: np.ndarray, path: Path, scale: int = 1) -> None:
    from PIL import Image

    img = Image.fromarray(array)
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------


def reward_info(results: Sequence[tuple[torch.Tensor, dict]]) -> dict[str, float]:
    """Mean over batches of the reward's per-batch info (e.g. ShapesEval's per-family accuracy),
    keys prefixed ``reward/``. ``results`` are (rewards, info) pairs as the reward returns them."""
    info: dict[str, list[float]] = {}
    for _, batch_info in results:
        for k, v in batch_info.items():
            info.setdefault(k, []).append(float(v))
    return {(k if k.startswith("reward/") else f"reward/{k}"): float(np.mean(v)) for k, v in info.items()}


def make_optimizer(params: list, opt) -> torch.optim.Optimizer:
    """The optimizer of ``optim.name`` over ``params``: torch AdamW (bitsandbytes AdamW8bit with
    ``optim.use_8bit_adam``) or plain SGD, whose step is linear in the gradients."""
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if opt.use_8bit_adam:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("config key 'optim.use_8bit_adam' needs bitsandbytes (pip install 'diffalign[gpu]')") from None
        optim_cls = bnb.optim.AdamW8bit
    else:
        optim_cls = torch.optim.AdamW
    return optim_cls(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)


class Trainer:
    """Base trainer; subclasses implement :meth:`iteration`. See the module docstring."""

    #: algorithms whose reference model is needed (KL) set this from their config
    needs_reference: bool = False

    #: the update loop keeps every process's forwards in lockstep (``lockstep_counts``): FSDP may shard it
    supports_fsdp = False

    def __init__(self, cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.resume = resume
        self.overwrite = overwrite
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.stats: dict = {"nonfinite_rewards": 0, "nonfinite_losses": 0, "skipped_steps": 0}
        self.start_iteration = 0
        self._consecutive_bad_steps = 0
        self._pool: Optional[ThreadPoolExecutor] = None
        self.self_check_log_ratio: Optional[float] = None  # max |log ratio| of the on-policy self-check
        self._ds_engine = None  # DeepSpeed ZeRO engine (train.zero_stage)
        self._saved_iteration: Optional[int] = None  # the iteration of the last checkpoint written
        self._fsdp_units: Optional[list] = None  # FSDP units (train.fsdp)

    # ---- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        # Validate everything that needs no model before touching the run directory.
        self.train_prompts, self.eval_prompts = resolve_prompts(cfg)
        self.probe_prompts = resolve_probe_prompts(cfg)
        self.reward_fn = reward_models.build(cfg.reward.name, device="cpu", **cfg.reward.kwargs)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.mixed_precision = cfg.train.resolved_mixed_precision(device)
        _allow_precision(self.mixed_precision)
        self.accelerator = Accelerator(mixed_precision=self.mixed_precision, cpu=device.type == "cpu")
        runs.check_run_dir(self.run_dir, resume=self.resume, overwrite=self.overwrite)  # every process: same verdict
        self.device = self.accelerator.device
        set_seed(cfg.seed)  # same on every process: identical initial (LoRA) weights
        self.adapter: ModelAdapter = load_adapter(cfg.model.id, family=cfg.model.family, device=self.device, dtype=DTYPES[cfg.model.dtype])
        self.resolution = cfg.model.resolution or self.adapter.default_resolution
        if self.device.type != "cpu" and cfg.reward.name:
            # rebuild on the accelerator when it has one (rewards take a device argument)
            self.reward_fn = reward_models.build(cfg.reward.name, device=str(self.device), **cfg.reward.kwargs)
        self._setup_trainable()
        self.kernel = build_kernel(
            self.adapter, cfg.sampling.kernel, cfg.sampling.noise_level,
            std_schedule=cfg.sampling.std_schedule, reduction=getattr(cfg.algorithm, "logprob_reduction", "mean"),
        )
        # Everything is validated and loaded: now the run directory may change.
        if self.accelerator.is_main_process:
            runs.prepare_run_dir(self.run_dir, resume=self.resume, overwrite=self.overwrite)
        self.accelerator.wait_for_everyone()
        # One stream shared by all processes (prompts, noise, shuffles are drawn globally, then sliced).
        self.generator = torch.Generator("cpu").manual_seed(cfg.seed * 1000 + 17)
        self.prompt_sampler = PromptSampler(self.train_prompts, cfg.seed)
        self.metrics = runs.MetricsLog(self.run_dir / "metrics.jsonl")
        if self.resume:
            self._load_latest()
        elif self.accelerator.is_main_process:
            runs.atomic_write_text(self.run_dir / "config.yaml", dump_config(cfg))

    def _setup_trainable(self) -> None:
        cfg = self.cfg
        denoiser = self.adapter.denoiser
        self.ref_denoiser = None
        if cfg.lora.enabled:
            from peft import LoraConfig

            targets = cfg.lora.targets or list(self.adapter.default_lora_targets)
            init = {"gaussian": "gaussian", "default": True, "zeros_b": True}[cfg.lora.init]
            lora = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                              init_lora_weights=init, target_modules=targets)
            try:
                denoiser.add_adapter(lora)
            except ValueError as exc:
                raise ConfigError(f"config key 'lora.targets' {targets} does not fit the denoiser: {str(exc).splitlines()[0]}") from None
        else:
            denoiser.requires_grad_(True)
            if self.needs_reference:
                self.ref_denoiser = copy.deepcopy(denoiser).requires_grad_(False).eval()
        from peft.tuners.tuners_utils import BaseTunerLayer

        self._lora_layers = [m for m in denoiser.modules() if isinstance(m, BaseTunerLayer)]
        if cfg.train.gradient_checkpointing and hasattr(denoiser, "enable_gradient_checkpointing"):
            denoiser.enable_gradient_checkpointing()
        if cfg.train.channels_last:
            denoiser.to(memory_format=torch.channels_last)
        self.adapter.detach_uncond = cfg.train.detach_uncond
        for p in denoiser.parameters():  # trainable weights in fp32 whatever the model dtype (mixed precision)
            if p.requires_grad:
                p.data = p.data.float()
        self._fsdp_units = None
        fsdp = distributed.fsdp_requested(cfg)
        if fsdp and not self.supports_fsdp:
            raise ConfigError(f"config key 'train.fsdp': algorithm {cfg.algorithm.name!r} does not support FSDP yet "
                              "(flow_grpo and stepwise_flow_grpo do); use train.zero_stage=2")
        if fsdp and self.accelerator.num_processes > 1:  # one process: nothing to shard
            self._fsdp_units = distributed.shard_denoiser(denoiser, self.device, self.accelerator.num_processes)
            self.log(f"FSDP: {len(self._fsdp_units)} units over {self.accelerator.num_processes} processes")
        self.trainable_names = [n for n, p in denoiser.named_parameters() if p.requires_grad]
        self.trainable = [p for p in denoiser.parameters() if p.requires_grad]
        if not self.trainable:
            raise ConfigError("config key 'lora' leaves no trainable parameters")
        self.optimizer = make_optimizer(self.trainable, cfg.optim)
        self._ds_engine = None
        stage = distributed.zero_stage(cfg, self.accelerator)
        if stage:
            # The rollouts call the raw denoiser (ZeRO-1/2 keep full weights on every process); the
            # engine owns the gradient reduction, clipping and the sharded optimizer step.
            self._ds_engine, self.optimizer = distributed.initialize(denoiser, self.optimizer, cfg, stage, self.accelerator.num_processes)
            self.log(f"DeepSpeed ZeRO-{stage} over {self.accelerator.num_processes} processes")
        elif self._fsdp_units is None:  # under FSDP the plain optimizer steps the sharded parameters
            self.optimizer = self.accelerator.prepare(self.optimizer)
        if cfg.train.attention == "xformers":
            distributed.enable_xformers(self.adapter)
        self.ema = EMA(self.trainable, cfg.train.ema.decay, cfg.train.ema.every) if cfg.train.ema.enabled else None

    @contextlib.contextmanager
    def reference_model(self) -> Iterator[None]:
        """The frozen reference: the same network with the LoRA adapter disabled (no second copy),
        or for full fine-tuning a frozen copy taken at the start."""
        denoiser = self.adapter.denoiser
        if self.cfg.lora.enabled:
            # Toggle the peft layers found once at setup: diffusers' disable_adapters() walks every
            # module and checks versions on each call (15 ms per forward on an SD3.5-sized model).
            for layer in self._lora_layers:
                layer.enable_adapters(False)
            try:
                yield
            finally:
                for layer in self._lora_layers:
                    layer.enable_adapters(True)
            return
        if self.ref_denoiser is None:
            raise RuntimeError("no reference model: set needs_reference before setup()")
        attr = next(name for name, module in self.adapter.pipeline.components.items() if module is denoiser)
        setattr(self.adapter.pipeline, attr, self.ref_denoiser)
        try:
            yield
        finally:
            setattr(self.adapter.pipeline, attr, denoiser)

    # ---- helpers for algorithms -------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            self._log(message)

    def autocast(self):
        """The forwards' autocast (rollouts and updates alike). Decided by this trainer's precision,
        not by accelerate's process-wide state (DeepSpeed's ZeRO path keeps fp32 master weights and
        autocasts the same way)."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> tuple[torch.Tensor, dict]:
        """Call the reward, validate the output (shape) and return (rewards (B,), info)."""
        metadata = metadata if metadata is not None else [{} for _ in prompts]
        value = self.reward_fn(images, prompts, metadata)
        rewards = reward_models.check_reward_output(self.cfg.reward.name, value, len(prompts))
        info = dict(getattr(self.reward_fn, "last_info", None) or {})
        return rewards, info

    def score_async(self, images: torch.Tensor, prompts: list[str]):
        """Submit scoring to a worker thread (overlaps the next batch's sampling)."""
        if not self.cfg.rollout.overlap_rewards:
            done = self.score(images, prompts)
            return _Done(done)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        return self._pool.submit(self.score, images.cpu(), prompts)

    def check_rewards(self, rewards: torch.Tensor, iteration: int) -> torch.Tensor:
        """Count non-finite rewards; stop (``reward.nonfinite=error``) or leave them for masking."""
        bad = int((~torch.isfinite(rewards)).sum())
        if bad:
            self.stats["nonfinite_rewards"] += bad
            if self.cfg.reward.nonfinite == "error":
                raise RewardError(
                    f"reward {self.cfg.reward.name!r} returned {bad} non-finite values (NaN/inf) of {len(rewards)} at iteration {iteration}"
                    " (set reward.nonfinite=skip to drop such samples)"
                )
        return rewards

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate one micro-batch's gradients (``loss`` is already normalised by the global
        number of terms of the optimizer step, so gradients are summed over micro-batches and processes)."""
        if self._ds_engine is not None:
            distributed.backward(self._ds_engine, loss, self.accelerator.num_processes)
        else:
            self.accelerator.backward(loss)

    def discard_gradients(self) -> None:
        """Drop the accumulated gradients without a step (a non-finite loss poisoned them)."""
        if self._ds_engine is not None:
            distributed.discard(self._ds_engine, self.trainable)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    @property
    def sharded(self) -> bool:
        """FSDP: every process must run the same forwards (evaluation included)."""
        return self._fsdp_units is not None

    def lockstep_counts(self, counts: list[int]) -> list[int]:
        """How many micro-batches every process must run per optimizer step: the global maximum of
        ``counts`` under FSDP (processes with fewer run zero-loss forwards), else ``counts``."""
        if not self.sharded:
            return list(counts)
        import torch.distributed as dist

        t = torch.tensor(counts, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def idle_forward(self, x: torch.Tensor, t: torch.Tensor, embeds, guidance_scale: float, *, reference: bool) -> None:
        """A zero-loss training forward and backward (plus the reference forward when the loss has a
        KL term): under FSDP a process with fewer micro-batches joins the others' collectives."""
        with self.autocast():
            out = self.adapter.predict(x, t, embeds, guidance_scale)
        if reference:
            with torch.no_grad(), self.reference_model(), self.autocast():
                self.adapter.predict(x, t, embeds, guidance_scale)
        self.backward(out.float().sum() * 0.0)

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip, check and apply the accumulated gradients. Returns (grad_norm, applied)."""
        params = self.trainable
        if self._ds_engine is not None:  # the engine reduces, clips, checks and steps
            norm, applied = distributed.step(self._ds_engine, params)
            if not applied:
                return self._bad_step(norm)
        else:
            if self._fsdp_units is not None:  # gradients already reduce-scattered (summed) by FSDP
                norm = distributed.fsdp_grad_norm_clip(params, self.cfg.optim.grad_clip)
            else:
                if self.accelerator.num_processes > 1:
                    # Losses are normalised by global term counts, so the global gradient is the sum.
                    import torch.distributed as dist

                    for p in params:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                if self.cfg.optim.grad_clip > 0:
                    norm = float(self.accelerator.clip_grad_norm_(params, self.cfg.optim.grad_clip))
                else:
                    norm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None)))
            if not math.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
                return self._bad_step(norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._consecutive_bad_steps = 0
        if self.ema is not None:
            self.ema.update()
        return norm, True

    def _bad_step(self, norm: float, what: str = "gradients") -> tuple[float, bool]:
        self.stats["skipped_steps"] += 1
        self._consecutive_bad_steps += 1
        if self._consecutive_bad_steps > self.cfg.train.max_nonfinite_losses:
            raise NonFiniteError(
                f"{self._consecutive_bad_steps} consecutive optimizer steps had non-finite {what}; stopping"
                " (lower optim.lr or check the reward)"
            )
        return norm, False

    def accumulate(self, loss: torch.Tensor) -> bool:
        """Backward one micro-batch's loss and return True; a non-finite loss is counted
        (``stats["nonfinite_losses"]``), its gradients never reach the parameters, and False
        marks the optimizer step as poisoned for :meth:`close_step`. Under FSDP a zero backward
        still runs so that every process takes part in the same collectives."""
        if torch.isfinite(loss):
            self.backward(loss)
            return True
        self.stats["nonfinite_losses"] += 1
        if self.sharded:
            self.backward(torch.nan_to_num(loss) * 0.0)
        return False

    def close_step(self, poisoned: bool) -> tuple[float, bool]:
        """End one optimizer step's accumulation. Every process learns whether any of them saw a
        non-finite loss; if so the accumulated gradients are dropped and the step is counted in
        ``stats["skipped_steps"]`` (``NonFiniteError`` after ``train.max_nonfinite_losses`` in a
        row), else :meth:`optimizer_step` runs. Returns (grad_norm, applied); grad_norm is NaN
        for a dropped step."""
        if self.accelerator.num_processes > 1:  # every process must skip together
            flag = torch.tensor(float(poisoned), device=self.device)
            poisoned = bool(self.accelerator.reduce(flag, reduction="sum") > 0)
        if poisoned:
            self.discard_gradients()
            return self._bad_step(float("nan"), "losses")
        return self.optimizer_step()

    def mean_stats(self, stats: dict[str, list[float]]) -> dict[str, float]:
        """Per-key means of an update's micro-batch statistics over every process (NaN for a key
        that no process recorded), so that a multi-process run logs what one process would.
        A collective: every process calls it with the same keys in the same order."""
        keys = list(stats)
        sums = torch.tensor([float(np.sum(stats[k])) for k in keys], dtype=torch.float64)
        counts = torch.tensor([float(len(stats[k])) for k in keys], dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            both = self.accelerator.reduce(torch.cat([sums, counts]).to(self.device), reduction="sum").cpu()
            sums, counts = both[: len(keys)], both[len(keys) :]
        return {k: float(v / n) if n > 0 else float("nan") for k, v, n in zip(keys, sums.tolist(), counts.tolist())}

    def gather_info(self, info: dict[str, float]) -> dict[str, float]:
        """Per-key mean over processes of a process-local info dict (a key that some processes lack,
        say a prompt family that only one of them sampled, is averaged over those that have it).
        A collective: every process calls it."""
        if self.accelerator.num_processes == 1:
            return dict(info)
        from accelerate.utils import gather_object

        merged: dict[str, list[float]] = {}
        for part in gather_object([dict(info)]):
            for k, v in part.items():
                merged.setdefault(k, []).append(float(v))
        return {k: float(np.mean(v)) for k, v in merged.items()}

    def check_log_ratio(self, new_logp: torch.Tensor, old_logp: torch.Tensor, where: str, sampler: str = "sampler") -> None:
        """The on-policy self-check: before the first update the training forward *is* the
        sampling policy, so every log-ratio must be 0 to ``train.self_check_tolerance``."""
        if not self.cfg.train.self_check or new_logp.numel() == 0:
            return
        worst = float((new_logp.float() - old_logp.float()).abs().max())
        self.self_check_log_ratio = worst
        if not math.isfinite(worst) or worst > self.cfg.train.self_check_tolerance:
            raise SelfCheckError(
                f"on-policy self-check failed: |log ratio| = {worst:.3g} before any update (tolerance "
                f"{self.cfg.train.self_check_tolerance:g}) {where}; the training forward does not reproduce the {sampler} "
                "(check the adapter's predict, CFG batching and dtype), or raise train.self_check_tolerance"
            )

    def eval_weights(self):
        """Context: EMA weights when enabled and configured, else the current weights."""
        if self.ema is not None and self.cfg.eval.use_ema:
            return self.ema.swapped_in()
        return contextlib.nullcontext()

    # ---- evaluation -------------------------------------------------------------------------
    def evaluate(self, iteration: int, *, save_grid: bool = True, probe: bool = False) -> dict:
        """Sample the eval prompts with fixed seeds (ODE) and score them; main process only.
        ``probe``: also evaluate the generalisation probe (before and after training only)."""
        if self.sharded:  # sharded forwards: every process samples the same images
            record = self._evaluate(iteration, save_grid=save_grid, probe=probe)
            self.accelerator.wait_for_everyone()
            return record if self.accelerator.is_main_process else {}
        if not self.accelerator.is_main_process:
            self.accelerator.wait_for_everyone()
            return {}
        record = self._evaluate(iteration, save_grid=save_grid, probe=probe)
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()
        return record

    def eval_items(self, prompts: Sequence[str]) -> list[str]:
        """The list of images to sample for ``prompts`` (one entry per image). ShapesWorld prompts:
        ``eval.images_per_family`` per family (:func:`diffalign.shapes.evaluation_prompts`), cut to
        the first ``eval.num_prompts`` entries when set; other sources: the first
        ``eval.num_prompts`` prompts, each ``eval.samples_per_prompt`` times."""
        cfg = self.cfg.eval
        if self.cfg.prompts.source == "shapes":
            from diffalign.shapes import evaluation_prompts

            items = evaluation_prompts(prompts, cfg.images_per_family)
            return items[: cfg.num_prompts] if cfg.num_prompts else items
        prompts = list(prompts[: cfg.num_prompts]) if cfg.num_prompts else list(prompts)
        return [p for p in prompts for _ in range(cfg.samples_per_prompt)]

    def _sample_eval(self, items: Sequence[str]) -> torch.Tensor:
        cfg = self.cfg.eval
        self.adapter.denoiser.eval()
        with self.eval_weights():
            with self.autocast():
                return sample_images(self.adapter, list(items), num_steps=self.cfg.sampling.eval_num_steps,
                                     guidance_scale=self.cfg.sampling.guidance_scale, resolution=self.resolution,
                                     seed=cfg.seed, batch_size=cfg.batch_size)

    def _evaluate(self, iteration: int, *, save_grid: bool = True, probe: bool = False) -> dict:
        from diffalign.evaluation import Evaluation, interval_record, shapes_records

        cfg = self.cfg.eval
        prompts = self.eval_items(self.eval_prompts)
        t0 = time.perf_counter()
        images = self._sample_eval(prompts)
        rewards, info = self.score(images, prompts)
        record = {"iteration": iteration, "eval": True, "eval/reward_mean": float(rewards[torch.isfinite(rewards)].mean()),
                  "eval/num_images": len(prompts)}
        record.update({f"eval/{k}": v for k, v in info.items()})
        if self.cfg.prompts.source == "shapes":
            # Per-image ShapesEval records whatever the training reward: intervals, paired differences.
            meta = {"num_steps": self.cfg.sampling.eval_num_steps, "guidance_scale": self.cfg.sampling.guidance_scale,
                    "resolution": self.resolution, "seed": cfg.seed, "batch_size": cfg.batch_size,
                    "images_per_family": cfg.images_per_family, "num_prompts": cfg.num_prompts}
            heldout = Evaluation.from_records(shapes_records(images, prompts), meta={**meta, "num_images": len(prompts)})
            record.update(interval_record(heldout.intervals, "eval/"))
            saved = {"iteration": iteration, "heldout": heldout.to_json()}
            if probe and self.probe_prompts:
                items = self.eval_items(self.probe_prompts)
                probe_eval = Evaluation.from_records(shapes_records(self._sample_eval(items), items),
                                                     meta={**meta, "num_images": len(items)})
                record.update(interval_record(probe_eval.intervals, "eval/probe/"))
                record["eval/probe/num_images"] = len(items)
                saved["probe"] = probe_eval.to_json()
            if self.accelerator.is_main_process:
                path = eval_records_path(self.run_dir, iteration)
                path.parent.mkdir(parents=True, exist_ok=True)
                runs.atomic_write_text(path, json.dumps(saved))
        record["eval/seconds"] = time.perf_counter() - t0
        if save_grid and self.accelerator.is_main_process:
            n = min(len(images), 64)
            save_png(image_grid(images[:n], nrow=8), self.run_dir / "samples" / f"eval-iter-{iteration:06d}.png", scale=2)
            runs.atomic_write_text(self.run_dir / "samples" / "eval-prompts.txt", "".join(p + "\n" for p in prompts[:n]))
        return record

    # ---- state ------------------------------------------------------------------------------
    def optimizer_state(self) -> dict | None:
        """The optimizer's state; with ZeRO every process's partition, gathered on the main process
        (a collective: every process calls it). None on the other processes."""
        if self._ds_engine is not None:
            return distributed.gather_optimizer_state(self.optimizer, self.accelerator.is_main_process)
        if self.sharded:
            return distributed.to_full(self.optimizer.state_dict())
        return self.optimizer.state_dict()

    def state_dict(self, next_iteration: int, optimizer_state: dict | None = None) -> dict:
        return {
            "iteration": next_iteration,
            "trainable": {n: distributed.to_full(p) if self.sharded else p.detach().cpu().clone()
                          for n, p in zip(self.trainable_names, self.trainable)},
            "optimizer": optimizer_state if optimizer_state is not None else self.optimizer.state_dict(),
            "ema": (distributed.to_full(self.ema.state_dict()) if self.sharded else self.ema.state_dict()) if self.ema is not None else None,
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "generator": self.generator.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            "prompts": self.prompt_sampler.state_dict(),
            "stats": dict(self.stats),
            "extra": self.extra_state(),
            "config": to_dict(self.cfg),
        }

    def extra_state(self) -> dict:
        """Algorithm-specific state to checkpoint (override)."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    def _load_latest(self) -> None:
        ckpt = runs.latest_checkpoint(self.run_dir)
        if ckpt is None:
            raise runs.RunDirError(f"cannot resume {str(self.run_dir)!r}: it has no checkpoint yet")
        state = runs.load_checkpoint(ckpt)
        saved = state.get("config", {})
        current = to_dict(self.cfg)
        ignore = {"max_iterations", "output_dir", "log", "checkpoint", "eval"}
        changed = sorted(k for k in current if k not in ignore and saved.get(k) != current[k])
        if changed:
            self.log(f"warning: resuming with changed config sections: {', '.join(changed)}")
        names = dict(zip(self.trainable_names, self.trainable))
        missing = set(names) - set(state["trainable"])
        if missing:
            raise runs.RunDirError(f"checkpoint {str(ckpt)!r} does not match the model: {len(missing)} trainable tensors missing")
        with torch.no_grad():
            for n, p in names.items():
                p.copy_(distributed.shard_like(state["trainable"][n].to(p.dtype), p))
        if self._ds_engine is not None:
            distributed.load_optimizer_state(self.optimizer, state["optimizer"], str(ckpt))
        elif distributed.is_zero_state(state["optimizer"]):
            raise runs.RunDirError(f"checkpoint {str(ckpt)!r} holds ZeRO optimizer partitions: resume it with train.zero_stage "
                                   f"{state['optimizer']['zero_stage']}")
        elif self.sharded:
            self.optimizer.load_state_dict(distributed.shard_optimizer_state(state["optimizer"], self.optimizer))
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state["ema"] is not None:
            ema = state["ema"]
            if self.sharded:
                ema = {**ema, "shadow": [distributed.shard_like(v, s) for v, s in zip(ema["shadow"], self.ema.shadow)]}
            self.ema.load_state_dict(ema)
        rng = state["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        self.generator.set_state(rng["generator"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.prompt_sampler.load_state_dict(state["prompts"])
        self.stats.update(state["stats"])
        self.load_extra_state(state.get("extra") or {})
        self.start_iteration = state["iteration"]
        self._saved_iteration = self.start_iteration
        if self.accelerator.is_main_process:
            self.metrics.truncate_from(self.start_iteration)
            runs.atomic_write_text(self.run_dir / "config.yaml", dump_config(self.cfg))
        self.log(f"resumed from {ckpt} at iteration {self.start_iteration}")

    def write_metrics(self, record: dict) -> None:
        if self.accelerator.is_main_process and record:
            self.metrics.write(record)

    def save_checkpoint(self, next_iteration: int) -> None:
        optimizer_state = self.optimizer_state()  # every process (ZeRO / FSDP gather their shards)
        if self.sharded or self.accelerator.is_main_process:  # under FSDP gathering the tensors is a collective
            state = self.state_dict(next_iteration, optimizer_state)
        if self.accelerator.is_main_process:
            runs.save_checkpoint(self.run_dir, next_iteration, state, self.cfg.checkpoint.keep_last)
        self._saved_iteration = next_iteration

    # ---- final export -----------------------------------------------------------------------
    def save_final(self, iteration: int) -> Path:
        """``final/``: LoRA weights (``pipeline.load_lora_weights(final/)``) or the full pipeline
        (``DiffusionPipeline.from_pretrained(final/)``), the EMA weights when eval uses them."""
        final = self.run_dir / "final"
        if self.sharded:  # every process gathers the full weights; the main one writes them
            with self.eval_weights(), distributed.full_parameters(self.adapter.denoiser, swap=self.accelerator.is_main_process):
                if self.accelerator.is_main_process:
                    self._save_weights(final, iteration)
            self.accelerator.wait_for_everyone()
            return final
        if self.accelerator.is_main_process:
            with self.eval_weights():
                self._save_weights(final, iteration)
        return final

    def _save_weights(self, final: Path, iteration: int) -> None:
        from diffalign.export import save_trained_weights

        save_trained_weights(self.adapter, final, lora=self.cfg.lora.enabled, metadata={
            "base_model": self.cfg.model.id, "family": self.adapter.family,
            "algorithm": self.cfg.algorithm.name, "reward": self.cfg.reward.name,
            "iterations": iteration, "ema": self.ema is not None and self.cfg.eval.use_ema,
            "lora": to_dict(self.cfg.lora) if self.cfg.lora.enabled else None,
        })

    # ---- main loop --------------------------------------------------------------------------
    def iteration(self, iteration: int) -> dict:
        raise NotImplementedError

    def print_header(self) -> None:
        d = self.cfg.derived(self.accelerator.num_processes)
        n_train = sum(p.numel() for p in self.trainable)
        self.log(f"diffalign: {self.cfg.algorithm.name} on {self.cfg.model.id} ({self.adapter.family}, {self.resolution}px) "
                 f"-> {self.run_dir}")
        self.log("  " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in d.items())
                 + f", trainable params {n_train:,}, processes {self.accelerator.num_processes}, device {self.device}")

    def train(self) -> dict:
        """Run to ``max_iterations``; returns the last eval record (or {})."""
        from tqdm.auto import tqdm

        self.setup()
        self.print_header()
        cfg = self.cfg
        if cfg.prompts.source == "shapes" and cfg.eval.samples_per_prompt != 1:
            self.log(f"  note: eval.samples_per_prompt={cfg.eval.samples_per_prompt} does not apply to ShapesWorld prompts; "
                     f"the evaluation samples eval.images_per_family={cfg.eval.images_per_family} images per family")
        last_eval: dict = {}
        try:
            if self.start_iteration == 0 and cfg.eval.at_start:
                last_eval = self.evaluate(0, probe=True)
                self.write_metrics(last_eval)
                self.log("  eval before training: " + _fmt_eval(last_eval))
            bar = tqdm(range(self.start_iteration, cfg.max_iterations), initial=self.start_iteration, total=cfg.max_iterations,
                       desc="iterations", disable=not (cfg.log.progress_bar and self.accelerator.is_main_process), file=sys.stderr)
            for it in bar:
                t0 = time.perf_counter()
                record = self.iteration(it)
                record = {"iteration": it, **record, "seconds": time.perf_counter() - t0, **{k: v for k, v in self.stats.items()}}
                self.write_metrics(record)
                bar.set_postfix(reward=f"{record.get('reward_mean', float('nan')):.3f}", loss=f"{record.get('loss', float('nan')):.4f}")
                done = it + 1
                if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.max_iterations:
                    last_eval = self.evaluate(done)
                    self.write_metrics(last_eval)
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0:
                    self.save_checkpoint(done)
            bar.close()
            final_iteration = max(cfg.max_iterations, self.start_iteration)
            if self._saved_iteration != final_iteration:  # decided in memory: every process takes the same branch
                self.save_checkpoint(final_iteration)
            last_eval = self.evaluate(final_iteration, probe=True)
            self.write_metrics(last_eval)
            self.log("  eval after training: " + _fmt_eval(last_eval))
            self.save_final(final_iteration)
            if cfg.log.report and self.accelerator.is_main_process:
                from diffalign.report import write_report

                write_report(self.run_dir)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        return last_eval


class _Done:
    """A finished 'future' (used when reward overlap is off)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _fmt_eval(record: dict) -> str:
    """``reward_mean 0.412, acc/overall 0.198 [0.158, 0.243], ...`` (probe metrics last)."""
    from diffalign.evaluation import is_bound_key

    skip = ("eval/seconds", "eval/num_images", "eval/probe/num_images")
    keys = [k for k in record if k.startswith("eval/") and k not in skip and not is_bound_key(k)
            and isinstance(record[k], (int, float))]
    keys.sort(key=lambda k: k.startswith("eval/probe/"))
    parts = []
    for k in keys:
        lo, hi = record.get(f"{k}_lo"), record.get(f"{k}_hi")
        parts.append(f"{k[5:]} {record[k]:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else ""))
    return ", ".join(parts)
