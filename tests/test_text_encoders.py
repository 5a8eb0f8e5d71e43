"""``model.text_encoders``: offloaded encoders and the prompt-embedding cache give the embeddings,
and after training the weights, of resident encoders; a resume reads the cache without encoding; a
changed prompt set or model is encoded again; the cache frees the encoders."""

import gc
import weakref

import pytest
import torch

from diffalign.adapters import load_adapter
from diffalign.adapters.base import PromptEmbeds
from diffalign.adapters.sd3 import SD3Adapter
from diffalign.adapters.shapes import ShapesAdapter
from diffalign.config_files import load_config
from diffalign.errors import ConfigError
from diffalign.images import ImagePrompt
from diffalign.training import text_encoders
from diffalign.training.text_encoders import (EmbeddingCache, OffloadedEncoding, cache_prompt_embeddings,
                                              device_residency, use_placement)
from tests.helpers.compare import weights
from tests.helpers.tiny_run import FAST, run_cli

PROMPTS = ["a cat", "a dog sitting on a long red couch", "x", "a red car"]
MODEL = {"id": "tiny:sd3", "revision": None, "dtype": "float32", "options": {}}


@pytest.fixture
def sd3():
    return load_adapter("tiny:sd3", seed=0)


@pytest.fixture
def encode_calls(monkeypatch):
    """Every call of a family's own ``encode_prompts`` (any adapter class), as its prompt lists."""
    calls = []
    for cls in (SD3Adapter, ShapesAdapter):
        original = cls.encode_prompts

        def counted(self, prompts, *, with_uncond, _original=original):
            calls.append(list(prompts))
            return _original(self, prompts, with_uncond=with_uncond)

        monkeypatch.setattr(cls, "encode_prompts", counted)
    return calls


def assert_same_embeds(a, b):
    assert a.cond.keys() == b.cond.keys()
    for k in a.cond:
        assert torch.equal(a.cond[k], b.cond[k]), k
    assert (a.uncond is None) == (b.uncond is None)
    for k in a.uncond or {}:
        assert torch.equal(a.uncond[k], b.uncond[k]), k


def test_config_key_default_and_validation():
    assert load_config(None).model.text_encoders == "resident"
    assert load_config(None, ["model.text_encoders=cache"]).model.text_encoders == "cache"
    with pytest.raises(ConfigError, match="'model.text_encoders' must be one of resident, offload, cache"):
        load_config(None, ["model.text_encoders=gpu"])


def test_device_residency():
    assert device_residency("resident") == text_encoders.DeviceResidency(True, True, False)
    assert device_residency("offload") == text_encoders.DeviceResidency(False, True, False)
    assert device_residency("cache") == text_encoders.DeviceResidency(False, False, True)
    with pytest.raises(ConfigError, match="model.text_encoders"):
        device_residency("disk")


def test_text_encoders_of_each_family(sd3):
    assert list(sd3.text_encoders()) == ["text_encoder", "text_encoder_2", "text_encoder_3"]
    assert list(load_adapter("shapes").text_encoders()) == ["text_encoder"]  # the shipped model's BERT encoder


def test_offload_moves_encoders_around_each_encoding(sd3, monkeypatch):
    """Encoders in CPU memory between encodings, on the adapter's device while they run. The device
    is ``cpu:0`` here (the same memory as ``cpu``, another device object), so that the moves to the
    device and back are told apart."""
    resident = sd3.encode_prompts(PROMPTS, with_uncond=True)
    sd3.device = torch.device("cpu", 0)
    moves, runs = [], []
    real_move = text_encoders.move_modules
    monkeypatch.setattr(text_encoders, "move_modules", lambda modules, device: (moves.append((len(modules), device)),
                                                                                real_move(modules, device)))
    sd3.pipeline.text_encoder_3.register_forward_pre_hook(lambda module, args: runs.append(len(moves)))
    use_placement(sd3, "offload")
    assert isinstance(sd3.encode_prompts, OffloadedEncoding)
    assert moves == [(3, torch.device("cpu"))]  # at once: out of the device's memory
    offloaded = sd3.encode_prompts(PROMPTS, with_uncond=True)
    assert moves == [(3, torch.device("cpu")), (3, torch.device("cpu", 0)), (3, torch.device("cpu"))]
    assert runs and all(r == 2 for r in runs)  # T5 ran after the move to the device, before the move back
    assert_same_embeds(offloaded, resident)


def test_cache_gives_the_encodings_and_frees_the_encoders(sd3, tmp_path, encode_calls):
    resident = type(sd3).encode_prompts(sd3, PROMPTS, with_uncond=True)  # one batch, as the cache encodes them
    encoder = weakref.ref(sd3.pipeline.text_encoder_3)
    cache = cache_prompt_embeddings(sd3, tmp_path, PROMPTS, MODEL)
    use_placement(sd3, "cache", cache=cache)
    gc.collect()
    assert sd3.text_encoders() == {} and sd3.pipeline.text_encoder_3 is None
    assert encoder() is None  # nothing holds T5 any more: its memory is released
    assert [type(m).__name__ for m in sd3.frozen_modules()] == ["AutoencoderTiny"]  # the VAE stays
    encode_calls.clear()
    assert_same_embeds(sd3.encode_prompts(PROMPTS, with_uncond=True), resident)
    picked = sd3.encode_prompts([PROMPTS[2], PROMPTS[0], PROMPTS[2]], with_uncond=False)  # any rows, any order
    assert picked.uncond is None
    assert torch.equal(picked.cond["encoder_hidden_states"], resident.cond["encoder_hidden_states"][[2, 0, 2]])
    assert encode_calls == []
    with pytest.raises(ConfigError, match="model.text_encoders.*'a horse' is not in the run's encoded prompt set"):
        sd3.encode_prompts(["a horse"], with_uncond=False)


def test_cache_of_the_shipped_model(tmp_path):
    """The shipped ShapesWorld model (BERT encoder): each cached row is the prompt's encoding,
    alone or in any batch, bit for bit."""
    shapes = load_adapter("shapes")
    prompts = ["one red circle", "two blue squares", "a green triangle left of a yellow circle"]
    resident = [shapes.encode_prompts([p], with_uncond=True) for p in prompts]
    use_placement(shapes, "cache", cache=cache_prompt_embeddings(shapes, tmp_path, prompts, {"id": "shapes"}))
    assert shapes.pipeline.text_encoder is None
    assert_same_embeds(shapes.encode_prompts(prompts, with_uncond=True), PromptEmbeds.cat(resident))


def test_cache_is_read_back_and_rebuilt_when_the_prompts_or_model_change(sd3, tmp_path, encode_calls):
    cache_prompt_embeddings(sd3, tmp_path, PROMPTS, MODEL)
    assert encode_calls == [PROMPTS]
    encode_calls.clear()
    again = cache_prompt_embeddings(sd3, tmp_path, PROMPTS, MODEL)  # as a resume does: nothing encoded
    assert encode_calls == []
    assert len(again.rows) == len(PROMPTS)
    cache_prompt_embeddings(sd3, tmp_path, [*PROMPTS, "a horse"], MODEL)
    assert encode_calls == [[*PROMPTS, "a horse"]]
    encode_calls.clear()
    cache_prompt_embeddings(sd3, tmp_path, [*PROMPTS, "a horse"], {**MODEL, "dtype": "bfloat16"})
    assert len(encode_calls) == 1
    encode_calls.clear()
    with torch.no_grad():
        sd3.pipeline.text_encoder.text_model.embeddings.token_embedding.weight[0, 0] += 1  # other encoder weights
    cache_prompt_embeddings(sd3, tmp_path, [*PROMPTS, "a horse"], {**MODEL, "dtype": "bfloat16"})
    assert len(encode_calls) == 1


def test_cache_shards_and_editing_prompts(sd3, tmp_path, monkeypatch):
    """Prompts over several shards, and prompts with source images: each image its own
    unconditional row (the tiny SD3 ignores the image: the rows are equal, the keys differ)."""
    monkeypatch.setattr(text_encoders, "SHARD_PROMPTS", 2)
    monkeypatch.setattr(text_encoders, "ENCODE_BATCH", 2)
    prompts = [*PROMPTS, ImagePrompt("a cat", "/img/a.png"), ImagePrompt("a cat", "/img/b.png")]
    cache = cache_prompt_embeddings(sd3, tmp_path, prompts, MODEL)
    assert len(cache.shards) == 3 and len(cache.uncond_rows) == 3
    resident = type(sd3).encode_prompts(sd3, prompts[4:], with_uncond=True)
    assert_same_embeds(cache(prompts[4:], with_uncond=True), resident)
    assert torch.equal(cache(["a red car"], with_uncond=False).cond["encoder_hidden_states"],
                       type(sd3).encode_prompts(sd3, ["x", "a red car"], with_uncond=False).cond["encoder_hidden_states"][1:])


def test_processes_encode_their_shards(sd3, tmp_path, monkeypatch, encode_calls):
    """Two processes (threads here, with a barrier of two): each encodes every second shard, the
    main one writes the index, and both read the same rows as one process builds."""
    import threading

    monkeypatch.setattr(text_encoders, "SHARD_PROMPTS", 1)
    one = cache_prompt_embeddings(sd3, tmp_path / "one", PROMPTS, MODEL)
    encode_calls.clear()
    barrier, built, errors = threading.Barrier(2), {}, []

    def process(rank):
        try:
            built[rank] = cache_prompt_embeddings(sd3, tmp_path / "two", PROMPTS, MODEL, rank=rank, world=2,
                                                  barrier=barrier.wait)
        except BaseException as exc:  # shown by the assertion below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=process, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sorted(map(tuple, encode_calls)) == [(p,) for p in sorted(PROMPTS)]  # each prompt encoded once, by one process
    for cache in built.values():
        assert_same_embeds(cache(PROMPTS, with_uncond=True), one(PROMPTS, with_uncond=True))


# ---- end to end: tiny ShapesWorld Flow-GRPO ---------------------------------------------------------
SHAPES_RUN = ["configs/shapes/flow_grpo.yaml", "model.id=tiny:shapes", "lora.enabled=true", "lora.rank=4", "lora.alpha=4",
              "prompts.families=[single_object]", "rollout.prompts_per_iteration=2", "rollout.group_size=2",
              "sampling.num_steps=2", "sampling.window_size=2", "model.resolution=16", "train.batch_size=4",
              "train.mixed_precision=no", "eval.images_per_family=1", "eval.probe=false", "optim.lr=1e-2",
              "reward.name=brightness", "reward.kwargs={}",
              "checkpoint.every=1", *FAST]


def test_shapes_cache_trains_the_weights_of_resident_encoders_and_resumes_without_encoding(tmp_path, monkeypatch):
    resident, cached = tmp_path / "resident", tmp_path / "cached"
    assert run_cli("train", *SHAPES_RUN, "max_iterations=2", f"output_dir={resident}") == 0
    assert run_cli("train", *SHAPES_RUN, "max_iterations=1", "model.text_encoders=cache", f"output_dir={cached}") == 0
    assert (cached / "text_embeddings" / "index.json").is_file()

    def poisoned(self, prompts, *, with_uncond):
        raise AssertionError("a resumed run with model.text_encoders=cache encoded prompts")

    monkeypatch.setattr(ShapesAdapter, "encode_prompts", poisoned)
    assert run_cli("resume", cached, "max_iterations=2") == 0
    a, b = weights(resident), weights(cached)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # exactly: rows do not depend on the batch
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # the LoRA moved


def test_cache_placement_needs_the_cache(tmp_path):
    with pytest.raises(ValueError, match="EmbeddingCache"):
        use_placement(load_adapter("tiny:shapes"), "cache")
    assert not EmbeddingCache.valid(tmp_path, "any key")  # no index.json: no cache
