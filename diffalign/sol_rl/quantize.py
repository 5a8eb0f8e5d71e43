"""Low-precision copies of the policy: the cheap explorer of Sol-RL's first stage.

Sol-RL (two-stage rollouts, see ``docs/algorithms.md``) ranks many seeds with a quantised copy of
the sampling policy and regenerates only a contrastive subset at full precision. This module holds
the formats: what each needs, where it runs, how one ``nn.Linear`` is quantised through a real
quantisation library. The copy itself is :mod:`diffalign.sol_rl.policy_copy`; its fidelity
against the full-precision model is :mod:`diffalign.sol_rl.fidelity`.

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

import importlib.util
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch import nn

from diffalign.errors import ConfigError

QUANT_FORMATS = ("full", "bf16", "int8", "int4", "fp8", "nvfp4", "bnb_int8", "bnb_nf4", "quanto_int8", "quanto_int4", "quanto_fp8")


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


def library_installed(name: Optional[str]) -> bool:
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
    if not library_installed(spec.library):
        return f"{spec.library} is not installed (pip install {spec.pip})"
    return None


def available_formats(device: torch.device | str = "cpu") -> dict[str, str]:
    """Every format -> ``"native"``, ``"emulated"`` or ``"unavailable: <reason>"`` on ``device``."""
    out = {}
    for name, spec in FORMATS.items():
        reason = native_status(name, device)
        if reason is None:
            out[name] = "native"
        elif spec.emulation and library_installed(spec.library):
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
        if spec.emulation and library_installed(spec.library):
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


def alignment(fmt: str, cfg: QuantConfig) -> int:
    return cfg.group_size if fmt in ("int4", "quanto_int4") else FORMATS[fmt].alignment


def quantize_linear(linear: nn.Linear, fmt: str, mode: str, cfg: QuantConfig) -> nn.Module:
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


__all__ = [
    "FORMATS", "QUANT_FORMATS", "QuantConfig", "ResolvedFormat", "UnsupportedFormatError",
    "alignment", "available_formats", "cuda_capability", "library_installed", "module_bytes",
    "native_status", "quantize_linear", "resolve_format", "tensor_bytes",
]
