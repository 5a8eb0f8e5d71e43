"""Low-precision copies of the policy: the cheap explorer of Sol-RL's first stage.

Sol-RL (two-stage rollouts, see ``docs/algorithms.md``) ranks many seeds with a quantised copy of
the sampling policy and regenerates only a contrastive subset at full precision. This module
builds that copy from a live denoiser — LoRA merged into the base weights, ``nn.Linear`` layers
quantised through a real quantisation library, sensitive or small layers kept in the compute
dtype — re-synchronises it after every policy update from the live weights (no reload from disk)
and measures its fidelity against the full-precision model.

Formats (``QuantConfig.format``):

| format        | library        | weights              | runs natively on                      | emulation elsewhere          |
|---------------|----------------|----------------------|---------------------------------------|------------------------------|
| ``full``      | -              | model dtype (merged) | anything                              | -                            |
| ``bf16``      | -              | bfloat16 (cast)      | anything                              | -                            |
| ``int8``      | torchao        | int8 per row         | CPU, CUDA (weight-only)               | -                            |
| ``int4``      | torchao        | int4, groups of 32   | CPU, CUDA (weight-only, unpacked)     | -                            |
| ``fp8``       | torchao        | float8 e4m3, per row | CUDA capability >= 8.9 (Ada, Hopper): | float8 weight-only           |
|               |                | + fp8 activations    | real FP8 matmuls                      |                              |
| ``nvfp4``     | torchao        | NVFP4 (e2m1, blocks  | CUDA capability >= 10.0 (Blackwell):  | NVFP4 weight-only (same      |
|               |                | of 16 + fp8 scales)  | real FP4 matmuls                      | weight rounding, fp matmul)  |
| ``bnb_int8``  | bitsandbytes   | LLM.int8 (no outlier)| CPU, CUDA                             | -                            |
| ``bnb_nf4``   | bitsandbytes   | NF4, blocks of 64    | CPU, CUDA                             | -                            |
| ``quanto_int8``, ``quanto_int4``, ``quanto_fp8`` | optimum-quanto | weight-only | CPU, CUDA              | -                            |

When the hardware or an installed library cannot run the requested format,
``QuantConfig.on_unsupported`` decides, before anything is sampled: ``error`` (one clear message
naming the key and the reason), ``emulate`` (the weight-only emulation where one exists: same
weight rounding, no speed-up — for measuring rank fidelity on a CPU) or ``fallback`` (the first
of ``fallback_formats`` that runs, e.g. ``[fp8, bf16]``). :func:`resolve_format` says which format
is used and why.

Only ``nn.Linear`` layers are quantised (as in the Sol-RL reference, which swaps linears for
Transformer Engine FP4 linears); convolutions, norms and embeddings stay in the compute dtype.
LoRA layers on convolutions are merged but not quantised. The report of a copy gives the share of
the denoiser's parameters that is quantised.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import importlib.util
import time
from dataclasses import dataclass, field
from typing import Iterator, Literal, Optional, Sequence

import torch
from torch import nn

from diffalign.errors import ConfigError

QUANT_FORMATS = ("full", "bf16", "int8", "int4", "fp8", "nvfp4", "bnb_int8", "bnb_nf4", "quanto_int8", "quanto_int4", "quanto_fp8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedFormatError(ConfigError):
    """The requested low-precision format cannot run here (hardware or library) and the config says error."""


# --------------------------------------------------------------------------------------------
# Formats: what each needs and how it is built
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatSpec:
    name: str
    library: Optional[str]  # importable module that must be installed (None: plain torch)
    weight_bits: float  # bits per weight, for reports (excluding scales)
    min_capability: Optional[tuple[int, int]] = None  # CUDA compute capability needed natively; None = any device
    emulation: Optional[str] = None  # how to run it where min_capability is not met (None: cannot)
    alignment: int = 1  # in/out features must be multiples of this (layers that are not are skipped)
    pip: str = ""  # what to install when the library is missing

    def hardware(self) -> str:
        if self.min_capability is None:
            return "any device"
        major, minor = self.min_capability
        gpu = {(8, 9): "an NVIDIA Ada or Hopper GPU", (10, 0): "an NVIDIA Blackwell GPU"}.get(self.min_capability, "an NVIDIA GPU")
        return f"{gpu} (CUDA compute capability >= {major}.{minor})"


FORMATS: dict[str, FormatSpec] = {
    "full": FormatSpec("full", None, 32),
    "bf16": FormatSpec("bf16", None, 16),
    "int8": FormatSpec("int8", "torchao", 8, pip="torchao"),
    "int4": FormatSpec("int4", "torchao", 4, pip="torchao"),  # alignment = group_size, see _alignment
    "fp8": FormatSpec("fp8", "torchao", 8, min_capability=(8, 9), emulation="float8 weight-only", alignment=16, pip="torchao"),
    "nvfp4": FormatSpec("nvfp4", "torchao", 4, min_capability=(10, 0), emulation="NVFP4 weight-only", alignment=16, pip="torchao"),
    "bnb_int8": FormatSpec("bnb_int8", "bitsandbytes", 8, pip="bitsandbytes"),
    "bnb_nf4": FormatSpec("bnb_nf4", "bitsandbytes", 4, alignment=2, pip="bitsandbytes"),
    "quanto_int8": FormatSpec("quanto_int8", "optimum.quanto", 8, pip="optimum-quanto"),
    "quanto_int4": FormatSpec("quanto_int4", "optimum.quanto", 4, pip="optimum-quanto"),  # alignment = group_size
    "quanto_fp8": FormatSpec("quanto_fp8", "optimum.quanto", 8, pip="optimum-quanto"),
}


def _library_installed(name: Optional[str]) -> bool:
    if name is None:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing ("optimum" for "optimum.quanto")
        return False


def cuda_capability(device: torch.device | str) -> Optional[tuple[int, int]]:
    """(major, minor) of a CUDA device, None for anything else."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def native_status(name: str, device: torch.device | str) -> Optional[str]:
    """None when ``name`` runs natively on ``device``; otherwise the reason it does not."""
    spec = FORMATS[name]
    if spec.min_capability is not None:  # the hardware first: no install fixes that
        cap = cuda_capability(device)
        if cap is None or cap < spec.min_capability:
            here = f"CUDA capability {cap[0]}.{cap[1]}" if cap else f"device {torch.device(device).type}"
            return f"{name} needs {spec.hardware()}; this is {here}"
    if not _library_installed(spec.library):
        return f"{spec.library} is not installed (pip install {spec.pip})"
    return None


def available_formats(device: torch.device | str = "cpu") -> dict[str, str]:
    """Every format -> ``"native"``, ``"emulated"`` or ``"unavailable: <reason>"`` on ``device``."""
    out = {}
    for name, spec in FORMATS.items():
        reason = native_status(name, device)
        if reason is None:
            out[name] = "native"
        elif spec.emulation and _library_installed(spec.library):
            out[name] = "emulated"
        else:
            out[name] = f"unavailable: {reason}"
    return out


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class QuantConfig:
    """The low-precision copy (``algorithm.quant`` of Sol-RL)."""

    format: Literal["full", "bf16", "int8", "int4", "fp8", "nvfp4", "bnb_int8", "bnb_nf4",
                    "quanto_int8", "quanto_int4", "quanto_fp8"] = "bf16"  # see the module docstring
    on_unsupported: Literal["error", "emulate", "fallback"] = "error"  # the format cannot run here: stop, emulate, or fall back
    fallback_formats: list[str] = field(default_factory=lambda: ["bf16"])  # tried in order when on_unsupported=fallback
    skip: list[str] = field(default_factory=list)  # module-name substrings never quantised (sensitive layers: embedders, final norm/proj)
    min_dim: int = 0  # Linear layers with max(in, out) <= min_dim stay unquantised (small layers: little gain, most error)
    group_size: int = 32  # int4 / quanto_int4 quantisation group (input features per scale)
    # auto: bfloat16 for bf16 and native fp8 / nvfp4 (their kernels take bf16 activations), else the model's dtype
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    def validate(self, prefix: str = "algorithm.quant") -> None:
        unknown = [f for f in self.fallback_formats if f not in FORMATS]
        if unknown:
            raise ConfigError(f"config key '{prefix}.fallback_formats' has unknown formats {unknown}; known: {', '.join(QUANT_FORMATS)}")
        if self.on_unsupported == "fallback" and not self.fallback_formats:
            raise ConfigError(f"config key '{prefix}.fallback_formats' must name at least one format when on_unsupported=fallback")
        if self.min_dim < 0:
            raise ConfigError(f"config key '{prefix}.min_dim' must be >= 0")
        if self.group_size < 1:
            raise ConfigError(f"config key '{prefix}.group_size' must be >= 1")


@dataclass(frozen=True)
class ResolvedFormat:
    """Which format a copy really uses. ``mode``: ``native``, ``emulated`` or ``fallback``."""

    requested: str
    used: str
    mode: str
    reason: str = ""  # why the requested format is not used natively ("" when it is)

    def describe(self) -> str:
        if self.mode == "native":
            return self.used
        if self.mode == "emulated":
            return f"{self.used} (emulated: {FORMATS[self.used].emulation}; {self.reason})"
        return f"{self.used} (fallback from {self.requested}: {self.reason})"


def resolve_format(cfg: QuantConfig, device: torch.device | str, *, key: str = "algorithm.quant") -> ResolvedFormat:
    """Decide, before anything is built or sampled, which format runs on ``device``.

    Raises :class:`UnsupportedFormatError` (a ``ConfigError``: one line naming ``key.format``)
    when the format cannot run and ``on_unsupported`` does not allow an alternative.
    """
    reason = native_status(cfg.format, device)
    if reason is None:
        return ResolvedFormat(cfg.format, cfg.format, "native")
    spec = FORMATS[cfg.format]
    if cfg.on_unsupported == "emulate":
        if spec.emulation and _library_installed(spec.library):
            return ResolvedFormat(cfg.format, cfg.format, "emulated", reason)
        if spec.emulation:
            raise UnsupportedFormatError(f"config key '{key}.format' is {cfg.format!r}, which cannot run here ({reason}); its "
                                         f"emulation needs {spec.library} (pip install {spec.pip})")
        raise UnsupportedFormatError(f"config key '{key}.format' is {cfg.format!r}, which cannot run here ({reason}) and has no "
                                     f"emulation; set {key}.on_unsupported=fallback or choose another format")
    if cfg.on_unsupported == "fallback":
        tried = []
        for name in cfg.fallback_formats:
            why = native_status(name, device)
            if why is None:
                return ResolvedFormat(cfg.format, name, "fallback", reason)
            tried.append(f"{name}: {why}")
        raise UnsupportedFormatError(f"config key '{key}.format' is {cfg.format!r}, which cannot run here ({reason}), and no "
                                     f"fallback format runs either ({'; '.join(tried)})")
    raise UnsupportedFormatError(f"config key '{key}.format' is {cfg.format!r}, which cannot run here: {reason} "
                                 f"(set {key}.on_unsupported=emulate or fallback, or choose another format)")


# --------------------------------------------------------------------------------------------
# Quantising one linear layer
# --------------------------------------------------------------------------------------------


def _alignment(fmt: str, cfg: QuantConfig) -> int:
    return cfg.group_size if fmt in ("int4", "quanto_int4") else FORMATS[fmt].alignment


def _quantize_linear(linear: nn.Linear, fmt: str, mode: str, cfg: QuantConfig) -> nn.Module:
    """Return a module computing ``linear`` with ``fmt`` weights (``linear`` may be modified in place)."""
    if fmt in ("full", "bf16"):
        return linear
    if fmt in ("int8", "int4", "fp8", "nvfp4"):
        from torchao.quantization import quantize_

        quantize_(linear, _torchao_config(fmt, mode, cfg))
        if fmt == "nvfp4":  # torchao's NVFP4 linear cannot take a non-contiguous input (attention outputs often are)
            linear.register_forward_pre_hook(_contiguous_input)
        return linear
    if fmt == "bnb_int8":
        import bitsandbytes as bnb

        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                has_fp16_weights=False, threshold=0.0)  # threshold 0: pure int8, no fp16 outlier columns
        q.weight = bnb.nn.Int8Params(linear.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        return q.to(linear.weight.device)  # .to(device) quantises the weight
    if fmt == "bnb_nf4":
        import bitsandbytes as bnb

        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=linear.weight.dtype, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type="nf4")
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        return q.to(linear.weight.device)
    if fmt.startswith("quanto_"):
        import optimum.quanto as oq
        from optimum.quanto.nn import QLinear

        qtype = {"quanto_int8": oq.qint8, "quanto_int4": oq.qint4, "quanto_fp8": oq.qfloat8}[fmt]
        q = QLinear.from_module(linear, weights=qtype)
        q.freeze()  # quantise the weights now (otherwise every forward would)
        return q
    raise ValueError(f"unknown format {fmt!r}")


def _contiguous_input(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


def _torchao_config(fmt: str, mode: str, cfg: QuantConfig):
    import torchao.quantization as tq

    if fmt == "int8":
        return tq.Int8WeightOnlyConfig()
    if fmt == "int4":
        # IntxWeightOnlyConfig runs on CPU and CUDA; torchao's packed Int4WeightOnlyConfig needs
        # extra CUDA kernels (mslk), so the unpacked form is used everywhere.
        return tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(cfg.group_size))
    if fmt == "fp8":
        if mode == "emulated":
            return tq.Float8WeightOnlyConfig()
        return tq.Float8DynamicActivationFloat8WeightConfig(granularity=tq.PerRow())
    if fmt == "nvfp4":
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig, NVFP4WeightOnlyConfig

        if mode == "emulated":
            return NVFP4WeightOnlyConfig()
        return NVFP4DynamicActivationNVFP4WeightConfig()
    raise ValueError(fmt)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held by a tensor, looking through quantised tensor subclasses (torchao, quanto)."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names if isinstance(getattr(t, n, None), torch.Tensor))
    n = t.numel() * t.element_size()
    state = getattr(t, "quant_state", None)  # bitsandbytes 4-bit: absmax per block
    absmax = getattr(state, "absmax", None)
    if isinstance(absmax, torch.Tensor):
        n += absmax.numel() * absmax.element_size()
    scb = getattr(t, "SCB", None)  # bitsandbytes int8: row scales
    if isinstance(scb, torch.Tensor):
        n += scb.numel() * scb.element_size()
    return n


def module_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    for m in module.modules():  # bitsandbytes Linear8bitLt keeps row scales on the module state
        cb = getattr(getattr(m, "state", None), "SCB", None)
        if isinstance(cb, torch.Tensor) and id(cb) not in seen:
            seen.add(id(cb))
            total += cb.numel() * cb.element_size()
    return total


# --------------------------------------------------------------------------------------------
# The copy
# --------------------------------------------------------------------------------------------


@dataclass
class CopyReport:
    """What a :class:`LowPrecisionCopy` holds."""

    format: str  # ResolvedFormat.describe()
    quantized: list[str] = field(default_factory=list)  # module names of quantised layers
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> why it stayed in the compute dtype
    quantized_param_fraction: float = 0.0  # share of the denoiser's parameters that are quantised
    bytes: int = 0  # bytes of the copy's weights
    source_bytes: int = 0  # bytes of the full-precision denoiser (base weights, LoRA excluded)
    build_seconds: float = 0.0

    def summary(self) -> str:
        return (f"{self.format}: {len(self.quantized)} layers quantised ({100 * self.quantized_param_fraction:.0f}% of the "
                f"parameters), {len(self.skipped)} kept, {self.bytes / 2**20:.1f} MiB vs {self.source_bytes / 2**20:.1f} MiB")


def _lora_adapter_names(layer) -> list[str]:
    return list(getattr(layer, "lora_A", {}).keys())


class LowPrecisionCopy:
    """A quantised, LoRA-merged, inference-only copy of ``source`` (a denoiser, possibly with peft LoRA).

    Args:
        source: the live denoiser. It is read, never modified.
        cfg: the format and skip rules.
        resolved: the format decision (default: :func:`resolve_format` on the source's device).
        adapter_name: which LoRA adapter is merged (the *sampling* policy: ``"default"``, or
            DiffusionNFT's ``"old"``). Ignored without LoRA.
        model_dtype: the dtype of the full-precision model (for ``compute_dtype: auto``).

    ``module`` is the copy; :meth:`swapped_into` puts it into an adapter's pipeline for sampling;
    :meth:`sync` re-merges and re-quantises the layers that training can change (the LoRA-wrapped
    ones, or everything for full fine-tuning) from the live weights, without touching the disk.
    """

    def __init__(self, source: nn.Module, cfg: QuantConfig, *, resolved: Optional[ResolvedFormat] = None,
                 adapter_name: str = "default", model_dtype: Optional[torch.dtype] = None):
        self.source = source
        self.cfg = cfg
        device = next(source.parameters()).device
        self.resolved = resolved or resolve_format(cfg, device)
        self.adapter_name = adapter_name
        self.model_dtype = model_dtype or _base_dtype(source)
        self.compute_dtype = self._compute_dtype()
        self.module: nn.Module = None  # type: ignore[assignment]
        self.report = CopyReport(self.resolved.describe())
        self.syncs = 0
        self._build()

    # ---- construction -------------------------------------------------------------------
    def _compute_dtype(self) -> torch.dtype:
        if self.cfg.compute_dtype != "auto":
            return DTYPES[self.cfg.compute_dtype]
        if self.resolved.used == "bf16" or (self.resolved.used in ("fp8", "nvfp4") and self.resolved.mode == "native"):
            return torch.bfloat16
        return self.model_dtype

    def _targets(self) -> dict[str, nn.Module]:
        """Leaf modules rebuilt in the copy: every LoRA-wrapped layer and every plain ``nn.Linear``."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        targets: dict[str, nn.Module] = {}
        lora_prefixes: list[str] = []
        for name, m in self.source.named_modules():
            if any(name.startswith(p + ".") for p in lora_prefixes):
                continue  # base_layer / lora_A / lora_B inside a LoRA layer
            if isinstance(m, BaseTunerLayer):
                targets[name] = m
                lora_prefixes.append(name)
            elif isinstance(m, nn.Linear):
                targets[name] = m
        return targets

    def _build(self) -> None:
        t0 = time.perf_counter()
        from peft.tuners.tuners_utils import BaseTunerLayer

        self._targets_by_name = self._targets()
        self.has_lora = any(isinstance(m, BaseTunerLayer) for m in self._targets_by_name.values())
        # Deep-copy everything except the targets' weights (placeholders in the memo): a full
        # precision duplicate of a 12B model would not fit next to it.
        memo: dict[int, object] = {}
        for m in self._targets_by_name.values():
            for p in m.parameters():
                memo[id(p)] = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
        module = copy_module.deepcopy(self.source, memo)
        module.requires_grad_(False).eval()
        _cast(module, self.compute_dtype)
        if hasattr(module, "peft_config"):  # the copy holds no adapters any more
            with contextlib.suppress(AttributeError):
                del module.peft_config
            module._hf_peft_config_loaded = False
        self.module = module
        first = next(self.source.parameters())
        self._first_owner = next((n for n, m in self._targets_by_name.items() if any(p is first for p in m.parameters())), None)
        total = sum(p.numel() for n, p in self.source.named_parameters() if "lora_" not in n)
        quantized_params = 0
        for name in self._targets_by_name:
            layer, quantized = self._rebuild(name)
            self.module.set_submodule(name, layer)
            if quantized:
                quantized_params += self._base_numel(name)
        self.report.quantized_param_fraction = quantized_params / max(total, 1)
        self.report.bytes = module_bytes(self.module)
        self.report.source_bytes = (sum(tensor_bytes(p) for n, p in self.source.named_parameters() if "lora_" not in n)
                                    + sum(tensor_bytes(b) for b in self.source.buffers()))
        self.report.build_seconds = time.perf_counter() - t0

    def _base_numel(self, name: str) -> int:
        m = self._targets_by_name[name]
        base = m.get_base_layer() if hasattr(m, "get_base_layer") else m
        return base.weight.numel()

    def _skip_reason(self, name: str, layer: nn.Module) -> Optional[str]:
        fmt = self.resolved.used
        if fmt in ("full", "bf16"):
            return None
        if not isinstance(layer, nn.Linear):
            return f"{type(layer).__name__} (only nn.Linear layers are quantised)"
        for pattern in self.cfg.skip:
            if pattern in name:
                return f"skip list ({pattern!r})"
        if self.cfg.min_dim and max(layer.in_features, layer.out_features) <= self.cfg.min_dim:
            return f"small (max(in, out) = {max(layer.in_features, layer.out_features)} <= min_dim {self.cfg.min_dim})"
        a = _alignment(fmt, self.cfg)
        if a > 1 and (layer.in_features % a or layer.out_features % a):
            return f"shape {layer.out_features}x{layer.in_features} is not a multiple of {a}"
        if name == self._first_owner:
            return "holds the denoiser's first parameter (adapters read the input dtype from it)"
        return None

    @torch.no_grad()
    def _merged(self, name: str) -> nn.Module:
        """A fresh plain layer (compute dtype, source device) with the current effective weights."""
        src = self._targets_by_name[name]
        base = src.get_base_layer() if hasattr(src, "get_base_layer") else src
        weight = base.weight.detach().float()
        if self.has_lora and hasattr(src, "get_delta_weight") and self.adapter_name in _lora_adapter_names(src):
            weight = weight + src.get_delta_weight(self.adapter_name).detach().float()
        if isinstance(base, nn.Linear):
            layer = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                              device=weight.device, dtype=self.compute_dtype)
        else:  # a LoRA-wrapped convolution (or other layer): same type, merged weight
            layer = copy_module.deepcopy(base, {id(base.weight): nn.Parameter(torch.empty(0, device="meta"))})
            _cast(layer, self.compute_dtype)
        layer.weight = nn.Parameter(weight.to(self.compute_dtype), requires_grad=False)
        if getattr(base, "bias", None) is not None:
            layer.bias = nn.Parameter(base.bias.detach().to(self.compute_dtype), requires_grad=False)
        return layer.requires_grad_(False)

    def _rebuild(self, name: str) -> tuple[nn.Module, bool]:
        layer = self._merged(name)
        reason = self._skip_reason(name, layer)
        if reason is not None:
            self.report.skipped[name] = reason
            return layer, False
        q = _quantize_linear(layer, self.resolved.used, self.resolved.mode, self.cfg)
        quantized = self.resolved.used not in ("full", "bf16")  # a plain cast is not quantisation
        if quantized:
            self.report.quantized.append(name)
        return q.requires_grad_(False), quantized

    # ---- use ----------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self) -> float:
        """Re-merge and re-quantise from the live weights; returns the seconds it took.

        With LoRA only the LoRA-wrapped layers can have changed; with full fine-tuning every
        target is rebuilt and every other parameter copied."""
        t0 = time.perf_counter()
        from peft.tuners.tuners_utils import BaseTunerLayer

        for name, src in self._targets_by_name.items():
            if self.has_lora and not isinstance(src, BaseTunerLayer):
                continue
            layer = self._merged(name)
            if name in self.report.skipped:
                self.module.set_submodule(name, layer)
            else:
                quantized = _quantize_linear(layer, self.resolved.used, self.resolved.mode, self.cfg)
                self.module.set_submodule(name, quantized.requires_grad_(False))
        if not self.has_lora:
            targets = tuple(n + "." for n in self._targets_by_name)
            own = dict(self.module.named_parameters())
            for n, p in self.source.named_parameters():
                if not n.startswith(targets) and n in own:
                    own[n].copy_(p.detach().to(own[n].dtype))
        self.syncs += 1
        return time.perf_counter() - t0

    @contextlib.contextmanager
    def swapped_into(self, adapter) -> Iterator[None]:
        """Context: ``adapter`` samples with this copy instead of its denoiser."""
        pipeline = adapter.pipeline
        denoiser = adapter.denoiser
        attr = next(name for name, module in pipeline.components.items() if module is denoiser)
        setattr(pipeline, attr, self.module)
        try:
            yield
        finally:
            setattr(pipeline, attr, denoiser)


def _cast(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point weights to ``dtype`` with ``nn.Module.to`` (diffusers' own ``to`` warns
    about fp32-pinned modules on every cast; the copy is inference-only, so that does not apply)."""
    if any(t.is_floating_point() and t.dtype != dtype for t in list(module.parameters()) + list(module.buffers())):
        nn.Module.to(module, dtype=dtype)


def _base_dtype(module: nn.Module) -> torch.dtype:
    for n, p in module.named_parameters():
        if "lora_" not in n and p.is_floating_point():
            return p.dtype
    return torch.float32


# --------------------------------------------------------------------------------------------
# Fidelity
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def velocity_error(adapter, copy: LowPrecisionCopy, x: torch.Tensor, t: torch.Tensor, embeds, guidance_scale: float) -> dict[str, float]:
    """Output error of the copy against the full-precision denoiser at ``(x, t)``.

    ``rel_l2 = ||v_copy - v|| / ||v||`` over the batch; ``cosine`` the mean per-sample cosine
    similarity; ``max_abs`` the largest absolute difference."""
    ref = adapter.predict(x, t, embeds, guidance_scale).float()
    with copy.swapped_into(adapter):
        out = adapter.predict(x, t, embeds, guidance_scale).float()
    diff = out - ref
    cos = torch.nn.functional.cosine_similarity(out.flatten(1), ref.flatten(1), dim=1)
    return {"rel_l2": float(diff.norm() / ref.norm().clamp_min(1e-12)), "cosine": float(cos.mean()),
            "max_abs": float(diff.abs().max())}


@torch.no_grad()
def fidelity_report(adapter, formats: Sequence[str], prompts: Sequence[str], *, resolution: int, num_steps: int = 6,
                    guidance_scale: float = 1.0, seed: int = 0, base: Optional[QuantConfig] = None,
                    on_unsupported: str = "emulate", adapter_name: str = "default", repeats: int = 3) -> list[dict]:
    """One row per format: how far the copy's velocity is from the full-precision model's.

    The states are those of a full-precision ODE trajectory (``num_steps`` steps, one sample per
    prompt, noise from ``seed``); at each state both models predict and the relative L2 error,
    cosine and max abs error are averaged over the steps. Formats that cannot run here are
    reported as ``skipped`` with the reason (``on_unsupported`` as in :class:`QuantConfig`).
    Rows also hold the layer counts, the quantised parameter share, bytes, build and re-sync
    seconds, and the median seconds per copy forward vs per full-precision forward (``repeats``
    timed forwards each, after one warm-up).
    """
    from diffalign.sampling import build_kernel

    base = base or QuantConfig()
    device = adapter.device
    embeds = adapter.encode_prompts(list(prompts), with_uncond=guidance_scale > 1)
    gen = torch.Generator("cpu").manual_seed(seed)
    x = torch.randn((len(prompts), *adapter.latent_shape(resolution, resolution)), generator=gen).to(device)
    schedule = adapter.make_schedule(num_steps, resolution, resolution)
    kernel = build_kernel(adapter, "ddim" if adapter.prediction_type == "epsilon" else "flow_grpo", 0.0)
    states = []
    for i in range(num_steps):
        t = schedule[i].expand(len(prompts)).to(device)
        states.append((x, t))
        v = adapter.predict(x, t, embeds, guidance_scale)
        x = kernel.step(v, x, t, schedule[i + 1].expand(len(prompts)).to(device), sde=False).prev_sample.float()
    rows = []
    for fmt in formats:
        cfg = QuantConfig(**{**base.__dict__, "format": fmt, "on_unsupported": on_unsupported})
        try:
            resolved = resolve_format(cfg, device)
        except UnsupportedFormatError as exc:
            rows.append({"format": fmt, "status": "skipped", "reason": str(exc)})
            continue
        copy = LowPrecisionCopy(adapter.denoiser, cfg, resolved=resolved, adapter_name=adapter_name, model_dtype=adapter.dtype)
        errs = [velocity_error(adapter, copy, xs, ts, embeds, guidance_scale) for xs, ts in states]
        sync_s = copy.sync()
        t_copy = _time_forward(adapter, states[0], embeds, guidance_scale, copy, repeats)
        t_full = _time_forward(adapter, states[0], embeds, guidance_scale, None, repeats)
        rows.append({
            "format": fmt, "status": resolved.mode, "used": resolved.used, "reason": resolved.reason,
            "rel_l2": float(sum(e["rel_l2"] for e in errs) / len(errs)),
            "rel_l2_max": max(e["rel_l2"] for e in errs),
            "cosine": float(sum(e["cosine"] for e in errs) / len(errs)),
            "max_abs": max(e["max_abs"] for e in errs),
            "quantized_layers": len(copy.report.quantized), "kept_layers": len(copy.report.skipped),
            "quantized_param_fraction": copy.report.quantized_param_fraction,
            "bytes": copy.report.bytes, "source_bytes": copy.report.source_bytes,
            "build_s": copy.report.build_seconds, "sync_s": sync_s,
            "forward_s": t_copy, "full_forward_s": t_full,
        })
    return rows


def _time_forward(adapter, state, embeds, guidance_scale, copy: Optional[LowPrecisionCopy], repeats: int = 3) -> float:
    x, t = state
    ctx = copy.swapped_into(adapter) if copy is not None else contextlib.nullcontext()
    with ctx:
        adapter.predict(x, t, embeds, guidance_scale)  # warm-up (lazy kernels, caches)
        times = []
        for _ in range(repeats):
            _sync_device(x.device)
            t0 = time.perf_counter()
            adapter.predict(x, t, embeds, guidance_scale)
            _sync_device(x.device)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_fidelity_table(rows: Sequence[dict]) -> str:
    """Plain-text table of :func:`fidelity_report` rows."""
    head = f"{'format':<12} {'status':<9} {'rel L2':>8} {'cosine':>8} {'quant %':>8} {'MiB':>8} {'fwd ms':>8} {'x full':>7} {'sync ms':>8}"
    lines = [head]
    for r in rows:
        if r["status"] == "skipped":
            lines.append(f"{r['format']:<12} skipped   {r['reason']}")
            continue
        lines.append(f"{r['format']:<12} {r['status']:<9} {r['rel_l2']:>8.4f} {r['cosine']:>8.4f} {100 * r['quantized_param_fraction']:>8.0f} "
                     f"{r['bytes'] / 2**20:>8.2f} {1000 * r['forward_s']:>8.1f} {r['forward_s'] / max(r['full_forward_s'], 1e-12):>7.2f} "
                     f"{1000 * r['sync_s']:>8.1f}")
    return "\n".join(lines)


__all__ = [
    "FORMATS", "QUANT_FORMATS", "QuantConfig", "ResolvedFormat", "UnsupportedFormatError", "LowPrecisionCopy", "CopyReport",
    "available_formats", "native_status", "resolve_format", "cuda_capability", "velocity_error", "fidelity_report",
    "format_fidelity_table", "tensor_bytes", "module_bytes",
]
