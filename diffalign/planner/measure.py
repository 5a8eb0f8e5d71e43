"""Measured activation memory: what a training micro-batch of a denoiser keeps alive, block by block.

:class:`AllocationTracker` follows every tensor storage that an operation creates while it is active
(a ``TorchDispatchMode`` sees every op, forward, backward and optimizer alike, on the calling
thread, which is where CPU autograd runs) and frees it when the storage's Python object is
collected (storages keep one Python object for their lifetime). Its ``current`` is the live bytes
created inside the block, ``peak`` their maximum: the CPU counterpart of
``torch.cuda.max_memory_allocated``, minus what the kernels allocate and free internally.

:func:`measure_step` runs one training micro-batch the way the trainer does (the policy's LoRA or
full fine-tuning from :func:`diffalign.training.policy.prepare_denoiser`, ``adapter.predict`` with
CFG in one batched forward, backward, the optimizer of :func:`diffalign.training.backend.make_optimizer`)
after a first step that creates the optimizer states, and reports:

- ``blocks``: per block list (a ``ModuleList`` child of the denoiser), the bytes each block's
  forward leaves alive (its saved tensors and output), with the rows, tokens and width its hidden
  states had: activations per block = ``c * rows * tokens * width * element_bytes``;
- ``outside``: what the rest of the forward leaves alive (embeddings, final layer, the loss);
- ``transient``: the step's peak above the forward's retained bytes and the gradients (the working
  set of the backward);
- ``static``: weights, buffers, optimizer states and the inputs, alive before the step.

A UNet (``block_out_channels`` in its config) is measured as one unit whose tokens are latent
pixels and whose width is its first level's channels.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from diffalign.training.backend import make_optimizer
from diffalign.training.policy import EMA, prepare_denoiser

MEASURE_ELEMENT_BYTES = 4  # measured in fp32
MEASURE_PROMPTS = ["a red cube on a table", "two cats", "a city at night", "a bowl of fruit"]


class AllocationTracker(TorchDispatchMode):
    """Live and peak bytes of the storages created by the ops run inside ``with`` (see the module doc)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.device.type != "meta":
                storage = x.untyped_storage()
                key = storage._cdata
                if key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


def block_lists(denoiser: torch.nn.Module) -> dict[str, torch.nn.ModuleList]:
    """The denoiser's block lists, as FSDP shards them (:func:`diffalign.distributed.shard_denoiser`):
    ``ModuleList`` children whose blocks hold parameters. Empty for a UNet, measured whole."""
    if "block_out_channels" in getattr(denoiser, "config", {}):
        return {}
    return {name: child for name, child in denoiser.named_children()
            if isinstance(child, torch.nn.ModuleList) and len(child) and any(True for _ in child[0].parameters())}


def _hidden_states(args, kwargs) -> torch.Tensor | None:
    hidden = kwargs.get("hidden_states", kwargs.get("x"))
    if hidden is None:
        hidden = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    return hidden


def _tokens(hidden: torch.Tensor, args, kwargs) -> int:
    """Token positions at the block's width: the hidden states' and any other ``(B, N, width)``
    stream that enters the block (the text stream of a joint or cross-attention block)."""
    width = hidden.shape[-1]
    streams = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.is_floating_point()
               and t.dim() == 3 and t.shape[-1] == width]
    if not any(t is hidden for t in streams):
        streams.append(hidden)
    return sum(t.shape[1] for t in streams)


@dataclass
class BlockMeasure:
    count: int  # blocks in the list
    rows: int  # batch rows of the hidden states (CFG doubles them)
    tokens: int  # token positions per row at the block's width
    width: int
    retained: list[int] = field(default_factory=list)  # bytes each block's forward left alive

    @property
    def per_block(self) -> float:
        return sum(self.retained) / max(len(self.retained), 1)


@dataclass
class StepMeasure:
    blocks: dict[str, BlockMeasure]
    outside: int
    transient: int
    gradients: int
    static: int
    peak: int  # static + the tracked peak of the step
    inference: int = 0  # peak of a no-grad forward of the same rows (a rollout's denoiser call)
    unit_tokens: int = 0  # UNet: latent pixels per row
    unit_width: int = 0
    rows: int = 0


def module_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def tensors_bytes(obj) -> int:
    return sum(t.untyped_storage().nbytes() for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))


def measure_step(adapter, cfg, *, batch_size: int | None = None, resolution: int | None = None, seed: int = 0) -> StepMeasure:
    """One training micro-batch of ``adapter`` under ``cfg`` (LoRA or full, checkpointing, CFG), measured."""
    torch.manual_seed(seed)
    batch = batch_size or cfg.train.batch_size
    res = resolution or cfg.model.resolution or adapter.default_resolution
    policy = prepare_denoiser(adapter, cfg, needs_reference=False)
    denoiser = adapter.denoiser
    denoiser.train()
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg.optim)
    ema = EMA(params, cfg.train.ema.decay, cfg.train.ema.every) if cfg.train.ema.enabled else None
    cfg_scale = cfg.sampling.guidance_scale
    prompts = (MEASURE_PROMPTS * batch)[:batch]
    embeds = adapter.encode_prompts(prompts, with_uncond=cfg_scale > 1)
    x = torch.randn(batch, *adapter.latent_shape(res, res), device=adapter.device)
    t = torch.full((batch,), 0.6, device=adapter.device)

    def step():
        loss = adapter.predict(x, t, embeds, cfg_scale).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer states exist from here on, as in every step after the first
    lists = block_lists(denoiser)
    found: dict[str, BlockMeasure] = {}
    unit: dict[str, int] = {}
    hooks = []
    tracker = AllocationTracker()
    for name, blocks in lists.items():
        for block in blocks:
            def pre(module, args, kwargs, name=name, blocks=blocks):
                module._planner_start = tracker.current
                if name not in found:
                    hidden = _hidden_states(args, kwargs)
                    found[name] = BlockMeasure(len(blocks), hidden.shape[0], _tokens(hidden, args, kwargs), hidden.shape[-1])

            def post(module, args, kwargs, output, name=name):
                found[name].retained.append(tracker.current - module._planner_start)

            hooks.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(block.register_forward_hook(post, with_kwargs=True))
    if not lists:
        def unet_pre(module, args, kwargs):
            sample = kwargs.get("sample", args[0] if args else None)
            unit.update(rows=sample.shape[0], tokens=sample.shape[-1] * sample.shape[-2])
        hooks.append(denoiser.register_forward_pre_hook(unet_pre, with_kwargs=True))
    modules = [m for m in adapter.pipeline.components.values() if isinstance(m, torch.nn.Module)]
    static = sum(module_bytes(m) for m in modules) + tensors_bytes(optimizer.state_dict()["state"]) + tensors_bytes(embeds.cond)
    static += tensors_bytes(embeds.uncond) + tensors_bytes(x) + (sum(tensors_bytes(s) for s in ema.shadow) if ema else 0)
    try:
        with tracker:
            loss = adapter.predict(x, t, embeds, cfg_scale).float().square().mean()
            forward = tracker.current
            loss.backward()
            gradients = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
        del policy
    with torch.no_grad(), AllocationTracker() as no_grad:
        adapter.predict(x, t, embeds, cfg_scale)
    in_blocks = sum(sum(b.retained) for b in found.values())
    result = StepMeasure(found, forward - in_blocks, tracker.peak - forward - gradients, gradients, static, static + tracker.peak,
                         no_grad.peak)
    if not lists:
        result.unit_tokens, result.rows = unit["tokens"], unit["rows"]
        result.unit_width = denoiser.config.block_out_channels[0]
    return result


def coefficients(m: StepMeasure) -> dict:
    """The step's activations in elements per (row x token x width) (fp32 measurements: 4 bytes an
    element): per block of each list, and outside the blocks, the backward's working set and a
    no-grad forward relative to the rows x tokens x width of the list with the most tokens x width
    (a UNet's: latent pixels x first-level channels)."""
    def per(n_bytes: float, rows: int, tokens: int, width: int) -> float:
        return round(n_bytes / (rows * tokens * width * MEASURE_ELEMENT_BYTES), 4)

    if m.blocks:
        main = max(m.blocks.values(), key=lambda b: (b.tokens * b.width, b.count))  # the widest stream
        ref = (main.rows, main.tokens, main.width)
        blocks = {name: per(b.per_block, b.rows, b.tokens, b.width) for name, b in m.blocks.items()}
        shapes = {name: {"rows": b.rows, "tokens": b.tokens, "width": b.width} for name, b in m.blocks.items()}
        entry = {"blocks": blocks, "shapes": shapes}
    else:
        ref = (m.rows, m.unit_tokens, m.unit_width)
        entry = {"unit": per(m.outside, *ref), "shapes": {"unet": {"rows": m.rows, "tokens": m.unit_tokens, "width": m.unit_width}}}
    entry.update(outside=per(m.outside, *ref) if m.blocks else 0.0, transient=per(m.transient, *ref), inference=per(m.inference, *ref))
    return entry


@torch.no_grad()
def probe_tokens(adapter, resolution: int, source_image: bool = False) -> dict[str, int]:
    """Tokens per row each block list sees (``{"unet": latent pixels}`` for a UNet), read from one
    no-grad forward of one sample: how the planner sizes a model built in code, whose latent layout
    (a tiny VAE's downsampling, its text length) is its own."""
    denoiser = adapter.denoiser
    lists = block_lists(denoiser)
    seen: dict[str, int] = {}
    hooks = []
    for name, blocks in lists.items():
        def pre(module, args, kwargs, name=name):
            if name not in seen:
                seen[name] = _tokens(_hidden_states(args, kwargs), args, kwargs)
        hooks.append(blocks[0].register_forward_pre_hook(pre, with_kwargs=True))
    if not lists:
        def unet_pre(module, args, kwargs):
            sample = kwargs.get("sample", args[0] if args else None)
            seen["unet"] = sample.shape[-1] * sample.shape[-2]
        hooks.append(denoiser.register_forward_pre_hook(unet_pre, with_kwargs=True))
    try:
        embeds = adapter.encode_prompts(MEASURE_PROMPTS[:1], with_uncond=False)
        x = torch.randn(1, *adapter.latent_shape(resolution, resolution), device=adapter.device)
        adapter.predict(x, torch.full((1,), 0.6, device=adapter.device), embeds, 1.0)
    finally:
        for h in hooks:
            h.remove()
    return seen
