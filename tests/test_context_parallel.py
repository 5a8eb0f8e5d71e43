"""Context parallelism (``train.context_parallel``) through diffusers' ContextParallelConfig:
each sample's tokens split over the processes of a group, Ulysses attention between them.

- the model (tests/context_parallel_worker.py): degree 2 on two gloo CPU processes gives the loss
  and the gradients of one process without it (summed over the group), for an image family (FLUX.1)
  and a video family (Wan2.1, and Wan2.2's two experts), to 1e-5;
- the trainer: Flow-GRPO on tiny FLUX.1 with four processes, two data-parallel groups of two,
  trains the one-process run's weights (tests/helpers/compare.py's units);
- the refusals: one line naming the key (and the family or method), exit status 2.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from diffalign import distributed
from diffalign.errors import ConfigError
from tests.helpers.compare import COMPARABLE, REL, assert_same_update, weights
from tests.helpers.launch import launch, start_run
from tests.helpers.tiny_run import FAST_ONE_PROMPT, run_cli, train_records

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed for CPU processes")
TOL = 1e-5


# ---- the pure parts ------------------------------------------------------------------------------

def test_process_layout_groups_consecutive_ranks():
    layouts = [distributed.process_layout(r, 8, 2) for r in range(8)]
    assert [(x.dp_rank, x.cp_rank) for x in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert layouts[0].dp_world == 4
    assert distributed.process_layout(3, 4, 1).dp_rank == 3  # degree 1: plain data parallelism
    with pytest.raises(ConfigError, match="'train.context_parallel' 3 must divide the number of processes \\(4\\)"):
        distributed.process_layout(0, 4, 3)


def test_context_parallel_split():
    assert distributed.context_parallel_split(4096, 2) == 2048  # FLUX.1 at 1024 px: 64 x 64 packed tokens
    assert distributed.context_parallel_split(512, 8) == 64  # its T5 tokens
    with pytest.raises(ConfigError, match="75 tokens per sample do not split into 2 equal parts"):
        distributed.context_parallel_split(75, 2)


def test_one_per_context_group_keeps_each_group_once():
    # 4 processes, degree 2: processes 0 and 1 hold samples [0, 1], processes 2 and 3 hold [2, 3]
    gathered = torch.tensor([0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0])
    layout = distributed.ProcessLayout(0, 4, 2)
    assert distributed.one_per_context_group(gathered, layout).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert distributed.one_per_context_group(gathered, distributed.ProcessLayout(0, 8, 1)) is gathered


def test_supported_and_refused_families():
    for family in distributed.CONTEXT_PARALLEL_FAMILIES:
        assert distributed.context_parallel_problem(family, 2) is None
    assert distributed.context_parallel_problem("sd3", 1) is None
    assert "no context-parallel plan" in distributed.context_parallel_problem("sd3", 2)
    assert "text mask" in distributed.context_parallel_problem("ltx", 2)


def test_the_supported_families_have_a_plan():
    """The families named supported are those whose diffusers transformer carries a ``_cp_plan``
    (LTX has one, refused for its attention mask); the refused ones have none."""
    import diffusers

    from diffalign.adapters import FAMILIES

    classes = {"flux": "FluxTransformer2DModel", "flux_kontext": "FluxTransformer2DModel", "flux2": "Flux2Transformer2DModel",
               "qwen": "QwenImageTransformer2DModel", "qwen_edit": "QwenImageTransformer2DModel",
               "wan": "WanTransformer3DModel", "ltx": "LTXVideoTransformer3DModel", "sd3": "SD3Transformer2DModel",
               "sana": "SanaTransformer2DModel", "zimage": "ZImageTransformer2DModel",
               "hunyuan_video": "HunyuanVideoTransformer3DModel"}
    for family, name in classes.items():
        assert family in FAMILIES
        has_plan = getattr(getattr(diffusers, name), "_cp_plan", None) is not None
        assert has_plan == (family in distributed.CONTEXT_PARALLEL_FAMILIES or family == "ltx"), family


# ---- refusals: one line, exit status 2 -----------------------------------------------------------

@pytest.mark.parametrize("config, overrides, needle", [
    ("configs/tiny/flow_grpo_sd3.yaml", ["train.context_parallel=2"],
     "config key 'train.context_parallel' 2: model family 'sd3' does not support context parallelism"),
    ("configs/tiny/flow_grpo_ltx.yaml", ["train.context_parallel=2"], "model family 'ltx' does not support context parallelism"),
    ("configs/tiny/spo_sd15.yaml", ["train.context_parallel=2"], "algorithm 'spo' does not support context parallelism"),
    ("configs/tiny/flow_grpo_flux.yaml", ["train.context_parallel=0"], "train.context_parallel"),
    ("configs/tiny/flow_grpo_flux.yaml", ["train.context_parallel=2", "train.fsdp=true"], "plain data parallelism only"),
])
def test_refusals(config, overrides, needle, capsys):
    capsys.readouterr()
    assert run_cli("config", config, *overrides) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


def test_one_process_cannot_split(tmp_path, capsys):
    capsys.readouterr()
    assert run_cli("train", "configs/tiny/flow_grpo_flux.yaml", f"output_dir={tmp_path / 'run'}", "train.context_parallel=2",
                   *FAST_ONE_PROMPT) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "'train.context_parallel' 2 must divide the number of processes (1)" in lines[0], lines


# ---- the model: two gloo processes against one -----------------------------------------------------

@needs_gloo
def test_degree_two_matches_one_process(repo_root, tmp_path):
    launch(["tests/context_parallel_worker.py", str(tmp_path), "2", "flux", "wan", "wan22"], repo_root, nproc=2, timeout=300)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (result["dp_rank"], result["cp_rank"]) == (0, rank)
        assert result["wan22"]["parts"] == 2  # Wan2.2: both experts split, each trained by one sample
        for family in ("flux", "wan", "wan22"):
            r = result[family]
            assert r["loss"] == pytest.approx(r["reference_loss"], rel=TOL), family
            assert r["same_parameters"], family
            assert r["grad_rel"] <= TOL, (family, r["grad_rel"])
            assert r["forward_max_diff"] <= TOL, (family, r["forward_max_diff"])


# ---- the trainer: two data-parallel groups of two against one process --------------------------------

RUN = ["configs/tiny/flow_grpo_flux.yaml", "max_iterations=2", *FAST_ONE_PROMPT, "train.ema.enabled=false", "optim.lr=50",
       "train.batch_size=64", "checkpoint.every=0", *COMPARABLE]


@needs_gloo
@pytest.mark.slow
def test_flow_grpo_with_two_groups_of_two_matches_one_process(repo_root, tmp_path):
    start, one, four = tmp_path / "start", tmp_path / "one", tmp_path / "four"
    start_run(["-m", "diffalign.cli", "train", *RUN], start)
    assert run_cli("train", *RUN, f"output_dir={one}", "rollout.prompts_per_iteration=2") == 0
    res = launch(["-m", "diffalign.cli", "train", *RUN, f"output_dir={four}", "train.context_parallel=2",
                  "rollout.prompts_per_iteration=1"], repo_root, nproc=4, timeout=400)
    assert "each sample's tokens split over 2 processes, 2 data-parallel group(s)" in res.stderr
    a, b = train_records(one), train_records(four)
    for key in ("reward_mean", "advantage_abs_mean", "grad_norm"):  # the same samples, advantages and gradients
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-3), key
    assert_same_update(weights(start), weights(one), weights(four), rel=REL, min_update=1e-3)


def test_heads_that_do_not_split_are_refused_before_any_collective():
    from diffalign.adapters import load_adapter

    adapter = load_adapter("tiny:flux", device="cpu", dtype=torch.float32)  # 2 attention heads
    with pytest.raises(ConfigError, match="'train.context_parallel' 3: 2 attention heads do not split into 3"):
        distributed.enable_context_parallel(list(adapter.denoiser_parts().values()), distributed.ProcessLayout(0, 3, 3),
                                            torch.device("cpu"))
