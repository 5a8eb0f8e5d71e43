"""The plan: GPU memory per process of a recipe, phase by phase, each line with how it was obtained.

- **counted**: parameters of the real architectures built on the meta device (``components.py``),
  LoRA parameters of the recipe's rank and targets, bytes per element of each dtype, optimizer,
  EMA and sharding arithmetic, the rollout's stored trajectories;
- **measured**: activations of one micro-batch, from the per-block table ``activations.json``
  (``scripts/measure_activations.py``) scaled by rows x tokens x width x blocks;
- **assumed**: what neither gives (the activation dtype under autocast, the gathered FSDP blocks,
  the VAE decode's working set).

Phases (the peak is the largest): ``encode`` (text encoders on the GPU: every iteration when
offloaded, once at start when cached, always when resident), ``rollout`` (no-grad denoiser forwards of
a sampling batch, the VAE decode), ``train`` (one micro-batch forward and backward with the
gradients, the optimizer states and EMA).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffalign.adapters import adapter_class, load_adapter, model_family
from diffalign.errors import ConfigError
from diffalign.planner import components, geometry
from diffalign.planner.measure import block_lists, probe_tokens
from diffalign.training.text_encoders import PLACEMENTS, device_residency

ACTIVATIONS = Path(__file__).with_name("activations.json")
GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4  # trainable weights, their gradients and EMA stay fp32 (training.policy.prepare_denoiser)
ADAMW_STATE = 2 * FP32  # exp_avg, exp_avg_sq
ADAMW_8BIT_STATE = 2  # bitsandbytes AdamW8bit: two 8-bit states per parameter (block scales are negligible)
FSDP_GATHERED_BLOCKS = 2  # FSDP2 holds the current block's gathered weights and prefetches the next one
VAE_DECODE_MAPS = 3  # assumed: input, output and residual feature maps alive at the decoder's top level
# bits per weight of a low-precision policy copy (Sol-RL's algorithm.quant.format); block scales included
# where the format has them (NVFP4: one fp8 scale per 16 weights; int4: one bf16 scale per 32 weights)
COPY_BITS = {"full": 32, "bf16": 16, "int8": 8, "fp8": 8, "bnb_int8": 8, "int4": 4.5, "nvfp4": 4.5, "bnb_nf4": 4.5,
             "quanto_int8": 8, "quanto_fp8": 8, "quanto_int4": 4.5}
MEASURED_AS = {"flux_kontext": "flux", "qwen_edit": "qwen"}  # editing families run their base family's blocks
REFERENCE_METHODS = ("spo", "diffusion_dpo")  # always score against the frozen initial model


@dataclass(frozen=True)
class Settings:
    """What a plan depends on, read from a run config (``from_config``) and changed by suggestions."""

    model_id: str
    family: str
    dtype: str
    resolution: int
    options: dict
    rewards: tuple  # reward names whose models sit on the GPU (shipped architectures only)
    lora: bool
    rank: int
    targets: tuple
    checkpointing: bool
    batch_size: int
    sample_batch_size: int
    cfg_rows: int  # training forwards: 2 with CFG (one batched forward of conditional and unconditional rows), else 1
    samples_per_iteration: int
    num_steps: int
    use_8bit_adam: bool
    ema: bool
    reference: bool
    text_encoders: str
    zero_stage: int
    fsdp: bool
    gpus: int
    activation_bytes: int
    source_image: bool
    sample_cfg_rows: int = 1  # the rollout's forwards, as cfg_rows
    offload_samples: bool = False  # rollout.offload_samples: the rollout's samples in CPU memory, a micro-batch at a time on the GPU
    denoiser_copies: tuple = ()  # (what, bits per weight) of other copies of the denoiser a method holds
    context_parallel: int = 1  # train.context_parallel: each sample's tokens split over this many processes inside the blocks

    @classmethod
    def from_config(cls, cfg, gpus: int = 1) -> "Settings":
        family = cfg.model.family if cfg.model.family != "auto" else model_family(cfg.model.id, "auto")
        if family is None:
            raise ConfigError(f"config key 'model.family': set it for hub model {cfg.model.id!r} (the planner reads no Hub files)")
        if family not in geometry.LAYOUTS:
            raise ConfigError(f"config key 'model.family': the planner has no latent layout for family {family!r}")
        placement = cfg.model.text_encoders
        device_residency(placement)  # a placement the run knows
        algo = cfg.algorithm
        reference = getattr(algo, "beta", 0) > 0 or getattr(algo, "kl_beta", 0) > 0 or algo.name in REFERENCE_METHODS
        # a method that trains at its own CFG scale says so (DGPO's train_guidance_scale); else the sampling one
        train_scale = getattr(algo, "train_guidance_scale", cfg.sampling.guidance_scale)
        autocast = cfg.train.mixed_precision != "no" or cfg.model.dtype != "float32"
        copies = [(f"teacher {i}", 8 * DTYPE_BYTES[cfg.model.dtype]) for i, _ in enumerate(getattr(algo, "teachers", []))]
        quant = getattr(algo, "quant", None)
        if quant is not None and getattr(quant, "format", None) in COPY_BITS:
            copies.append((f"{quant.format} policy copy", COPY_BITS[quant.format]))
        cls_ = adapter_class(family)
        targets = cfg.lora.targets or list(cls_.default_lora_targets)
        return cls(
            model_id=cfg.model.id, family=family, dtype=cfg.model.dtype,
            resolution=cfg.model.resolution or cls_.default_resolution, options=dict(cfg.model.options),
            rewards=reward_models(cfg.reward.name, cfg.reward.kwargs), lora=cfg.lora.enabled, rank=cfg.lora.rank, targets=tuple(targets),
            checkpointing=cfg.train.gradient_checkpointing, batch_size=cfg.train.batch_size,
            sample_batch_size=cfg.rollout.sample_batch_size, cfg_rows=2 if train_scale > 1 else 1,
            sample_cfg_rows=2 if cfg.sampling.guidance_scale > 1 else 1,
            samples_per_iteration=cfg.rollout.prompts_per_iteration * cfg.rollout.group_size, num_steps=cfg.sampling.num_steps,
            use_8bit_adam=cfg.optim.use_8bit_adam, ema=cfg.train.ema.enabled, reference=reference, text_encoders=placement,
            zero_stage=cfg.train.zero_stage, fsdp=cfg.train.fsdp, gpus=gpus,
            activation_bytes=2 if autocast else DTYPE_BYTES[cfg.model.dtype],
            source_image=bool(cfg.prompts.image_column), denoiser_copies=tuple(copies),
            offload_samples=cfg.rollout.offload_samples, context_parallel=cfg.train.context_parallel,
        )


def reward_models(name: str, kwargs: dict) -> tuple:
    """The rewards whose networks a run loads: the reward itself and the rewards or CLIP model its
    kwargs name (an editing reward's instruction reward, its preservation CLIP), where the planner
    ships their architecture; a remote or CPU reward (OCR, compression) holds no GPU memory."""
    names = [name]
    for key, value in kwargs.items():
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            names.append(value["name"])
        elif isinstance(value, str) and key != "name":
            names.append(value)
    if kwargs.get("clip_model"):
        names.append("clip_score")  # a CLIPModel of the id given, CLIP-L by default
    return tuple(dict.fromkeys(n for n in names if components.reward_component(n) is not None))


@dataclass(frozen=True)
class Line:
    name: str
    bytes: float
    how: str  # counted | measured | assumed
    note: str = ""


@dataclass
class Plan:
    settings: Settings
    phases: dict[str, list[Line]]
    notes: list[str] = field(default_factory=list)

    def total(self, phase: str) -> float:
        return sum(line.bytes for line in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> float:
        return self.total(self.peak_phase)


# ---- the model: counted parts -----------------------------------------------------------------
@dataclass(frozen=True)
class BlockList:
    name: str
    count: int
    width: int
    params: int  # of one block (FSDP gathers one at a time)


@dataclass(frozen=True)
class ModelCount:
    """Parameter counts of a model's parts and the shape of its denoiser."""

    parts: tuple  # (name, role, params, buffer elements, source)
    denoisers: tuple  # names of the denoiser components (Wan2.2: two experts)
    lists: tuple  # BlockList of one denoiser (the experts share a shape)
    unit_width: int  # a UNet's first level channels (0 for a transformer)
    rewards: tuple  # (name, params, source) per reward model


def _first_linear_width(block: torch.nn.Module) -> int:
    return next(m.in_features for m in block.modules() if isinstance(m, torch.nn.Linear))


def _denoiser_shape(denoiser: torch.nn.Module) -> tuple[tuple, int]:
    lists = block_lists(denoiser)
    if not lists:
        return (), denoiser.config.block_out_channels[0]
    return tuple(BlockList(name, len(blocks), _first_linear_width(blocks[0]), sum(p.numel() for p in blocks[0].parameters()))
                 for name, blocks in lists.items()), 0


def lora_params(denoiser: torch.nn.Module, targets: tuple, rank: int) -> int:
    """LoRA parameters peft adds for ``target_modules=targets`` (a module matches a target when its
    name is the target or ends with ``.target``): ``r * (in + out)`` per Linear, ``r * (in * k * k + out)``
    per Conv2d."""
    total = 0
    for name, module in denoiser.named_modules():
        if not any(name == t or name.endswith("." + t) for t in targets):
            continue
        if isinstance(module, torch.nn.Linear):
            total += rank * (module.in_features + module.out_features)
        elif isinstance(module, torch.nn.Conv2d):
            kh, kw = module.kernel_size
            total += rank * (module.in_channels // module.groups * kh * kw + module.out_channels)
    return total


def _buffer_elements(module: torch.nn.Module) -> int:
    return sum(b.numel() for b in module.buffers() if b.is_floating_point())


@functools.lru_cache(maxsize=None)
def tiny_adapter(family: str):
    return load_adapter(f"tiny:{family}")


def denoiser_modules(model_id: str, family: str) -> list[torch.nn.Module]:
    """The denoiser component(s): on the meta device for a published model, the tiny build's own."""
    if model_id.startswith("tiny:"):
        return list(tiny_adapter(family).denoiser_parts().values())
    return [components.meta_denoiser(model_id, c.name) for c in components.model_components(model_id) if c.role == "denoiser"]


@functools.lru_cache(maxsize=None)
def _lora_count(model_id: str, family: str, targets: tuple, rank: int) -> int:
    return sum(lora_params(m, targets, rank) for m in denoiser_modules(model_id, family))


@functools.lru_cache(maxsize=None)
def count_model(model_id: str, family: str, rewards: tuple) -> ModelCount:
    reward_tuple = tuple((c.name, c.params, c.source) for c in map(components.reward_component, rewards))
    if model_id.startswith("tiny:"):
        adapter = tiny_adapter(family)
        denoisers = adapter.denoiser_parts()
        parts = []
        for name, module in adapter.pipeline.components.items():
            if isinstance(module, torch.nn.Module):
                parts.append((name, components.role(name) if name not in denoisers else "denoiser",
                              sum(p.numel() for p in module.parameters()), _buffer_elements(module), f"{model_id} (built in code)"))
        lists, unit = _denoiser_shape(next(iter(denoisers.values())))
        return ModelCount(tuple(parts), tuple(denoisers), lists, unit, reward_tuple)
    parts = tuple((c.name, c.role, c.params, c.buffers, c.source) for c in components.model_components(model_id))
    denoisers = [c[0] for c in parts if c[1] == "denoiser"]
    lists, unit = _denoiser_shape(components.meta_denoiser(model_id, denoisers[0]))
    return ModelCount(parts, tuple(denoisers), lists, unit, reward_tuple)


# ---- activations: measured per block ---------------------------------------------------------
@functools.lru_cache(maxsize=1)
def activation_table() -> dict:
    return json.loads(ACTIVATIONS.read_text())


def activation_entry(family: str, lora: bool, checkpointing: bool) -> dict:
    table = activation_table()["families"]
    family = MEASURED_AS.get(family, family)
    if family not in table:
        raise ConfigError(f"config key 'model.family': no measured activations for {family!r} in {ACTIVATIONS.name} "
                          "(run scripts/measure_activations.py)")
    return table[family][f"{'lora' if lora else 'full'}{'_checkpointing' if checkpointing else ''}"]


def _rows_tokens_width(s: Settings, count: ModelCount, rows: int) -> list[tuple[BlockList | None, float]]:
    """``(block list, rows * tokens * width)`` per block list (one entry ``(None, ...)`` for a UNet)."""
    if s.model_id.startswith("tiny:"):
        probed = _tiny_tokens(s.family, s.resolution)
        if not count.lists:
            return [(None, rows * probed["unet"] * count.unit_width)]
        return [(bl, rows * probed[bl.name] * bl.width) for bl in count.lists]
    image, text = geometry.tokens(s.family, s.resolution, s.options, source_image=s.source_image)
    if not count.lists:
        return [(None, rows * image * count.unit_width)]
    return [(bl, rows * (image + text) * bl.width) for bl in count.lists]


@functools.lru_cache(maxsize=None)
def _tiny_tokens(family: str, resolution: int) -> dict[str, int]:
    return probe_tokens(tiny_adapter(family), resolution)


def activation_lines(s: Settings, count: ModelCount, rows: int, *, grad: bool) -> list[Line]:
    """Activations of one forward of ``rows`` rows: saved for backward (``grad``) or the no-grad working set."""
    entry = activation_entry(s.family, s.lora, s.checkpointing)
    scaled = _rows_tokens_width(s, count, rows)
    # outside, working set and no-grad forward are relative to the widest stream (measure.coefficients)
    first = max(n for _, n in scaled) * s.activation_bytes
    how = "measured"
    # context parallelism: inside the blocks each process holds tokens / C (attention: all tokens, heads / C,
    # the same elements); what runs outside the blocks is held whole by every process of a group
    cp = s.context_parallel
    split = f" / {cp} (context parallel)" if cp > 1 else ""
    if not grad:
        return [Line("denoiser forward working set (no grad)", entry["inference"] * first / cp, how,
                     f"{entry['inference']:.2f} x rows x tokens x width x {s.activation_bytes} B{split}")]
    lines = []
    for bl, n in scaled:
        if bl is None:
            lines.append(Line("saved activations (UNet)", entry["unit"] * first, how,
                              f"{entry['unit']:.2f} x rows x latent pixels x channels x {s.activation_bytes} B"))
            continue
        c = entry["blocks"].get(bl.name)
        if c is None:
            raise ConfigError(f"config key 'model.id': {ACTIVATIONS.name} has no block list {bl.name!r} for {s.family!r}")
        lines.append(Line(f"saved activations: {bl.count} x {bl.name}", c * n * s.activation_bytes * bl.count / cp, how,
                          f"{c:.2f} x rows x tokens x width x {s.activation_bytes} B per block{split}"))
    lines.append(Line("saved activations outside the blocks", entry["outside"] * first, how))
    lines.append(Line("backward working set", max(entry["transient"], 0.0) * first, how))
    return lines


# ---- the plan ---------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def plan(s: Settings) -> Plan:
    """The per-GPU memory of the run ``s`` describes (every process holds the same)."""
    count = count_model(s.model_id, s.family, s.rewards)
    wbytes = DTYPE_BYTES[s.dtype]
    shards = s.gpus if s.gpus > 1 else 1
    fsdp = s.fsdp and shards > 1
    denoiser_params = sum(p[2] for p in count.parts if p[1] == "denoiser")
    denoiser_buffers = sum(p[3] for p in count.parts if p[1] == "denoiser")
    if s.lora:
        trainable = _lora_count(s.model_id, s.family, s.targets, s.rank)
    else:
        trainable = denoiser_params
    frozen_denoiser = denoiser_params if s.lora else 0
    base: list[Line] = []
    denoiser_names = "+".join(count.denoisers)
    if fsdp:
        gathered = FSDP_GATHERED_BLOCKS * max((bl.params for bl in count.lists), default=0)
        weights = (frozen_denoiser * wbytes + trainable * FP32) / shards + denoiser_buffers * wbytes + gathered * wbytes
        base.append(Line(f"{denoiser_names} weights (FSDP over {shards})", weights, "counted",
                         f"{denoiser_params / 1e9:.2f}B params sharded + {FSDP_GATHERED_BLOCKS} gathered blocks (assumed)"))
    elif s.lora:
        base.append(Line(f"{denoiser_names} weights ({s.dtype})", (denoiser_params + denoiser_buffers) * wbytes, "counted",
                         f"{denoiser_params / 1e9:.2f}B params"))
    else:
        base.append(Line(f"{denoiser_names} weights (fp32, trained)", denoiser_params * FP32 + denoiser_buffers * wbytes, "counted",
                         f"{denoiser_params / 1e9:.2f}B params"))
    if s.lora and not fsdp:
        base.append(Line(f"LoRA r {s.rank} weights (fp32)", trainable * FP32, "counted", f"{trainable / 1e6:.1f}M params"))
    if s.reference and not s.lora:
        base.append(Line("frozen reference denoiser", denoiser_params * wbytes, "counted", "full fine-tuning with a KL / reference term"))
    for what, bits in s.denoiser_copies:  # OPD's fused teachers, Sol-RL's low-precision copy
        base.append(Line(f"{what} of the denoiser", denoiser_params * bits / 8, "counted" if bits >= 8 else "assumed",
                         f"{bits:g} bits per weight"))
    for name, role, params, buffers, _ in count.parts:
        if role not in ("denoiser", "text_encoder"):  # the VAE and any other frozen component
            base.append(Line(f"{name} ({s.dtype})", (params + buffers) * wbytes, "counted", f"{params / 1e6:.0f}M params"))
    for name, params, _ in count.rewards:
        base.append(Line(f"reward model {name} ({s.dtype})", params * wbytes, "counted", f"{params / 1e9:.2f}B params"))
    encoders = [(name, (params + buffers) * wbytes, params) for name, role, params, buffers, _ in count.parts if role == "text_encoder"]
    encoder_lines = [Line(f"{name} ({s.dtype})", b, "counted", f"{p / 1e9:.2f}B params") for name, b, p in encoders]
    residency = device_residency(s.text_encoders)  # what training.text_encoders keeps on the device
    if residency.encoders_between_encodings:
        base.extend(encoder_lines)

    opt_state = ADAMW_8BIT_STATE if s.use_8bit_adam else ADAMW_STATE
    opt_shards = shards if (fsdp or s.zero_stage >= 1) else 1
    grad_shards = shards if (fsdp or s.zero_stage >= 2) else 1
    state = [Line(f"optimizer states ({'8-bit AdamW' if s.use_8bit_adam else 'AdamW fp32'}"
                  f"{f', sharded over {opt_shards}' if opt_shards > 1 else ''})", trainable * opt_state / opt_shards, "counted")]
    if s.ema:
        state.append(Line("EMA of the trained weights (fp32)", trainable * FP32 / (shards if fsdp else 1), "counted"))
    grads = Line(f"gradients (fp32{f', sharded over {grad_shards}' if grad_shards > 1 else ''})", trainable * FP32 / grad_shards, "counted")

    latent_elems = _latent_elements(s)
    on_device = min(s.batch_size, s.samples_per_iteration) if s.offload_samples else s.samples_per_iteration
    trajectories = Line(f"rollout trajectories ({on_device} samples x {s.num_steps + 1} latents, fp32"
                        f"{'; the rest in CPU memory' if s.offload_samples else ''})",
                        on_device * (s.num_steps + 1) * latent_elems * FP32, "counted")

    phases: dict[str, list[Line]] = {}
    if not residency.encoders_between_encodings:
        # offload: each iteration's encodings, beside the trainable state; cache: once at start, before it exists
        placed = "each iteration" if residency.encoders_while_encoding else "once at start, before the optimizer exists"
        extra = state if residency.encoders_while_encoding else []
        phases["encode"] = [*base, *extra, *[dataclasses.replace(l, note=f"{l.note}; on the GPU {placed}") for l in encoder_lines]]
    else:
        phases["encode"] = [*base, *state]
    sample_rows = s.sample_batch_size * s.sample_cfg_rows
    phases["rollout"] = [*base, *state, trajectories,
                         *activation_lines(s, count, sample_rows, grad=False)]
    phases["decode"] = [*base, *state, trajectories, _vae_line(s)]
    train = [*base, *state, trajectories, grads, *activation_lines(s, count, s.batch_size * s.cfg_rows, grad=True)]
    if s.reference:
        train.append(dataclasses.replace(activation_lines(s, count, s.batch_size * s.cfg_rows, grad=False)[0],
                                         name="reference forward working set (no grad)"))
    phases["train"] = train
    return Plan(s, phases)


def _latent_elements(s: Settings) -> int:
    if s.model_id.startswith("tiny:"):
        return int(torch.Size(tiny_adapter(s.family).latent_shape(s.resolution, s.resolution)).numel())
    return geometry.latent_elements(s.family, s.resolution, s.options)


def vae_top_channels(config: dict) -> int:
    """Channels of a VAE decoder's full-resolution level, from its config."""
    for key in ("block_out_channels", "decoder_block_out_channels"):
        if config.get(key):
            return int(config[key][0])
    return int(config.get("base_dim", 128))


def _vae_line(s: Settings) -> Line:
    """Assumed working set of decoding a sampling batch: VAE_DECODE_MAPS full-resolution maps of the
    decoder's top-level channels for the frames decoded at once."""
    if s.model_id.startswith("tiny:"):
        config = dict(tiny_adapter(s.family).pipeline.vae.config)
    else:
        config = next(c.config for c in components.model_components(s.model_id) if c.role == "vae")
    top = vae_top_channels(config)
    px = s.resolution * s.resolution * geometry.decoded_frames(s.family, s.options)
    b = VAE_DECODE_MAPS * top * px * s.sample_batch_size * DTYPE_BYTES[s.dtype]
    return Line("VAE decode working set", b, "assumed", f"{VAE_DECODE_MAPS} maps x {top} channels x pixels of the frames decoded at once")
