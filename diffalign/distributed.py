"""DeepSpeed ZeRO-1/2 for the trainers, and xformers attention.

Without ZeRO, diffalign all-reduces the accumulated gradients itself (``training.backend.Backend.optimizer_step``).
With ``train.zero_stage`` 1 or 2 (or an accelerate config of type DEEPSPEED, which sets it) the
trainable parameters and their optimizer go through ``deepspeed.initialize`` and the engine owns
the reduction, the clipping and the sharded step. The engine is driven directly, because the
update loops accumulate a number of micro-batches per optimizer step that is only known as they go
(non-finite losses are skipped, groups with zero advantage are dropped):

- each micro-batch: ``engine.backward(loss * world)`` off the accumulation boundary. diffalign's
  losses are normalised by the *global* number of terms, so gradients must be summed over
  processes; ZeRO averages them, hence the factor ``world``. ZeRO-2 reduces into its partitions at
  every backward, ZeRO-1 at the boundary.
- the optimizer step: one backward of ``sum(p) * 0`` on the boundary closes the accumulation
  whatever the number of micro-batches before it, then ``engine.step()`` clips, steps the
  partitioned optimizer and all-gathers the updated weights.
- a poisoned step (a non-finite loss): the boundary backward carries NaN; DeepSpeed's own
  overflow check then skips the step and clears every buffer.

ZeRO-3 is refused: it partitions the weights, and the rollouts call the denoiser outside the
engine. The rollouts and evaluation read the full weights, which ZeRO-1/2 keep on every process.
Training precision: the trainable weights stay fp32 (the ZeRO master copy is fp32), the forwards
run under bf16 autocast when ``train.mixed_precision=bf16``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from diffalign.errors import ConfigError, RunDirError


def zero_stage(requested: int, accelerator, *, mixed_precision: str = "no") -> int:
    """The ZeRO stage a run uses: ``requested`` (``train.zero_stage``), or the accelerate DeepSpeed
    config's; ``mixed_precision`` is ``train.mixed_precision`` (fp16 is refused: no loss scaling)."""
    stage = int(requested)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        from accelerate.utils import DistributedType

        plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        if accelerator.distributed_type != DistributedType.DEEPSPEED or plugin is None:
            raise ConfigError("the DeepSpeed accelerate config needs CUDA GPUs (accelerate runs DeepSpeed only there); on CPU "
                              "launch with the accelerate/cpu_2proc recipe and train.zero_stage=2 (accelerate launch "
                              "--config_file \"$(diffalign recipes path accelerate/cpu_2proc)\" -m diffalign.cli train ...)")
        theirs = int(plugin.zero_stage)
        if theirs not in (1, 2):
            raise ConfigError(f"the accelerate DeepSpeed config asks for zero_stage {theirs}; diffalign supports ZeRO-1 and "
                              "ZeRO-2 (ZeRO-3 partitions the weights the rollouts read)")
        if stage and stage != theirs:
            raise ConfigError(f"config key 'train.zero_stage' ({stage}) disagrees with the accelerate DeepSpeed config "
                              f"(zero_stage {theirs})")
        offload = (plugin.deepspeed_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
        if str(offload.get("device", "none")).lower() not in ("none", "null", ""):
            raise ConfigError("the accelerate DeepSpeed config offloads the optimizer; diffalign's ZeRO path does not "
                              "support offloading (set offload_optimizer_device: none)")
        stage = theirs
    if stage and accelerator.num_processes == 1:
        return 0  # nothing to shard: the plain optimizer is the same computation
    if stage and mixed_precision == "fp16":
        raise ConfigError("config key 'train.mixed_precision' fp16 is not supported with ZeRO (no loss scaling); use bf16")
    return stage


def deepspeed_config(stage: int, world: int, *, batch_size: int, grad_clip: float) -> dict:
    """The DeepSpeed config of a run: ``batch_size`` is ``train.batch_size`` (per process),
    ``grad_clip`` ``optim.grad_clip``."""
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,  # boundaries are set by hand (see the module doc)
        "train_batch_size": batch_size * world,
        "zero_optimization": {"stage": stage, "contiguous_gradients": True, "overlap_comm": False, "reduce_scatter": True},
        "gradient_clipping": float(grad_clip),
        "zero_allow_untested_optimizer": True,  # torch AdamW or SGD, bitsandbytes AdamW8bit
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},  # fp32 master weights; forwards use autocast
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def initialize(denoiser: torch.nn.Module, optimizer, stage: int, world: int, *, batch_size: int, grad_clip: float):
    """Wrap ``optimizer`` (over the denoiser's trainable parameters) in a ZeRO engine
    (``batch_size``, ``grad_clip``: see :func:`deepspeed_config`)."""
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(f"config key 'train.zero_stage' {stage} needs deepspeed (pip install 'diffalign[deepspeed]')") from None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("config key 'train.zero_stage' needs a multi-process launch (accelerate launch --config_file "
                          "\"$(diffalign recipes path accelerate/ddp)\" -m diffalign.cli train ...; accelerate/cpu_2proc on CPU)")
    engine, zero_optimizer, _, _ = deepspeed.initialize(model=denoiser, optimizer=optimizer,
                                                        config=deepspeed_config(stage, world, batch_size=batch_size, grad_clip=grad_clip),
                                                        dist_init_required=False)
    return engine, zero_optimizer


def _touch_all(params) -> torch.Tensor:
    return sum((p * 0).sum() for p in params)


def backward(engine, loss: torch.Tensor, world: int) -> None:
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(loss * world, scale_wrt_gas=False)


def step(engine, params) -> tuple[float, bool]:
    """Close the accumulation, step; returns (grad norm before clipping, applied)."""
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(_touch_all(params), scale_wrt_gas=False)
    engine.step()
    norm = engine.get_global_grad_norm()
    norm = float(norm) if norm is not None else float("nan")
    applied = bool(engine.was_step_applied())
    return (norm if applied else float("inf")), applied


def discard(engine, params) -> None:
    """Drop the accumulated gradients: a NaN boundary backward makes DeepSpeed skip the step."""
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(_touch_all(params) * float("nan"), scale_wrt_gas=False)
    engine.step()
    if engine.was_step_applied():  # cannot happen with DeepSpeed's overflow check; never step on NaN silently
        raise RuntimeError("DeepSpeed applied an optimizer step with NaN gradients")


def gather_optimizer_state(zero_optimizer, is_main: bool) -> dict | None:
    """Every process's ZeRO partition, gathered on the main process (a collective)."""
    import torch.distributed as dist

    local = _plain_zero_state(to_full(zero_optimizer.state_dict()))  # plain tensors and data: on the CPU
    parts = [None] * dist.get_world_size() if is_main else None
    dist.gather_object(local, parts, dst=0)
    if not is_main:
        return None
    return {"zero_stage": int(local.get("zero_stage", 0)) or None, "partitions": parts}


def _plain_zero_state(state: dict) -> dict:
    """A ZeRO optimizer state with DeepSpeed's objects as data (checkpoints hold no pickled objects):
    the loss scaler as its attributes, the parameter slice mappings as (numel, start) pairs."""
    out = dict(state)
    if "loss_scaler" in out and not isinstance(out["loss_scaler"], dict):
        out["loss_scaler"] = {k: v for k, v in vars(out["loss_scaler"]).items() if isinstance(v, (bool, int, float, str, type(None)))}
    if "param_slice_mappings" in out:
        out["param_slice_mappings"] = [{name: [int(a.numel), int(a.start)] for name, a in group.items()}
                                       for group in out["param_slice_mappings"]]
    if "zero_stage" in out:
        out["zero_stage"] = int(out["zero_stage"])
    return out


def _restore_zero_state(zero_optimizer, state: dict) -> dict:
    """The inverse of :func:`_plain_zero_state`, with the optimizer's own objects as templates."""
    import copy

    from deepspeed.utils.tensor_fragment import fragment_address

    out = dict(state)
    if isinstance(out.get("loss_scaler"), dict):
        scaler = copy.copy(zero_optimizer.loss_scaler)
        scaler.__dict__.update(out["loss_scaler"])
        out["loss_scaler"] = scaler
    if "param_slice_mappings" in out:
        out["param_slice_mappings"] = [{name: fragment_address(numel=n, start=s) for name, (n, s) in group.items()}
                                       for group in out["param_slice_mappings"]]
    return out


def is_zero_state(state: Any) -> bool:
    return isinstance(state, dict) and "partitions" in state and "zero_stage" in state


def load_optimizer_state(zero_optimizer, state: dict, where: str) -> None:
    import torch.distributed as dist

    if not is_zero_state(state):
        raise RunDirError(f"checkpoint {where!r} holds a plain optimizer state; resume it without ZeRO (train.zero_stage=0)")
    world = dist.get_world_size()
    if len(state["partitions"]) != world:
        raise RunDirError(f"checkpoint {where!r} was written by {len(state['partitions'])} ZeRO processes; resume it with "
                          f"the same number (this launch has {world})")
    partitions = [_restore_zero_state(zero_optimizer, part) for part in state["partitions"]]
    zero_optimizer.load_state_dict(partitions, load_optimizer_states=True, load_from_fp32_weights=True)


def end_process_group() -> None:
    """End the process groups of a launched run, on every process at the same point (nothing to do
    without one): a barrier, so that every collective issued so far has finished on every process
    and none leaves while another still talks to it, then ``destroy_process_group``. The command
    line then leaves without the interpreter's shutdown (``diffalign.cli._exit``): gloo's threads
    outlive ``destroy_process_group`` (the FSDP2 device mesh and the sharded modules still hold the
    group), and tearing them down while Python finalizes can end in ``std::terminate`` ("terminate
    called without an active exception", SIGABRT) after a run that had finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def enable_xformers(adapter) -> None:
    """Memory-efficient attention from xformers for the pipeline (CUDA only)."""
    if not torch.cuda.is_available():
        raise ConfigError("config key 'train.attention' xformers needs a CUDA GPU; use 'default' (PyTorch SDPA) on CPU")
    try:
        import xformers  # noqa: F401
    except ImportError:
        raise ConfigError("config key 'train.attention' xformers needs xformers (pip install 'diffalign[gpu]')") from None
    adapter.pipeline.enable_xformers_memory_efficient_attention()




# ---- FSDP (torch's fully_shard) -------------------------------------------------------------------
# Parameters are sharded at rest and all-gathered per block for every forward, so *every process
# must run the same forwards*: the update loops pad their micro-batches to the global maximum with
# zero-loss forwards (Trainer.lockstep_counts), evaluation runs on every process, and checkpoints
# and exports gather the full tensors collectively.

def fsdp_requested(fsdp: bool, zero_stage: int = 0) -> bool:
    """``fsdp`` (``train.fsdp``), or a launch with accelerate's FSDP config (which sets
    ACCELERATE_USE_FSDP); refused beside a ZeRO stage (``train.zero_stage``)."""
    on = bool(fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if on and zero_stage:
        raise ConfigError("config keys 'train.fsdp' and 'train.zero_stage' exclude each other; pick one")
    return on


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _env_flag(name: str, default: bool, key: str) -> bool:
    value = os.environ.get(name, str(default)).strip().lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"the accelerate FSDP config sets {key}: {value!r}; diffalign's FSDP2 needs true or false")
    return value in _TRUE


@dataclass(frozen=True)
class FsdpSettings:
    """What diffalign takes from an accelerate FSDP2 config (``fsdp_config``)."""

    reshard_after_forward: bool = True  # free the gathered weights of a block after its forward (re-gathered for backward)


def fsdp_settings() -> FsdpSettings:
    """The FSDP settings of this launch. accelerate's launcher turns an FSDP config's ``fsdp_config``
    into ``FSDP_*`` variables (the same ones its own FullyShardedDataParallelPlugin reads); under
    ``train.fsdp`` with another launch there are none and the defaults hold. diffalign shards with
    torch's ``fully_shard`` (FSDP2) itself, so ``fsdp_version`` 1 and the keys that would change what
    is computed or stored without diffalign doing it (parameter offload, FSDP's activation
    checkpointing) are refused with one line rather than ignored."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return FsdpSettings()
    version = os.environ.get("FSDP_VERSION", "1")  # accelerate's default when the config has no fsdp_version
    if version != "2":
        raise ConfigError(f"the accelerate FSDP config asks for fsdp_version {version}; diffalign shards with FSDP2 "
                          "(torch's fully_shard): set fsdp_version: 2 (as configs/accelerate/fsdp.yaml does)")
    if _env_flag("FSDP_OFFLOAD_PARAMS", False, "fsdp_offload_params"):
        raise ConfigError("the accelerate FSDP config sets fsdp_offload_params: true; diffalign's FSDP keeps the "
                          "parameters on the device (set it to false)")
    if _env_flag("FSDP_ACTIVATION_CHECKPOINTING", False, "fsdp_activation_checkpointing"):
        raise ConfigError("the accelerate FSDP config sets fsdp_activation_checkpointing: true; set it to false and "
                          "use the run config key 'train.gradient_checkpointing' instead")
    return FsdpSettings(reshard_after_forward=_env_flag("FSDP_RESHARD_AFTER_FORWARD", True, "fsdp_reshard_after_forward"))


def shard_denoiser(denoiser: torch.nn.Module, device: torch.device, world: int,
                   settings: FsdpSettings = FsdpSettings()) -> list:
    """``fully_shard`` every block of the denoiser's block lists, then the denoiser itself. Returns
    the FSDP units. Gradients are summed over processes (diffalign normalises losses globally)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    units = []
    for child in denoiser.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                if any(True for _ in block.parameters()):
                    fully_shard(block, mesh=mesh, reshard_after_forward=settings.reshard_after_forward)
                    units.append(block)
    fully_shard(denoiser, mesh=mesh, reshard_after_forward=settings.reshard_after_forward)
    units.append(denoiser)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return units


def is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def to_full(obj: Any) -> Any:
    """Replace every DTensor in a nested structure by its full tensor on the CPU (a collective:
    every process walks the same structure in the same order)."""
    if is_dtensor(obj):
        return obj.full_tensor().detach().cpu().clone()  # own storage (safetensors reads it)
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_full(v) for v in obj)
    return obj


def shard_like(full: torch.Tensor, like) -> torch.Tensor:
    """A full tensor laid out like ``like`` (a DTensor: this process's shard), else moved to its device."""
    if is_dtensor(like):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements)
    return full.to(like.device)


def shard_optimizer_state(saved: dict, optimizer) -> dict:
    """A full-tensor optimizer state dict re-laid out like the optimizer's (DTensor) parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for idx, entry in saved["state"].items():
        p = params[int(idx)]
        state[idx] = {k: (shard_like(v, p) if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(p.shape)
                          else v) for k, v in entry.items()}
    return {"state": state, "param_groups": saved["param_groups"]}


def fsdp_grad_norm_clip(params, max_norm: float) -> float:
    """Global gradient norm (and clipping when max_norm > 0) over sharded gradients."""
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if is_dtensor(norm):
        norm = norm.full_tensor()
    return float(norm)


@contextlib.contextmanager
def full_parameters(module: torch.nn.Module, swap: bool = True):
    """Every process gathers the full parameters (a collective); where ``swap``, the module holds
    them as plain tensors inside the block (for export through diffusers / peft), its sharded
    parameters are put back after. No forward may run inside."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():  # the root stays unsharded after a forward: reshard first, or its
        if isinstance(unit, FSDPModule):  # state-dict hook would re-register the sharded parameters
            unit.reshard()
    full = {n: to_full(p) for n, p in module.named_parameters()}
    saved = []
    if swap:
        for name, tensor in full.items():
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            saved.append((owner, attr, owner._parameters[attr]))
            owner._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    try:
        yield
    finally:
        for owner, attr, param in saved:
            owner._parameters[attr] = param


# ---- context parallelism (diffusers' ContextParallelConfig, Ulysses attention) ---------------------
# ``train.context_parallel`` = C splits every sample's tokens over C processes; with W processes the
# run has W / C data-parallel groups. Ranks r = d * C + c: the C consecutive ranks of data-parallel
# group d hold one sample's tokens (on 8 GPUs of one node with C = 2: pairs of neighbouring GPUs).
# diffusers does the splitting: the transformer's ``_cp_plan`` hooks cut its inputs (and RoPE tables)
# along the sequence, its attention runs as Ulysses attention (all-to-all from a slice of the tokens
# with all heads to all the tokens with a slice of the heads, and back), and the output projection
# all-gathers the tokens again. Every process of a group therefore sees the whole output and computes
# the same loss; the gather's backward keeps each process's own tokens, so each process's parameter
# gradients are the part that flows through its tokens, and their sum over the group is the
# gradient of the whole sample. diffalign's losses are divided by the number of terms over the
# data-parallel groups and the gradients summed over all W processes: the same update as W / C
# processes without context parallelism.

#: families whose transformer has a diffusers ``_cp_plan`` that trains (forward and backward) with
#: Ulysses attention on the native (PyTorch SDPA) backend; tested in tests/test_context_parallel.py
CONTEXT_PARALLEL_FAMILIES = ("flux", "flux_kontext", "flux2", "qwen", "qwen_edit", "wan")

#: families refused with a reason other than "no ``_cp_plan``"
_CONTEXT_PARALLEL_REFUSED = {
    "ltx": "its attention processor expands the text mask to every head, which diffusers' Ulysses attention "
           "(heads / degree per process) cannot broadcast",
}


def context_parallel_problem(family: str, degree: int) -> str | None:
    """Why ``family`` cannot train with ``train.context_parallel`` = ``degree``; None when it can
    (``degree`` 1 always can)."""
    if degree == 1 or family in CONTEXT_PARALLEL_FAMILIES:
        return None
    reason = _CONTEXT_PARALLEL_REFUSED.get(family, "its diffusers transformer has no context-parallel plan (_cp_plan)")
    return (f"config key 'train.context_parallel' {degree}: model family {family!r} does not support context "
            f"parallelism ({reason}); supported: {', '.join(CONTEXT_PARALLEL_FAMILIES)}")


@dataclass(frozen=True)
class ProcessLayout:
    """Where a process sits when ``degree`` processes share each sample: ``rank`` of ``world``
    processes, in data-parallel group ``dp_rank`` of ``dp_world``, holding token slice ``cp_rank``."""

    rank: int = 0
    world: int = 1
    degree: int = 1  # train.context_parallel

    @property
    def dp_world(self) -> int:
        return self.world // self.degree

    @property
    def dp_rank(self) -> int:
        return self.rank // self.degree

    @property
    def cp_rank(self) -> int:
        return self.rank % self.degree


def process_layout(rank: int, world: int, degree: int) -> ProcessLayout:
    """The :class:`ProcessLayout` of ``rank``; the launch's process count must be a multiple of ``degree``."""
    if world % degree:
        raise ConfigError(f"config key 'train.context_parallel' {degree} must divide the number of processes ({world})")
    return ProcessLayout(rank, world, degree)


def context_parallel_split(tokens: int, degree: int, what: str = "tokens per sample") -> int:
    """Tokens per process when ``tokens`` tokens of a sample are split over ``degree`` processes:
    diffusers splits into equal parts (its Ulysses attention for any length has no backward), so
    ``tokens`` must be a multiple of ``degree``. What a memory estimate divides by ``degree``: each
    process's activations of the transformer blocks (hidden states, Q/K/V, MLP) hold
    ``tokens / degree`` tokens; the attention itself runs on all the tokens for ``heads / degree``
    heads; the output after the final projection is gathered whole on every process."""
    if tokens % degree:
        raise ConfigError(f"config key 'train.context_parallel' {degree}: {tokens} {what} do not split into "
                          f"{degree} equal parts")
    return tokens // degree


def one_per_context_group(gathered: torch.Tensor, layout: ProcessLayout) -> torch.Tensor:
    """Rows of a tensor gathered from every process (``(world * n, ...)``, process order) that the
    data-parallel groups hold, once each: the processes of a group hold the same samples."""
    if layout.degree == 1:
        return gathered
    return gathered.reshape(layout.world, -1, *gathered.shape[1:])[::layout.degree].flatten(0, 1)


def context_parallel_mesh(layout: ProcessLayout, device: torch.device):
    """The device mesh ``(dp, ring, ulysses)`` = ``(W / C, 1, C)`` (a collective: every process
    builds it): diffusers reads its ``ring`` and ``ulysses`` dimensions."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (layout.dp_world, 1, layout.degree), mesh_dim_names=("dp", "ring", "ulysses"))


def enable_context_parallel(transformers: list[torch.nn.Module], layout: ProcessLayout, device: torch.device) -> None:
    """Split each of ``transformers`` (a family's diffusers transformers: Wan2.2 has two) over the
    ``layout.degree`` processes of this process's group with diffusers' ``ContextParallelConfig``
    (Ulysses degree C; ring attention needs an attention backend that returns the log-sum-exp,
    which the native SDPA backend does not). Every process calls it, in the same order.

    On an accelerator this is ``ModelMixin.enable_parallelism``. Without one, diffusers 0.42's
    ``_resolve_parallel_config`` picks the device as ``rank % torch.accelerator.device_count()``, a
    division by zero on a CPU-only torch; the same steps are then taken here with the CPU as the
    device: the config set up on the mesh, every attention processor given it, and the model's
    ``_cp_plan`` applied (``apply_context_parallel``)."""
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    for transformer in transformers:  # on every process before the first collective: all stop alike
        heads = getattr(transformer.config, "num_attention_heads", None)
        if heads is not None:
            context_parallel_split(heads, layout.degree, "attention heads")
    mesh = context_parallel_mesh(layout, device)
    for transformer in transformers:
        config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=layout.degree, mesh=mesh))
        if device.type != "cpu":
            transformer.enable_parallelism(config=config)
            continue
        config.setup(layout.rank, layout.world, device, mesh=mesh)
        for module in transformer.modules():
            if isinstance(module, (Attention, MochiAttention, AttentionModuleMixin)) and hasattr(module.processor, "_parallel_config"):
                module.processor._parallel_config = config
        apply_context_parallel(transformer, config.context_parallel_config, transformer._cp_plan)
        transformer._parallel_config = config
