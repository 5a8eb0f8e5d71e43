"""Typed run configuration: dataclasses, loaded from YAML with ``dotted.key=value`` overrides.

One config per run. Every field has a comment. Loading (:mod:`diffalign.config_files`) validates
types and values and raises :class:`~diffalign.errors.ConfigError` with a message naming the
offending key. The
``algorithm`` section is typed by ``algorithm.name``: each method's config dataclass lives beside
its recipe (``diffalign/recipes/<name>.py``) and is found through the recipe registry
(:mod:`diffalign.recipes`). The options several methods share (group advantages, the clipped
policy loss, GRPO-Guard) are declared here once, as mixins, with their validation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional, Sequence

from diffalign import recipes
from diffalign.errors import ConfigError
from diffalign.trends import MIN_WINDOW

# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    id: str = "shapes"  # hub id, local folder, "tiny:<family>", or "shapes" (the shipped default model)
    family: str = "auto"  # sd3 | flux | sd15 | shapes | ... ; "auto" reads model_index.json
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights of frozen parts and denoiser
    resolution: int = 0  # image side in pixels; 0 = the adapter's default
    revision: Optional[str] = None  # hub revision (branch, tag or commit)
    options: dict = field(default_factory=dict)  # adapter options, e.g. {num_frames: 33} for wan (docs/models.md)
    # where the text encoders live (docs/text_encoders.md): "resident" on the device all run long;
    # "offload" in CPU memory, moved to the device for each encoding; "cache": the run's whole prompt
    # set encoded once into the run directory, then the encoders are freed
    text_encoders: Literal["resident", "offload", "cache"] = "resident"

    def validate(self) -> None:
        check(self.resolution >= 0 and self.resolution % 8 == 0, "model.resolution", "must be 0 or a positive multiple of 8")


@dataclass
class LoraConfig:
    enabled: bool = True  # False = full fine-tuning of the denoiser
    rank: int = 32  # r; Flow-GRPO uses 32
    alpha: int = 64  # scaling = alpha / rank
    targets: Optional[list[str]] = None  # module names; None = the adapter's default_lora_targets
    init: Literal["gaussian", "default", "zeros_b"] = "gaussian"  # peft init_lora_weights ("default" = kaiming)
    dropout: float = 0.0

    def validate(self) -> None:
        check(self.rank > 0, "lora.rank", "must be > 0")
        check(self.alpha > 0, "lora.alpha", "must be > 0")


@dataclass
class SamplingConfig:
    num_steps: int = 10  # denoising steps of training rollouts (Flow-GRPO's "denoising reduction")
    eval_num_steps: int = 40  # steps for evaluation samples (deterministic ODE)
    guidance_scale: float = 4.5  # CFG scale in sampling and training; <= 1 disables CFG
    kernel: Literal["flow_grpo", "cps", "dance", "ddim"] = "flow_grpo"  # SDE kernel of schedulers/
    noise_level: float = 0.7  # a (flow_grpo), a (cps), eta (dance, ddim)
    std_schedule: Literal["cps", "stepwise"] = "cps"  # only for kernel=cps (see schedulers.cps_sde_step)
    # SDE window (Flow-GRPO-Fast / MixGRPO): SDE (stochastic, trainable) only on `window_size`
    # consecutive steps, deterministic ODE elsewhere. 0 = SDE on every step.
    window_size: int = 0
    window_mode: Literal["fixed", "sliding", "random"] = "fixed"  # sliding: MixGRPO; random: Flow-GRPO-Fast
    window_start: int = 0  # first SDE step (fixed / initial position of the sliding window)
    window_slide_every: int = 1  # iterations between slides (sliding mode)
    window_stride: int = 1  # steps moved per slide; wraps to window_start past the end
    # kernel=flow_grpo: SDE noise only on noise_pool x noise_pool block-constant images (the coarse
    # part of white noise), its log-prob over the block coordinates; 1 = full-resolution noise
    # (the reference). Needs image-shaped samples whose sides noise_pool divides.
    noise_pool: int = 1

    def validate(self) -> None:
        check(self.num_steps >= 1, "sampling.num_steps", "must be >= 1")
        check(self.eval_num_steps >= 1, "sampling.eval_num_steps", "must be >= 1")
        check(self.noise_level >= 0, "sampling.noise_level", "must be >= 0")
        check(0 <= self.window_size <= self.num_steps, "sampling.window_size", f"must be in [0, num_steps={self.num_steps}]")
        if self.window_size:
            check(0 <= self.window_start <= self.num_steps - self.window_size, "sampling.window_start",
                   f"must be in [0, num_steps - window_size = {self.num_steps - self.window_size}]")
        check(self.window_slide_every >= 1, "sampling.window_slide_every", "must be >= 1")
        check(self.window_stride >= 1, "sampling.window_stride", "must be >= 1")
        check(self.noise_pool >= 1, "sampling.noise_pool", "must be >= 1")
        check(self.noise_pool == 1 or self.kernel == "flow_grpo", "sampling.noise_pool", "needs sampling.kernel: flow_grpo")


@dataclass
class RolloutConfig:
    prompts_per_iteration: int = 4  # distinct prompts per iteration (per process)
    group_size: int = 8  # images per prompt (G); advantages are computed within these groups
    sample_batch_size: int = 8  # samples per batched forward during rollouts
    # every image of a group starts from the same initial noise (DanceGRPO's init_same_noise), so
    # that the rewards within a group differ only through the SDE steps the update trains; off:
    # independent noise per image (the Flow-GRPO reference)
    shared_noise: bool = False
    # between rollout and update, keep a group's samples (latents, log-probs, prompt embeddings) in
    # CPU memory and move each micro-batch to the device when the update uses it (large video
    # rollouts; docs/text_encoders.md#rollout-samples). Same weights either way.
    offload_samples: bool = False

    def validate(self) -> None:
        check(self.prompts_per_iteration >= 1, "rollout.prompts_per_iteration", "must be >= 1")
        check(self.group_size >= 2, "rollout.group_size", "must be >= 2 (advantages need a group)")
        check(self.sample_batch_size >= 1, "rollout.sample_batch_size", "must be >= 1")


@dataclass
class RewardConfig:
    name: str = "shapes_eval"  # registered name or dotted path (see reward_models)
    kwargs: dict = field(default_factory=dict)  # passed to the reward factory
    nonfinite: Literal["error", "skip"] = "error"  # NaN/inf rewards: stop with a clear error, or drop those samples (counted)
    # Reward calls that failed (after the reward's own retries, e.g. a remote server down) tolerated
    # in a run, each scored again; one more stops the run with a checkpoint (counted: reward_failures).
    max_failures: int = 3
    # YAML key `async` (a Python keyword, hence the field's name): score each rollout chunk on a
    # worker thread while the next chunk of the same iteration samples; false: score each chunk
    # before the next one samples. Same rewards and weights either way (docs/rewards.md).
    async_: bool = field(default=True, metadata={"key": "async"})

    def validate(self) -> None:
        check(self.max_failures >= 0, "reward.max_failures", "must be >= 0")


@dataclass
class PromptsConfig:
    source: Literal["shapes", "list", "file"] = "shapes"  # shapes = the ShapesWorld train/held-out split
    train: list[str] = field(default_factory=list)  # for source=list
    eval: list[str] = field(default_factory=list)  # for source=list; empty = the train prompts
    # source=file: .txt (one prompt per line), .jsonl, .csv, .parquet (the `column` field), or a
    # Hugging Face datasets folder written by save_to_disk (docs/prompts.md)
    file: Optional[str] = None
    eval_file: Optional[str] = None  # eval prompts from another file (same formats); else see eval_split / eval_fraction
    column: str = "prompt"  # the text column of .jsonl / .csv / .parquet / datasets files
    # editing models (flux_kontext, qwen_edit): the column holding each row's source image path
    # (relative paths are relative to the prompt file's folder); None = text-only prompts
    image_column: Optional[str] = None
    split: str = "train"  # datasets folder holding a DatasetDict: the training split
    eval_split: Optional[str] = None  # datasets folder holding a DatasetDict: the eval split (e.g. "test")
    # without eval_file / eval_split: hold out this fraction of the distinct prompts (a fixed random
    # subset, seed 0) for evaluation, the rest train; 0 = evaluate on the training prompts
    eval_fraction: float = 0.0
    families: list[str] = field(default_factory=list)  # source=shapes: restrict to these task families
    balance_families: bool = False  # source=shapes: draw training prompts family-uniformly (as GenEval's overall weighs families)
    # source=shapes with balance_families: draw each named family this many times as often as an
    # unnamed one (weight 1), e.g. {position: 2, color_attr: 2}: rollouts go where the model still fails
    family_weights: dict = field(default_factory=dict)
    # source=shapes: "heldout" trains on the train split and evaluates on held-out prompts;
    # "validation" (hyperparameter search) trains on the train split less a validation subset and
    # evaluates on that subset, so held-out and probe prompts never inform a choice.
    evaluate_on: Literal["heldout", "validation"] = "heldout"

    def validate(self) -> None:
        if self.source == "list":
            check(len(self.train) > 0, "prompts.train", "must list at least one prompt when prompts.source=list")
        if self.source == "file":
            check(self.file is not None, "prompts.file", "is required when prompts.source=file")
        check(0 <= self.eval_fraction < 1, "prompts.eval_fraction", "must be in [0, 1)")
        check(not (self.eval_fraction and (self.eval_file or self.eval_split)), "prompts.eval_fraction",
              "cannot be combined with prompts.eval_file or prompts.eval_split (they already give the eval prompts)")
        check(bool(self.column), "prompts.column", "must not be empty")
        if self.image_column is not None:
            check(self.source == "file", "prompts.image_column", "applies to prompts.source=file (a prompt file with an image column)")
            check(bool(self.image_column) and self.image_column != self.column, "prompts.image_column",
                  "must name a column other than prompts.column")
        if self.family_weights:
            check(self.source == "shapes" and self.balance_families, "prompts.family_weights",
                  "applies to prompts.source=shapes with prompts.balance_families=true (for other draws set "
                  "prompts.family_weights={} too)")
            for family, weight in self.family_weights.items():
                check(isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight <= 100,
                      f"prompts.family_weights.{family}", f"must be a number in (0, 100], got {weight!r}")


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"  # adamw | sgd (plain SGD: its step is linear in the gradients)
    lr: float = 3e-4
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    eps: float = 1e-8  # adamw
    momentum: float = 0.0  # sgd: heavy-ball momentum; 0 = none
    grad_clip: float = 1.0  # max grad norm; 0 disables clipping
    use_8bit_adam: bool = False  # adamw: bitsandbytes AdamW8bit (GPU only)
    # Learning rate over the run, set per iteration (a function of the iteration index, so a resumed
    # run continues the same curve): constant | linear | cosine decay from ``lr`` after
    # ``warmup_iterations`` of linear warm-up to ``lr * min_lr_fraction`` at ``max_iterations``.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_iterations: int = 0
    min_lr_fraction: float = 0.0

    def validate(self) -> None:
        check(self.lr > 0, "optim.lr", "must be > 0")
        check(self.warmup_iterations >= 0, "optim.warmup_iterations", "must be >= 0")
        check(0 <= self.min_lr_fraction <= 1, "optim.min_lr_fraction", "must be in [0, 1]")
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", "must be two numbers in [0, 1)")
        check(0 <= self.momentum < 1, "optim.momentum", "must be in [0, 1)")
        check(self.momentum == 0 or self.name == "sgd", "optim.momentum", "applies to optim.name=sgd only")
        check(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0")
        check(not (self.use_8bit_adam and self.name == "sgd"), "optim.use_8bit_adam",
               "selects bitsandbytes AdamW8bit; it needs optim.name=adamw")


@dataclass
class EmaConfig:
    """EMA of the trainable weights for evaluation and final/ (diffalign.training.policy.EMA)."""

    enabled: bool = True
    decay: float = 0.9  # Flow-GRPO: 0.9 ... (the n-th average uses min(decay, (1 + n) / (10 + n)): a warm-up)
    every: int = 8  # ... applied every 8 optimizer steps, from the first one on (a 1-step run has averaged once)

    def validate(self) -> None:
        check(0 <= self.decay < 1, "train.ema.decay", "must be in [0, 1)")
        check(self.every >= 1, "train.ema.every", "must be >= 1")


GUARD_ACTIONS = ("warn", "lower_lr", "stop")


@dataclass
class RewardGuardConfig:
    """``train.guard``: a verifier scores the rollouts' final images beside the learned reward, and
    a divergence of the two acts (diffalign.trends, docs/reward_hacking.md)."""

    verifier: str = ""  # reward name or dotted path scoring the final images (e.g. shapes_eval); "" = no guard
    verifier_kwargs: dict = field(default_factory=dict)  # passed to the verifier's factory
    every: int = 1  # score the verifier every N iterations (its cost; the window counts scored iterations)
    window: int = 8  # W: scored iterations in the trend window (>= 4: a slope's error needs 2 degrees of freedom)
    confidence: float = 0.95  # one-sided confidence that the learned reward rises and the verifier falls
    min_drop: float = 0.05  # the verifier's fitted fall over the window must reach this (its units)
    action: Literal["warn", "lower_lr", "stop"] = "warn"  # on divergence: log, multiply the lr, or checkpoint and stop
    lr_factor: float = 0.5  # action=lower_lr: the learning rate is multiplied by this ...
    max_lr_drops: int = 2  # ... at most this many times in a run (then divergences only warn)

    def validate(self) -> None:
        check(self.every >= 1, "train.guard.every", "must be >= 1")
        check(self.window >= MIN_WINDOW, "train.guard.window", f"must be >= {MIN_WINDOW} (a slope's standard error needs 2 degrees of freedom)")
        check(0.5 < self.confidence < 1, "train.guard.confidence", "must be in (0.5, 1)")
        check(math.isfinite(self.min_drop) and self.min_drop >= 0, "train.guard.min_drop", "must be >= 0")
        check(self.action in GUARD_ACTIONS, "train.guard.action", f"must be one of {', '.join(GUARD_ACTIONS)}")
        check(0 < self.lr_factor < 1, "train.guard.lr_factor", "must be in (0, 1) (it lowers the learning rate)")
        check(self.max_lr_drops >= 1, "train.guard.max_lr_drops", "must be >= 1")
        if not self.verifier:
            check(not self.verifier_kwargs, "train.guard.verifier_kwargs", "needs train.guard.verifier (the reward they configure)")


def native_bf16(device, cpu_flags: set[str] | None = None) -> bool:
    """Does ``device`` compute bf16 natively? CUDA: ``torch.cuda.is_bf16_supported()``; CPU: the
    AVX512-BF16 or AMX-BF16 instruction sets (``cpu_flags``, read from /proc/cpuinfo by default)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    if cpu_flags is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
        cpu_flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags)


@dataclass
class TrainConfig:
    batch_size: int = 8  # samples per training micro-batch (per process)
    optimizer_steps_per_iteration: int = 1  # gradients accumulate over samples x timesteps in between
    inner_epochs: int = 1  # passes over the iteration's samples
    # accelerate autocast of the denoiser's forwards (rollouts and updates alike, so the on-policy
    # ratio stays 1; step kernels and log-probs stay fp32). "auto": bf16 where the hardware computes
    # it natively (CUDA with bf16, CPUs with AVX512-BF16 or AMX), else "no".
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] = "no"
    channels_last: bool = False  # conv denoisers (UNets) in channels-last memory format (faster CPU convs)
    # CFG in the update: the unconditional branch runs without gradient (one backward of B rows, not
    # 2B). An approximation: the gradient through the (1 - g) x uncond term is dropped.
    detach_uncond: bool = False
    gradient_checkpointing: bool = False
    ema: EmaConfig = field(default_factory=EmaConfig)
    self_check: bool = True  # stop if the on-policy ratio before any update is not 1
    self_check_tolerance: float = 1e-3  # max |log ratio| allowed by the self-check
    max_nonfinite_losses: int = 3  # consecutive skipped optimizer steps before stopping
    # DeepSpeed ZeRO over the data-parallel processes: 0 = off (diffalign all-reduces the gradients),
    # 1 = optimizer states sharded, 2 = optimizer states and gradients sharded. Launching with
    # configs/accelerate/deepspeed_zero2.yaml sets it from the accelerate config.
    zero_stage: int = 0
    # FSDP2 (torch fully_shard): weights, gradients and optimizer states sharded per denoiser block
    # (full fine-tuning of a model too large for one device). Launching with
    # configs/accelerate/fsdp.yaml (fsdp_version: 2) sets it. Recipes with supports_fsdp only.
    fsdp: bool = False
    # Context parallelism: each sample's tokens split over this many processes (diffusers'
    # ContextParallelConfig, Ulysses attention); processes / context_parallel data-parallel groups.
    # Families with a diffusers context-parallel plan only (docs/distributed.md#context-parallelism).
    context_parallel: int = 1
    attention: Literal["default", "xformers"] = "default"  # xformers: memory-efficient attention (CUDA + xformers)
    guard: RewardGuardConfig = field(default_factory=RewardGuardConfig)  # reward-hacking guard (docs/reward_hacking.md)

    def resolved_mixed_precision(self, device: "torch.device") -> str:
        """``mixed_precision`` with "auto" decided for ``device`` (see :func:`native_bf16`)."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        return "bf16" if native_bf16(device) else "no"

    def validate(self) -> None:
        check(self.zero_stage in (0, 1, 2) and not isinstance(self.zero_stage, bool), "train.zero_stage",
               "must be 0, 1 or 2 (ZeRO-3 partitions the weights the rollouts read; use FSDP for that)")
        check(isinstance(self.context_parallel, int) and not isinstance(self.context_parallel, bool)
              and self.context_parallel >= 1, "train.context_parallel", "must be an integer >= 1 (processes per sample)")
        if self.context_parallel > 1:
            check(not self.fsdp and not self.zero_stage, "train.context_parallel",
                  "combines with plain data parallelism only (set train.fsdp=false and train.zero_stage=0)")
        check(self.batch_size >= 1, "train.batch_size", "must be >= 1")
        check(self.optimizer_steps_per_iteration >= 1, "train.optimizer_steps_per_iteration", "must be >= 1")
        check(self.inner_epochs >= 1, "train.inner_epochs", "must be >= 1")
        self.ema.validate()
        self.guard.validate()


MIN_GUIDANCE_SCALE = 1.0  # CFG 1 = no guidance; below it the guidance points away from the prompt
# the grid a best CFG scale is chosen from: around the shipped model's best (1.5-2) up to the recipes' 4
BEST_SCALE_GRID = (1.0, 1.5, 2.0, 3.0, 4.0)
# Validation images per family at each scale: 48 is a whole multiple of every family's validation
# prompts (3, 6, 2, 3, 4, 24) and half the held-out evaluation's 96, so five scales plus the held-out
# list are about 2,000 images per model (a few minutes of the shipped model on a 2-core CPU).
BEST_SCALE_VALIDATION_IMAGES = 48


def scale_grid_problem(scales: Sequence[float]) -> Optional[str]:
    """Why ``scales`` (finite numbers) is no grid of CFG scales to choose a best one from: each
    >= 1, none twice, at least two; None when it is one."""
    low = [s for s in scales if not s >= MIN_GUIDANCE_SCALE]
    if low:
        return f"must hold CFG scales >= {MIN_GUIDANCE_SCALE:g} (1 = no guidance), got {low[0]:g}"
    if len(set(scales)) != len(scales):
        return f"lists a scale twice: {', '.join(f'{s:g}' for s in scales)}"
    if len(scales) < 2:
        return f"needs at least two CFG scales to choose from, got {len(scales)}"
    return None


@dataclass
class EvalConfig:
    every: int = 0  # evaluate every N iterations (0 = only before training and at the end)
    num_prompts: int = 0  # 0 = all; N = the first N eval prompts (shapes: first N images of the eval list), a quick check
    images_per_family: int = 96  # prompts.source=shapes: images per GenEval family (prompts repeated round-robin)
    samples_per_prompt: int = 1  # prompts.source=list/file: images per eval prompt (shapes: images_per_family)
    probe: bool = True  # prompts.source=shapes: also evaluate the generalisation probe, before and after training
    batch_size: int = 16
    seed: int = 1234  # eval noise seed: before/after samples share it
    at_start: bool = True  # evaluate the base model before the first update
    use_ema: bool = True  # evaluate (and export as final/) the EMA weights when EMA is enabled
    # prompts.source=shapes: the final evaluation also evaluates the base and the final weights each
    # at its validation-best CFG scale of `scales` and pairs them (diffalign.best_scale); off by
    # default: it samples (len(scales) x 6 x validation_images_per_family + the held-out list) images
    # per model, several times the final evaluation's
    best_scale: bool = False
    scales: list[float] = field(default_factory=lambda: list(BEST_SCALE_GRID))  # eval.best_scale: the grid
    validation_images_per_family: int = BEST_SCALE_VALIDATION_IMAGES  # eval.best_scale: validation images per family per scale

    def validate(self) -> None:
        check(self.every >= 0, "eval.every", "must be >= 0")
        check(self.num_prompts >= 0, "eval.num_prompts", "must be >= 0 (0 = all)")
        check(self.images_per_family >= 1, "eval.images_per_family", "must be >= 1")
        check(self.samples_per_prompt >= 1, "eval.samples_per_prompt", "must be >= 1")
        check(self.batch_size >= 1, "eval.batch_size", "must be >= 1")
        problem = scale_grid_problem(self.scales)
        check(problem is None, "eval.scales", problem or "")
        check(self.validation_images_per_family >= 1, "eval.validation_images_per_family", "must be >= 1")


@dataclass
class CheckpointConfig:
    every: int = 5  # iterations between checkpoints (0 = only the final one)
    keep_last: int = 2  # older checkpoints are deleted


# tracker name -> the module that must be importable for it (diffalign.training.tracking)
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


@dataclass
class LogConfig:
    progress_bar: bool = True  # tqdm bars on a terminal; elsewhere (and under --quiet) one line per phase
    report: bool = True  # write report.md with plots and sample grids at the end
    # experiment trackers through accelerate (docs/tracking.md): tensorboard, wandb, mlflow, trackio
    trackers: list[str] = field(default_factory=list)
    project: str = "diffalign"  # the tracker project (W&B / trackio project, MLflow experiment)
    run_name: Optional[str] = None  # the run's name in the trackers; None = the run directory's name
    offline: bool = False  # W&B offline mode, MLflow file store under RUN_DIR/mlruns (TensorBoard and trackio are local anyway)

    def validate(self) -> None:
        for name in self.trackers:
            check(name in TRACKER_MODULES, "log.trackers", f"has unknown tracker {name!r} (known: {', '.join(TRACKER_MODULES)})")
        check(bool(self.project), "log.project", "must not be empty")


# --------------------------------------------------------------------------------------------
# Algorithms: the base of every method's config, and the options several methods share
# --------------------------------------------------------------------------------------------


@dataclass
class AlgorithmConfig:
    """The ``algorithm`` section. A method subclasses it beside its recipe and registers both with
    :func:`diffalign.recipes.register_recipe`; shared code asks it through the methods below
    instead of probing for keys."""

    name: str = "flow_grpo"
    # old key -> its current name; such a key still loads, with a one-line deprecation notice
    renamed_keys: ClassVar[dict[str, str]] = {}

    def validate(self, prefix: str = "algorithm") -> None:
        """Check every value; errors name ``prefix.key`` (a method nested in another passes its path).
        Subclasses check their own keys and call ``super().validate(prefix)`` (the mixins' checks)."""

    def trained_steps_per_sample(self, sde_steps: int) -> int:
        """Denoising steps trained per rollout sample (the run header's count)."""
        return sde_steps

    def trained_images_per_iteration(self, images: int, group_size: int) -> int:
        """Rollout images an update trains on, of ``images`` per process in groups of ``group_size``
        (the run header's micro-batch count); RAFT keeps only the best of each group."""
        return images

    def named_rewards(self) -> list[tuple[str, str, dict]]:
        """``(config key, reward name, kwargs)`` of the rewards besides ``reward`` this method builds
        by name (checked before a model loads)."""
        return []

    def untrained_judge(self, cfg: "RunConfig", config_path: str) -> Optional[str]:
        """A one-line message when this method's auxiliary judge, trained by another command, has not
        been trained yet (None when there is none or it is there)."""
        return None

    def kernel_reduction(self) -> str:
        """How the SDE kernel reduces its Gaussian log-density over latent elements."""
        return "mean"

    def check_sampling(self, sampling: SamplingConfig, prefix: str = "algorithm") -> None:
        """Refuse a combination of this method's keys with the ``sampling`` section (a
        :class:`ConfigError` naming ``prefix.key``); run after every section validated."""

    def rewards_in_groups(self) -> bool:
        """Whether the method scores whole images in prompt groups and tells the reward each image's
        group (``metadata["group"]``), so that a reward comparing the images of a group (``pairwise``)
        can train it."""
        return False

    def rollout_images(self) -> bool:
        """Whether the method samples images from the policy during training (final images a
        verifier can score: ``train.guard``); False for methods trained on offline data."""
        return True

    def apply_reward_defaults(self, groupwise: bool) -> None:
        """Resolve, in place, the keys whose default depends on the reward (``groupwise``: it
        compares the images of a group, as ``pairwise``); the trainer calls it once the reward is built."""

    def needs_differentiable_reward(self) -> bool:
        """Whether the loss backpropagates through the reward (DRaFT, ReFL): the trainer then
        refuses a ``reward.name`` that does not declare ``differentiable = True``."""
        return False

    def reward_aggregation(self) -> str:
        """How the advantages combine the components of a weighted reward: ``"sum"`` (of the
        weighted rewards, one reward to the method) or ``"gdpo"`` (the trainer hands the method
        each component's reward, :func:`diffalign.algorithms.flow_grpo.gdpo_advantages`)."""
        return "sum"


def method_defaults(**values):
    """Class decorator under ``@dataclass``: a method's own defaults for fields a shared mixin
    declares (``@method_defaults(clip_range=1e-3)``), without declaring the field again."""

    def deco(cls):
        for name, value in values.items():
            owner = next((base for base in cls.__mro__[1:] if name in getattr(base, "__dataclass_fields__", {})), None)
            if owner is None:
                raise TypeError(f"{cls.__name__}: no shared field {name!r} to give a default")
            cls.__annotations__ = {**cls.__dict__.get("__annotations__", {}), name: owner.__dataclass_fields__[name].type}
            setattr(cls, name, value)
        return cls

    return deco


# How group advantages normalise when the config leaves it to the reward (None): a pointwise reward
# as the Flow-GRPO paper (std over the batch, population std, eps 1e-4), a reward that compares the
# images of a group (``pairwise``) as Pref-GRPO (win rates z-scored within each group with
# torch.std's unbiased std, eps 1e-8).
POINTWISE_ADVANTAGES = {"advantage_std": "global", "advantage_unbiased_std": False, "advantage_eps": 1e-4}
GROUPWISE_ADVANTAGES = {"advantage_std": "group", "advantage_unbiased_std": True, "advantage_eps": 1e-8}
ADVANTAGE_AGGREGATIONS = ("sum", "gdpo")  # algorithm.advantage_aggregation of the group-advantage methods


@dataclass
class AdvantageOptions:
    """Group-relative advantages ``A = clip((r - mean) / (std + eps), +-advantage_clip)``."""

    advantage_clip: float = 5.0  # A clipped to +- this
    advantage_eps: Optional[float] = None  # A = (r - mean) / (std + eps); None: 1e-4, 1e-8 for a pairwise reward (Pref-GRPO)
    filter_zero_std_groups: bool = True  # drop groups whose rewards are all equal (all A = 0: no gradient, only cost)

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.advantage_clip > 0, f"{prefix}.advantage_clip", "must be > 0")
        check(self.advantage_eps is None or self.advantage_eps >= 0, f"{prefix}.advantage_eps", "must be >= 0")
        super().validate(prefix)

    def apply_reward_defaults(self, groupwise: bool) -> None:
        if self.advantage_eps is None:
            self.advantage_eps = (GROUPWISE_ADVANTAGES if groupwise else POINTWISE_ADVANTAGES)["advantage_eps"]
        super().apply_reward_defaults(groupwise)


@dataclass
class GroupAdvantageOptions(AdvantageOptions):
    """Advantages within prompt groups, with the std taken over the batch or per group. A key left
    unset (None) takes the reward's reference value when the run starts (:meth:`apply_reward_defaults`)."""

    advantage_std: Optional[Literal["global", "group"]] = None  # std over the whole batch or per prompt group; None: global (Flow-GRPO), group for a pairwise reward (Pref-GRPO)
    advantage_unbiased_std: Optional[bool] = None  # Bessel's std (N - 1) or the population std (N); None: population, unbiased for a pairwise reward
    # several weighted rewards (reward.name: weighted): "sum" normalises their weighted sum within
    # each group; "gdpo" normalises each reward within its group, sums the weighted results and
    # normalises that over the batch (GDPO, docs/gdpo.md; ignores advantage_std: per group by definition)
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.advantage_aggregation in ADVANTAGE_AGGREGATIONS, f"{prefix}.advantage_aggregation",
              f"must be one of {', '.join(ADVANTAGE_AGGREGATIONS)}")
        super().validate(prefix)

    def reward_aggregation(self) -> str:
        return self.advantage_aggregation

    def apply_reward_defaults(self, groupwise: bool) -> None:
        """Fill the keys left unset with the reference values for this kind of reward; a key set in
        the config keeps its value."""
        defaults = GROUPWISE_ADVANTAGES if groupwise else POINTWISE_ADVANTAGES
        for name in ("advantage_std", "advantage_unbiased_std"):
            if getattr(self, name) is None:
                setattr(self, name, defaults[name])
        super().apply_reward_defaults(groupwise)  # advantage_eps


GUARD_NORM_MODES = ("auto", "analytic", "batch")


@dataclass
class GuardOptions:
    """GRPO-Guard's switches (docs/grpo_guard.md), shared by the clipped-policy methods."""

    guard_ratio_norm: bool = False  # GRPO-Guard ratio normalisation per denoising step
    guard_norm_mode: Literal["auto", "analytic", "batch"] = "auto"  # analytic: exact (needs the rollout's step noise); batch: micro-batch mean per step; auto: analytic where available
    guard_step_reweight: bool = False  # per-step policy-gradient weights ~ 1/|dt|, mean 1 over the trainable steps
    guard_diagnostics: bool = False  # log guard/ratio_{mean,std}/step_NN and guard/norm_ratio_{mean,std}/step_NN

    @property
    def guard_active(self) -> bool:
        return self.guard_ratio_norm or self.guard_step_reweight or self.guard_diagnostics

    def validate(self, prefix: str = "algorithm") -> None:
        check(self.guard_norm_mode in GUARD_NORM_MODES, f"{prefix}.guard_norm_mode", f"must be one of {', '.join(GUARD_NORM_MODES)}")
        super().validate(prefix)


# sampling.kernel values whose step noise std is sigma_t * sqrt(|dt|), where Flow-GRPO's reference KL
# is defined (the same list as diffalign.sampling.linear.SQRT_DT_KERNELS, which imports torch;
# tests/test_kl_definition.py keeps the two equal)
SQRT_DT_KERNELS = ("flow_grpo", "dance")


@dataclass
class ClippedPolicyOptions(GuardOptions):
    """The PPO-style clipped ratio loss on SDE transitions, with a KL term to the reference."""

    clip_range: float = 1e-4  # PPO epsilon
    beta: float = 0.0  # KL weight against the adapter-disabled reference; 0 skips the reference forward
    logprob_reduction: Literal["mean", "sum"] = "mean"  # Gaussian log-density over latent dims
    # what `beta` weighs per trained step: "exact" = the KL of the two Gaussian transitions,
    # mean((mu - mu_ref)^2) / (2 std^2) with std the step's noise std; "reference" = Flow-GRPO's
    # code, which divides by sigma_t^2 without |dt| (the exact KL times |dt|; its beta values, 0.04
    # for GenEval, assume this). "reference" needs a kernel whose std is sigma_t sqrt(|dt|): flow_grpo, dance
    kl_definition: Literal["exact", "reference"] = "exact"

    def validate(self, prefix: str = "algorithm") -> None:
        check(0 < self.clip_range < 1, f"{prefix}.clip_range", "must be in (0, 1)")
        check(self.beta >= 0, f"{prefix}.beta", "must be >= 0")
        check(self.kl_definition in ("exact", "reference"), f"{prefix}.kl_definition", "must be 'exact' or 'reference'")
        super().validate(prefix)

    def check_sampling(self, sampling: SamplingConfig, prefix: str = "algorithm") -> None:
        if self.kl_definition == "reference" and self.beta > 0 and sampling.kernel not in SQRT_DT_KERNELS:
            why = {"cps": "its step std is s' sin(a pi / 2), not sigma_t sqrt(|dt|), and Flow-GRPO's code divides its KL "
                          "by that std: the 'exact' KL",
                   "ddim": "it steps between discrete timesteps and has no |dt|"}.get(sampling.kernel, "it has no |dt|")
            check(False, f"{prefix}.kl_definition", f"'reference' (the KL times the step's |dt|) needs sampling.kernel "
                  f"{' or '.join(SQRT_DT_KERNELS)}; kernel {sampling.kernel}: {why}; use 'exact'")
        super().check_sampling(sampling, prefix)

    def kernel_reduction(self) -> str:
        return self.logprob_reduction


def fraction_of_steps(sde_steps: int, fraction: float) -> int:
    """``int(sde_steps * fraction)``, at least 1 (all of them for a fraction of 1)."""
    return max(1, int(sde_steps * fraction + 1e-9)) if fraction < 1 else sde_steps


# --------------------------------------------------------------------------------------------
# The run config
# --------------------------------------------------------------------------------------------


def sections(cls):
    """Class decorator (under ``@dataclass``): every annotated field without a default gets a
    fresh instance of its annotated config class, so a config lists its sections as ``name: Class``."""
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        if name not in cls.__dict__:
            section = globals().get(annotation)
            if not dataclasses.is_dataclass(section):
                raise TypeError(f"{cls.__name__}.{name}: a field without a default must be annotated with a config section class, got {annotation!r}")
            setattr(cls, name, field(default_factory=section))
    return cls


@dataclass
@sections
class RunConfig:
    output_dir: str = "runs/default"  # run directory: config.yaml, metrics.jsonl, checkpoints/, final/
    seed: int = 0  # seeds prompts, noise and initialisation; a resumed run continues the same streams
    max_iterations: int = 10  # rollout + update iterations
    model: ModelConfig
    lora: LoraConfig
    sampling: SamplingConfig
    rollout: RolloutConfig
    reward: RewardConfig
    prompts: PromptsConfig
    algorithm: AlgorithmConfig = field(default_factory=lambda: recipes.config_class(recipes.DEFAULT)())  # typed by algorithm.name
    optim: OptimConfig
    train: TrainConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    log: LogConfig

    def validate(self) -> None:
        check(self.max_iterations >= 0, "max_iterations", "must be >= 0")
        self.algorithm.validate("algorithm")
        check(not self.train.guard.verifier or self.algorithm.rollout_images(), "train.guard.verifier",
              f"needs rollouts, and {self.algorithm.name} trains on offline data without sampling any")
        check(bool(self.output_dir), "output_dir", "must not be empty")
        if self.eval.best_scale:
            check(self.prompts.source == "shapes", "eval.best_scale",
                  "needs prompts.source: shapes (it chooses CFG scales on ShapesWorld's validation prompts with ShapesEval)")
            check(self.prompts.evaluate_on == "heldout", "eval.best_scale",
                  "chooses the CFG scale on the validation prompts, which prompts.evaluate_on: validation evaluates on; "
                  "use prompts.evaluate_on: heldout")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if hasattr(value, "validate") and f.name != "algorithm":
                value.validate()
        self.algorithm.check_sampling(self.sampling, "algorithm")

    # derived numbers, printed at start -------------------------------------------------
    def derived(self, num_processes: int = 1) -> dict[str, int]:
        per_proc = self.rollout.prompts_per_iteration * self.rollout.group_size
        sde_steps = self.sampling.window_size or self.sampling.num_steps
        trained = self.algorithm.trained_steps_per_sample(sde_steps)
        trained_images = self.algorithm.trained_images_per_iteration(per_proc, self.rollout.group_size)
        micro = math.ceil(trained_images / self.train.batch_size) * trained * self.train.inner_epochs
        return {
            "images_per_iteration": per_proc * num_processes,
            "sde_steps": sde_steps,
            "trained_steps_per_sample": trained,
            "micro_batches_per_iteration": micro,
            "optimizer_steps_per_iteration": self.train.optimizer_steps_per_iteration * self.train.inner_epochs,
        }


def check(ok: bool, key: str, message: str) -> None:
    """Raise ``ConfigError`` naming ``key`` unless ``ok`` (the validators of every config section use it)."""
    if not ok:
        raise ConfigError(f"config key '{key}' {message}")


RANGES = {  # rule name of check_ranges -> (test, message)
    "positive": (lambda v: v > 0, "must be > 0"),
    "nonnegative": (lambda v: v >= 0, "must be >= 0"),
    "fraction": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "decay": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
}


def check_ranges(section, prefix: str, **fields_by_rule: Sequence[str]) -> None:
    """:func:`check` each named numeric field of ``section`` against its rule of :data:`RANGES`,
    e.g. ``check_ranges(self, "algorithm", positive=("adv_clip",), fraction=("timestep_fraction",))``."""
    for rule, names in fields_by_rule.items():
        test, message = RANGES[rule]
        for name in names:
            check(test(getattr(section, name)), f"{prefix}.{name}", message)
