"""Where a run keeps its text encoders (``model.text_encoders``), and the prompt-embedding cache.

Text encoders are large and mostly idle: Qwen2.5-VL-7B (Qwen-Image) is 16.6 GB, umT5-XXL (Wan)
11.4 GB, T5-XXL (SD3, FLUX.1) 9.5 GB, while a Flow-GRPO run encodes a fixed prompt set. Three
placements, one mechanism for every model family: the run puts its own callable in place of the
adapter's :meth:`~diffalign.adapters.base.ModelAdapter.encode_prompts` (every part that needs
embeddings, rollouts, updates and evaluations alike, calls that method), so no family and no recipe
knows which placement runs:

- ``resident``: the family's encoding, encoders on the device all run long (the default);
- ``offload``: :class:`OffloadedEncoding`, the encoders in CPU memory, moved to the device for
  each encoding and back after it;
- ``cache``: :class:`EmbeddingCache`, the run's whole prompt set (training, evaluation, probe and
  validation prompts; each prompt's conditional embeddings and the empty / negative prompt's for
  CFG) encoded once into ``text_embeddings/`` of the run directory (safetensors shards and an
  ``index.json``), then the encoders are dropped from the pipeline. A resume whose prompts, model
  and encoder weights match the index reads the embeddings without encoding anything; any change
  encodes the set again.

:func:`device_residency` says what each placement keeps on the device, for memory planning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from diffalign import progress, runs
from diffalign.adapters.base import ModelAdapter, PromptEmbeds
from diffalign.errors import ConfigError
from diffalign.images import prompt_image, prompt_record

PLACEMENTS = ("resident", "offload", "cache")
CACHE_DIR = "text_embeddings"  # in the run directory
INDEX_FILE = "index.json"
CACHE_FORMAT = 1  # bumped when the files' layout changes: an older cache is encoded again
SHARD_PROMPTS = 256  # prompts per safetensors shard: one shard's rows are in memory while it is written
ENCODE_BATCH = 16  # prompts per encoder forward while the cache is built
SAMPLE_VALUES = 64  # values of each encoder parameter hashed into the cache's key (a cheap weights fingerprint)


@dataclass(frozen=True)
class DeviceResidency:
    """What a placement keeps in device memory. ``encoders_between_encodings``: the encoders'
    weights stay on the device through rollouts and updates; ``encoders_while_encoding``: they are
    on the device while prompts are encoded (the peak of an encoding); ``embeddings_on_disk``: the
    prompt set's embeddings live in the run directory, and only the rows a batch uses reach the
    device."""

    encoders_between_encodings: bool
    encoders_while_encoding: bool
    embeddings_on_disk: bool


def device_residency(placement: str) -> DeviceResidency:
    """What ``model.text_encoders: placement`` keeps on the device (see :class:`DeviceResidency`).
    ``cache`` loads the encoders to the device once, at start, to build or check the cache."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"config key 'model.text_encoders' must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
    return DeviceResidency(encoders_between_encodings=placement == "resident",
                           encoders_while_encoding=placement != "cache", embeddings_on_disk=placement == "cache")


# ---- offload ------------------------------------------------------------------------------------
def move_modules(modules: Sequence[torch.nn.Module], device: torch.device) -> None:
    """Every module of ``modules`` to ``device`` (the one place offloading moves weights)."""
    for module in modules:
        module.to(device)


class OffloadedEncoding:
    """``adapter.encode_prompts`` with the text encoders kept on ``storage`` (CPU memory) between
    calls: each call moves them to the adapter's device, encodes with the family's own method,
    and moves them back, so the embeddings are those of a resident run."""

    def __init__(self, adapter: ModelAdapter, storage: torch.device | str = "cpu"):
        self.adapter = adapter
        self.storage = torch.device(storage)
        self.encode = type(adapter).encode_prompts.__get__(adapter)  # the family's method, not a replaced one
        move_modules(list(adapter.text_encoders().values()), self.storage)

    def __call__(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        modules = list(self.adapter.text_encoders().values())
        move_modules(modules, self.adapter.device)
        try:
            return self.encode(prompts, with_uncond=with_uncond)
        finally:
            move_modules(modules, self.storage)


# ---- cache --------------------------------------------------------------------------------------
def prompt_key(prompt: str) -> str:
    """A prompt's key in the cache: its text, and for an editing prompt its source image."""
    return json.dumps(prompt_record(prompt))


def encoder_fingerprint(adapter: ModelAdapter) -> str:
    """A hash of the text encoders' classes, parameter names, shapes and dtypes, and the first
    ``SAMPLE_VALUES`` values of every parameter: another checkpoint (or the same one in another
    dtype) gives another fingerprint, without reading gigabytes of weights."""
    digest = hashlib.sha256()
    for name, module in adapter.text_encoders().items():
        digest.update(f"{name}:{type(module).__name__};".encode())
        for pname, param in module.named_parameters():
            digest.update(f"{pname}:{tuple(param.shape)}:{param.dtype};".encode())
            digest.update(param.detach().flatten()[:SAMPLE_VALUES].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def cache_key(adapter: ModelAdapter, model: dict, prompts: Sequence[str]) -> str:
    """The key an embedding cache is valid for: its format, ``model`` (the run's ``model.*``
    entries that change an encoding: id, revision, dtype, options), the adapter's family, the
    encoders' fingerprint and the prompt list."""
    parts = {"format": CACHE_FORMAT, "model": model, "family": adapter.family, "encoders": encoder_fingerprint(adapter),
             "prompts": [prompt_key(p) for p in prompts]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _uncond_key(prompt: str) -> str:
    """Which unconditional row serves ``prompt``: the negative prompt's embedding is the same for
    every prompt, except that an editing prompt's carries its source image."""
    return json.dumps(prompt_image(prompt))


def _shard_file(shard: int) -> str:
    return f"embeds-{shard:05d}.safetensors"


class EmbeddingCache:
    """The prompt embeddings of a run's prompt set, read from ``folder`` (see the module docstring).
    Called as ``adapter.encode_prompts``: the rows of ``prompts`` (and of their unconditional
    prompt under CFG), on the adapter's device, exactly as encoded when the cache was built."""

    def __init__(self, folder: Path, device: torch.device):
        from safetensors import safe_open

        self.folder, self.device = Path(folder), torch.device(device)
        index = json.loads((self.folder / INDEX_FILE).read_text())
        self.key = index["key"]
        self.rows = {key: i for i, key in enumerate(index["prompts"])}
        self.uncond_rows = {key: i for i, key in enumerate(index["uncond"])}
        self.uncond_shard = index["uncond_shard"]
        self.names = index["names"]
        self.shards = [safe_open(str(self.folder / _shard_file(s)), framework="pt", device="cpu") for s in range(index["shards"])]

    @staticmethod
    def valid(folder: Path, key: str) -> bool:
        """Whether ``folder`` holds a complete cache built for ``key``."""
        try:
            return json.loads((Path(folder) / INDEX_FILE).read_text()).get("key") == key
        except (OSError, ValueError):
            return False

    @staticmethod
    def build(folder: Path, adapter: ModelAdapter, prompts: Sequence[str], key: str, *, rank: int = 0, world: int = 1,
              barrier: Callable[[], None] = lambda: None) -> None:
        """Encode ``prompts`` (unique, in a fixed order) with the adapter's own method and write them
        to ``folder``: process ``rank`` of ``world`` writes every ``world``-th shard, then the main
        process writes ``index.json`` (last, so a cache interrupted while it was written is never
        read). ``barrier`` waits for every process (a collective)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        encode = type(adapter).encode_prompts.__get__(adapter)
        first_with: dict[str, int] = {}  # unconditional key -> the first prompt that has it
        for i, p in enumerate(prompts):
            first_with.setdefault(_uncond_key(p), i)
        uncond_keys = list(first_with)
        uncond_index = {k: u for u, k in enumerate(uncond_keys)}
        uncond_shard = {k: first_with[k] // SHARD_PROMPTS for k in uncond_keys}
        n_shards = max(1, -(-len(prompts) // SHARD_PROMPTS))
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        barrier()
        names: dict[str, list[str]] = {}
        mine = range(rank, n_shards, world)
        bar = progress.bar(total=sum(len(prompts[s * SHARD_PROMPTS:(s + 1) * SHARD_PROMPTS]) for s in mine),
                           desc="encoding the prompt set", unit="prompt", disable=rank != 0)
        for shard in mine:
            start = shard * SHARD_PROMPTS
            chunk = list(prompts[start:start + SHARD_PROMPTS])
            tensors: dict[str, torch.Tensor] = {}
            for b in range(0, len(chunk), ENCODE_BATCH):
                batch = chunk[b:b + ENCODE_BATCH]
                embeds = encode(batch, with_uncond=True)
                bar.update(len(batch))
                names = {"cond": sorted(embeds.cond), "uncond": sorted(embeds.uncond)}
                for j, p in enumerate(batch):
                    i = start + b + j
                    tensors.update({f"cond/{i}/{n}": v[j:j + 1].detach().cpu().clone() for n, v in embeds.cond.items()})
                    if first_with[_uncond_key(p)] == i:
                        u = uncond_index[_uncond_key(p)]
                        tensors.update({f"uncond/{u}/{n}": v[j:j + 1].detach().cpu().clone() for n, v in embeds.uncond.items()})
            tmp = folder / f".{_shard_file(shard)}.tmp"
            save_file(tensors, str(tmp))
            os.replace(tmp, folder / _shard_file(shard))
        bar.close()
        barrier()
        if rank == 0:
            if not names:  # the main process encoded no shard (more processes than shards): one prompt for the names
                embeds = encode(list(prompts[:1]), with_uncond=True)
                names = {"cond": sorted(embeds.cond), "uncond": sorted(embeds.uncond)}
            index = {"key": key, "format": CACHE_FORMAT, "prompts": [prompt_key(p) for p in prompts], "uncond": uncond_keys,
                     "uncond_shard": [uncond_shard[k] for k in uncond_keys], "shards": n_shards, "names": names}
            runs.atomic_write_text(folder / INDEX_FILE, json.dumps(index) + "\n")
        barrier()

    def _row(self, kind: str, i: int, shard: int) -> dict[str, torch.Tensor]:
        return {n: self.shards[shard].get_tensor(f"{kind}/{i}/{n}") for n in self.names[kind]}

    def __call__(self, prompts: Sequence[str], *, with_uncond: bool) -> PromptEmbeds:
        cond, uncond = [], []
        for p in prompts:
            i = self.rows.get(prompt_key(p))
            if i is None:
                raise ConfigError(f"config key 'model.text_encoders' is cache, and the prompt {str(p)!r} is not in the run's "
                                  f"encoded prompt set ({self.folder}); use model.text_encoders: offload")
            cond.append(self._row("cond", i, i // SHARD_PROMPTS))
            if with_uncond:
                u = self.uncond_rows[_uncond_key(p)]
                uncond.append(self._row("uncond", u, self.uncond_shard[u]))

        def stacked(rows):
            return {n: torch.cat([r[n] for r in rows]).to(self.device) for n in rows[0]}

        return PromptEmbeds(stacked(cond), stacked(uncond) if with_uncond else None)


def run_prompt_set(prompt_lists: Sequence[Sequence[str]]) -> list[str]:
    """The prompts of ``prompt_lists`` without repeats, in order of first appearance."""
    return list(dict.fromkeys(p for prompts in prompt_lists for p in prompts))


def use_placement(adapter: ModelAdapter, placement: str, *, cache: EmbeddingCache | None = None,
                  keep_encoders: bool = False) -> None:
    """Put ``placement``'s encoding in place of ``adapter.encode_prompts``: nothing for
    ``resident``; :class:`OffloadedEncoding` for ``offload`` (the encoders go to CPU memory now);
    for ``cache`` the built ``cache``, and the encoders are dropped from the pipeline
    (``keep_encoders``: moved to CPU memory instead, where ``final/`` saves the whole pipeline)."""
    device_residency(placement)  # checks the name
    if placement == "offload":
        adapter.encode_prompts = OffloadedEncoding(adapter)
    elif placement == "cache":
        if cache is None:
            raise ValueError("model.text_encoders=cache needs the run's EmbeddingCache")
        adapter.encode_prompts = cache
        if keep_encoders:
            move_modules(list(adapter.text_encoders().values()), torch.device("cpu"))
        else:
            adapter.release_text_encoders()


def cache_prompt_embeddings(adapter: ModelAdapter, run_dir: Path, prompts: Sequence[str], model: dict, *, rank: int = 0,
                            world: int = 1, barrier: Callable[[], None] = lambda: None,
                            log: Callable[[str], None] = lambda _msg: None) -> EmbeddingCache:
    """The run's :class:`EmbeddingCache` of ``prompts`` in ``run_dir/text_embeddings``: read when
    its key matches (a resume), else built with every process (a collective). ``model``: the
    run's ``model.*`` entries that change an encoding (see :func:`cache_key`)."""
    folder = Path(run_dir) / CACHE_DIR
    key = cache_key(adapter, model, prompts)
    fresh = EmbeddingCache.valid(folder, key)
    barrier()  # every process has read the verdict before the main process may remove the folder
    if fresh:
        log(f"text embeddings: {len(prompts)} prompts read from {folder}")
    else:
        if folder.exists():
            log(f"text embeddings: the prompt set or the model changed since {folder} was written; encoding again")
        EmbeddingCache.build(folder, adapter, prompts, key, rank=rank, world=world, barrier=barrier)
        log(f"text embeddings: {len(prompts)} prompts encoded into {folder}")
    return EmbeddingCache(folder, adapter.device)
