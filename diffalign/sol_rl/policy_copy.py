"""The low-precision copy of the policy that Sol-RL's first stage samples with.

:class:`LowPrecisionCopy` builds the copy from a live denoiser (LoRA merged into the base weights,
``nn.Linear`` layers quantised in the format :mod:`diffalign.sol_rl.quantize` resolved, sensitive
or small layers kept in the compute dtype) and re-synchronises it from the live weights after
every policy update, without reading anything from disk.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from diffalign.adapters.base import DTYPES
from diffalign.sol_rl.quantize import (
    QuantConfig,
    ResolvedFormat,
    alignment,
    module_bytes,
    quantize_linear,
    resolve_format,
    tensor_bytes,
)

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
        a = alignment(fmt, self.cfg)
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
        q = quantize_linear(layer, self.resolved.used, self.resolved.mode, self.cfg)
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
                quantized = quantize_linear(layer, self.resolved.used, self.resolved.mode, self.cfg)
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
        with adapter.swapped_denoiser(self.module):
            yield


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
