"""The low-precision policy copy (diffalign.sol_rl): formats, fidelity, skip rules, re-sync.

Every format that runs here (natively or emulated) is built from a tiny SD3 with a trained-looking
LoRA and compared with the full-precision model; formats that need hardware this machine lacks
(FP8 on Hopper, NVFP4 on Blackwell) are skipped with their reason, and their error / fallback /
emulation paths are tested instead.
"""

import importlib.util

import pytest
import torch
from peft import LoraConfig

from diffalign.sol_rl import fidelity
from diffalign.sol_rl import quantize as q
from diffalign.adapters import load_adapter
from diffalign.errors import ConfigError
from diffalign.sol_rl.fidelity import velocity_error
from diffalign.sol_rl.policy_copy import LowPrecisionCopy
from diffalign.sol_rl.quantize import QuantConfig, UnsupportedFormatError, resolve_format

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None

# Relative L2 error of the velocity allowed per format on the tiny SD3 (measured: full 0, bf16 0.006,
# int8 0.003, fp8 0.023, nvfp4 0.09, nf4 0.08, int4 0.01): loose enough for other CPUs, tight
# enough that a wrong merge or a broken layer (errors of order 1) fails.
TOLERANCE = {"full": 1e-5, "bf16": 0.03, "int8": 0.03, "int4": 0.1, "fp8": 0.1, "nvfp4": 0.3, "bnb_int8": 0.03,
             "bnb_nf4": 0.3, "quanto_int8": 0.03, "quanto_int4": 0.1, "quanto_fp8": 0.1}


def _with_lora(adapter, *, seed=0, adapter_name="default"):
    adapter.denoiser.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                            target_modules=list(adapter.default_lora_targets)), adapter_name=adapter_name)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in adapter.denoiser.named_parameters():
            if "lora_B" in n and f".{adapter_name}." in n:  # B starts at 0: make the LoRA matter
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return adapter


@pytest.fixture(scope="module")
def sd3_lora():
    adapter = _with_lora(load_adapter("tiny:sd3"))
    embeds = adapter.encode_prompts(["a cat", "a dog"], with_uncond=False)
    x = torch.randn((2, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(1))
    return adapter, embeds, x, torch.tensor([0.7, 0.4])


def _runs_here(fmt: str) -> bool:
    return not q.available_formats("cpu")[fmt].startswith("unavailable")


@pytest.mark.parametrize("fmt", q.QUANT_FORMATS)
def test_copy_matches_the_policy_within_the_format_error(sd3_lora, fmt):
    if not _runs_here(fmt):
        pytest.skip(q.available_formats("cpu")[fmt])
    adapter, embeds, x, t = sd3_lora
    cfg = QuantConfig(format=fmt, on_unsupported="emulate", group_size=16)  # tiny widths are 16 / 32
    copy = LowPrecisionCopy(adapter.denoiser, cfg)
    err = velocity_error(adapter, copy, x, t, embeds, 1.0)
    assert err["rel_l2"] <= TOLERANCE[fmt], (fmt, err)
    if fmt in ("full", "bf16"):
        assert copy.report.quantized == []
    else:  # something was really quantised, and it shows in the output and in the bytes
        assert copy.report.quantized and copy.report.quantized_param_fraction > 0.5
        assert err["rel_l2"] > 0
        assert copy.report.bytes < copy.report.source_bytes
    # the copy is a separate, frozen module: the policy's own weights are untouched
    assert not any(p.requires_grad for p in copy.module.parameters())
    assert not any("lora_" in n for n, _ in copy.module.named_parameters())


def test_full_copy_merges_lora_exactly_and_quantised_copy_differs(sd3_lora):
    adapter, embeds, x, t = sd3_lora
    full = LowPrecisionCopy(adapter.denoiser, QuantConfig(format="full"))
    ref = adapter.predict(x, t, embeds)
    with full.swapped_into(adapter):
        out = adapter.predict(x, t, embeds)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # without the LoRA delta the output is measurably different: the merge is what matches
    adapter.denoiser.disable_adapters()
    try:
        base = adapter.predict(x, t, embeds)
    finally:
        adapter.denoiser.enable_adapters()
    assert (base - ref).norm() / ref.norm() > 1e-3


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_resync_follows_the_policy_without_reloading(sd3_lora, monkeypatch):
    adapter, embeds, x, t = sd3_lora
    denoiser = adapter.denoiser
    saved = {n: p.detach().clone() for n, p in denoiser.named_parameters() if "lora_B" in n}
    copy = LowPrecisionCopy(denoiser, QuantConfig(format="int8"))
    before = velocity_error(adapter, copy, x, t, embeds, 1.0)["rel_l2"]
    try:
        with torch.no_grad():  # a policy update
            for n, p in denoiser.named_parameters():
                if "lora_B" in n:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.2)
        stale = velocity_error(adapter, copy, x, t, embeds, 1.0)["rel_l2"]
        assert stale > 5 * before  # the copy still holds the old policy
        for name in ("load", "load_file"):  # a re-sync must not read anything from disk
            monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("sync read a checkpoint"))
        import safetensors.torch

        monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("sync read a file"))
        seconds = copy.sync()
        assert seconds >= 0 and copy.syncs == 1
        after = velocity_error(adapter, copy, x, t, embeds, 1.0)["rel_l2"]
        assert after <= TOLERANCE["int8"] and after < stale / 5
    finally:
        with torch.no_grad():
            for n, p in denoiser.named_parameters():
                if n in saved:
                    p.copy_(saved[n])


def test_copy_of_a_named_adapter_merges_that_adapter():
    adapter = _with_lora(load_adapter("tiny:sd3"))
    _with_lora(adapter, seed=7, adapter_name="old")
    adapter.denoiser.set_adapter("default")
    embeds = adapter.encode_prompts(["a cat"], with_uncond=False)
    x = torch.randn((1, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.5])
    copy_old = LowPrecisionCopy(adapter.denoiser, QuantConfig(format="full"), adapter_name="old")
    copy_default = LowPrecisionCopy(adapter.denoiser, QuantConfig(format="full"), adapter_name="default")
    v_default = adapter.predict(x, t, embeds)
    adapter.denoiser.set_adapter("old")
    v_old = adapter.predict(x, t, embeds)
    adapter.denoiser.set_adapter("default")
    assert (v_old - v_default).abs().max() > 1e-3
    with copy_old.swapped_into(adapter):
        torch.testing.assert_close(adapter.predict(x, t, embeds), v_old, atol=1e-5, rtol=1e-5)
    with copy_default.swapped_into(adapter):
        torch.testing.assert_close(adapter.predict(x, t, embeds), v_default, atol=1e-5, rtol=1e-5)


def test_full_finetuning_copy_resyncs_every_weight():
    adapter = load_adapter("tiny:sd3")  # no LoRA: everything is trainable
    embeds = adapter.encode_prompts(["a cat"], with_uncond=False)
    x = torch.randn((1, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.5])
    copy = LowPrecisionCopy(adapter.denoiser, QuantConfig(format="full"))
    assert not copy.has_lora
    with torch.no_grad():  # change a linear and a non-linear (conv patch embedding) weight
        adapter.denoiser.transformer_blocks[0].attn.to_q.weight.mul_(1.5)
        adapter.denoiser.pos_embed.proj.weight.mul_(0.5)
    copy.sync()
    ref = adapter.predict(x, t, embeds)
    with copy.swapped_into(adapter):
        torch.testing.assert_close(adapter.predict(x, t, embeds), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_skip_list_min_dim_alignment_and_first_parameter(sd3_lora):
    adapter, *_ = sd3_lora
    cfg = QuantConfig(format="int8", skip=["norm_out", "context_embedder"], min_dim=16)
    copy = LowPrecisionCopy(adapter.denoiser, cfg)
    skipped = copy.report.skipped
    assert any("norm_out" in n for n in skipped) and any("context_embedder" in n for n in skipped)
    assert all("skip list" in skipped[n] for n in skipped if "norm_out" in n or "context_embedder" in n)
    small = [n for n, why in skipped.items() if why.startswith("small")]
    assert small, skipped  # the 16-wide attention projections of the tiny model
    for n in small:
        layer = copy.module.get_submodule(n)
        assert isinstance(layer, torch.nn.Linear) and type(layer.weight) is torch.nn.Parameter  # kept plain
    for n in copy.report.quantized:
        assert n not in skipped and "norm_out" not in n
    # NVFP4 needs both dims divisible by 16: a 24-wide layer is kept with that reason
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 24), torch.nn.Linear(24, 32))
    nv = LowPrecisionCopy(model, QuantConfig(format="nvfp4", on_unsupported="emulate"))
    assert "multiple of 16" in nv.report.skipped["1"] and "multiple of 16" in nv.report.skipped["2"]
    assert "first parameter" in nv.report.skipped["0"]  # the adapters read the input dtype from it
    out = nv.module(torch.randn(3, 32))
    assert out.shape == (3, 32) and torch.isfinite(out).all()


def test_format_resolution_error_emulate_fallback(monkeypatch):
    # Hardware: NVFP4 needs a Blackwell GPU, FP8 an Ada/Hopper one; this test pretends to be a CPU.
    monkeypatch.setattr(q, "cuda_capability", lambda device: None)
    monkeypatch.setattr(q, "library_installed", lambda name: True)
    with pytest.raises(UnsupportedFormatError, match=r"algorithm\.quant\.format.*nvfp4.*Blackwell") as exc:
        resolve_format(QuantConfig(format="nvfp4", on_unsupported="error"), "cpu")
    assert isinstance(exc.value, ConfigError)  # the CLI prints it as one line, exit 2
    r = resolve_format(QuantConfig(format="nvfp4", on_unsupported="emulate"), "cpu")
    assert (r.used, r.mode) == ("nvfp4", "emulated") and "Blackwell" in r.reason
    r = resolve_format(QuantConfig(format="nvfp4", on_unsupported="fallback", fallback_formats=["fp8", "bf16"]), "cpu")
    assert (r.used, r.mode) == ("bf16", "fallback")  # fp8 cannot run on a CPU either
    assert "fallback from nvfp4" in r.describe()
    assert resolve_format(QuantConfig(format="int8"), "cpu").mode == "native"
    # a Hopper GPU runs FP8 natively and falls back to it from NVFP4
    monkeypatch.setattr(q, "cuda_capability", lambda device: (9, 0))
    assert resolve_format(QuantConfig(format="fp8"), "cuda").mode == "native"
    r = resolve_format(QuantConfig(format="nvfp4", on_unsupported="fallback", fallback_formats=["fp8", "bf16"]), "cuda")
    assert (r.used, r.mode) == ("fp8", "fallback")
    monkeypatch.setattr(q, "cuda_capability", lambda device: (10, 0))
    assert resolve_format(QuantConfig(format="nvfp4"), "cuda").mode == "native"


def test_missing_library_errors_or_falls_back(monkeypatch):
    monkeypatch.setattr(q, "library_installed", lambda name: name != "bitsandbytes")
    with pytest.raises(UnsupportedFormatError, match="bitsandbytes is not installed"):
        resolve_format(QuantConfig(format="bnb_nf4"), "cpu")
    with pytest.raises(UnsupportedFormatError, match="no emulation"):
        resolve_format(QuantConfig(format="bnb_nf4", on_unsupported="emulate"), "cpu")
    assert resolve_format(QuantConfig(format="bnb_nf4", on_unsupported="fallback"), "cpu").used == "bf16"
    with pytest.raises(UnsupportedFormatError, match="no fallback format runs"):
        resolve_format(QuantConfig(format="bnb_nf4", on_unsupported="fallback", fallback_formats=["bnb_int8"]), "cpu")


def test_quant_config_validation():
    with pytest.raises(ConfigError, match=r"algorithm\.quant\.fallback_formats"):
        QuantConfig(fallback_formats=["fp2"]).validate()
    with pytest.raises(ConfigError, match=r"algorithm\.quant\.min_dim"):
        QuantConfig(min_dim=-1).validate()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,capability", [("fp8", (8, 9)), ("nvfp4", (10, 0))])
def test_native_gpu_formats(fmt, capability):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < capability:
        pytest.skip(f"{fmt} runs natively only on CUDA capability >= {capability[0]}.{capability[1]}")
    if not HAS_TORCHAO:
        pytest.skip("torchao is not installed")
    adapter = _with_lora(load_adapter("tiny:sd3", device="cuda", dtype=torch.bfloat16))
    embeds = adapter.encode_prompts(["a cat"], with_uncond=False)
    x = torch.randn((1, *adapter.latent_shape(32, 32)), device="cuda")
    copy = LowPrecisionCopy(adapter.denoiser, QuantConfig(format=fmt))
    assert copy.resolved.mode == "native" and copy.compute_dtype == torch.bfloat16
    assert velocity_error(adapter, copy, x, torch.tensor([0.5], device="cuda"), embeds, 1.0)["rel_l2"] < TOLERANCE[fmt]


def test_fidelity_report_rows(sd3_lora, monkeypatch):
    adapter, *_ = sd3_lora
    real = q.native_status
    monkeypatch.setattr(q, "native_status", lambda name, device: "pretend missing" if name == "quanto_int8" else real(name, device))
    rows = fidelity.fidelity_report(adapter, ["full", "bf16", "quanto_int8"], ["a cat", "a dog"], resolution=32, num_steps=2, repeats=1)
    by = {r["format"]: r for r in rows}
    assert by["quanto_int8"]["status"] == "skipped" and "pretend missing" in by["quanto_int8"]["reason"]
    assert by["full"]["rel_l2"] < 1e-5 and by["full"]["status"] == "native"
    assert 0 < by["bf16"]["rel_l2"] < TOLERANCE["bf16"]
    for key in ("cosine", "bytes", "sync_s", "forward_s", "full_forward_s", "quantized_param_fraction"):
        assert key in by["bf16"]
    assert "skipped" in fidelity.format_fidelity_table(rows)


def test_tensor_bytes_looks_through_quantised_tensors():
    if not HAS_TORCHAO:
        pytest.skip("torchao is not installed")
    layer = torch.nn.Linear(64, 64, bias=False)
    full = q.tensor_bytes(layer.weight)
    quantised = q.quantize_linear(layer, "int8", "native", QuantConfig())
    assert q.tensor_bytes(quantised.weight) < full / 3  # int8 data + per-row scales vs fp32
