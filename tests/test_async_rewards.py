"""``reward.async``: the config key, the reward pool's groups, and runs that equal the synchronous path."""

from __future__ import annotations

import pytest
import torch

from diffalign import runs
from diffalign.config_files import dump_config, load_config, to_dict, upgraded
from diffalign.errors import ConfigError, RewardError
from diffalign.training.rewards import RewardPool
from tests.helpers import rewards as helper_rewards
from tests.helpers.compare import weights
from tests.helpers.tiny_run import FAST, run_cli, train_records

CONFIG = "configs/tiny/flow_grpo_sd3.yaml"
# two iterations of four chunks of two images (2 prompts x 4): three chunks are scored while the next samples
RUN = [*FAST, "max_iterations=2", "rollout.sample_batch_size=2", "checkpoint.every=0", "--overwrite"]


# ---- the key ----------------------------------------------------------------------------------
def test_async_key_loads_overrides_dumps_and_the_old_key_moves_with_a_notice(capsys):
    assert load_config(CONFIG).reward.async_ is True  # the default: what rollout.overlap_rewards did
    cfg = load_config(CONFIG, ["reward.async=false"])
    assert cfg.reward.async_ is False and "  async: false" in dump_config(cfg).splitlines()
    assert load_config(None, [], base=__import__("yaml").safe_load(dump_config(cfg))).reward.async_ is False
    capsys.readouterr()
    assert load_config(CONFIG, ["rollout.overlap_rewards=false"]).reward.async_ is False
    assert capsys.readouterr().err.strip() == ("warning: config key 'rollout.overlap_rewards' is deprecated; "
                                               "it is now called 'reward.async'")
    with pytest.raises(ConfigError, match="give only 'reward.async'"):
        load_config(CONFIG, ["rollout.overlap_rewards=false", "reward.async=true"])
    with pytest.raises(ConfigError, match="unknown config key 'reward.async_'"):
        load_config(CONFIG, ["reward.async_=false"])
    with pytest.raises(ConfigError, match="'reward.async' must be true or false"):
        load_config(CONFIG, ["reward.async=sometimes"])


def test_a_saved_config_of_an_older_version_compares_equal_once_upgraded(capsys):
    """A checkpoint written before the key moved holds rollout.overlap_rewards: resuming compares it
    upgraded, silently, so that no section shows as changed."""
    current = to_dict(load_config(CONFIG, ["reward.async=false"]))
    old = {**current, "rollout": {**current["rollout"], "overlap_rewards": False},
           "reward": {k: v for k, v in current["reward"].items() if k != "async"}}
    assert old != current and upgraded(old) == current
    assert "overlap_rewards" in old["rollout"]  # the saved mapping itself is left as it was
    assert capsys.readouterr().err == ""


# ---- the pool ---------------------------------------------------------------------------------
def _recording_score(calls):
    def score(images, prompts, metadata):
        calls.append([m.get("group") for m in metadata])
        return images.mean(dim=(1, 2, 3)), {"n": float(len(prompts))}

    return score


@pytest.mark.parametrize("asynchronous", [False, True])
def test_pool_holds_chunks_until_their_groups_are_whole(asynchronous):
    """Groups of 4 in chunks of 3, 3, 2: the first call waits for group 1 to be whole, then scores all 8."""
    calls = []
    pool = RewardPool(_recording_score(calls), asynchronous=asynchronous, reward_name="r", nonfinite="error", stats={},
                      groupwise=True)
    images = torch.arange(8.0).view(8, 1, 1, 1).expand(8, 3, 2, 2)
    groups = torch.tensor([5, 5, 5, 5, 6, 6, 6, 6])
    shares = [pool.submit(images[s], ["p"] * (s.stop - s.start), groups[s], 4) for s in (slice(0, 3), slice(3, 6), slice(6, 8))]
    results = [s.result() for s in shares]
    pool.shutdown()
    assert calls == [[5, 5, 5, 5, 6, 6, 6, 6]]
    assert torch.equal(torch.cat([r for r, _ in results]), torch.arange(8.0))
    assert [info for _, info in results] == [{"n": 8.0}, {}, {}]  # the call's info counted once
    calls.clear()  # chunks holding whole groups are scored one by one, as they come
    shares = [pool.submit(images[s], ["p"] * 4, groups[s], 4) for s in (slice(0, 4), slice(4, 8))]
    [s.result() for s in shares]
    pool.shutdown()
    assert calls == [[5] * 4, [6] * 4]
    with pytest.raises(ValueError, match=r"groups \[6\] ended with fewer images"):
        pool.submit(images[:6], ["p"] * 6, groups[:6], 4).result()
    pool.shutdown()
    with pytest.raises(RewardError, match="passes no groups"):
        pool.submit(images, ["p"] * 8)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_pool_tells_a_pointwise_reward_the_groups_and_stops_calling_after_a_failure(asynchronous):
    """A failed call raises where its result is asked for, on either path (not where it is made:
    the rollout goes on sampling, every process meeting at Trainer.reward_results), and the calls
    after it are not made."""
    calls = []

    def score(images, prompts, metadata):
        calls.append([m.get("group") for m in metadata])
        if len(calls) == 1:
            raise RewardError("down")
        return torch.zeros(len(prompts)), {}

    pool = RewardPool(score, asynchronous=asynchronous, reward_name="r", nonfinite="error", stats={})
    futures = [pool.submit(torch.zeros(2, 3, 2, 2), ["p", "p"], torch.tensor([g, g])) for g in (0, 1)]
    with pytest.raises(RewardError, match="down"):
        futures[0].result()
    with pytest.raises(RewardError, match="after an earlier failed call"):
        futures[1].result()
    pool.shutdown()
    assert calls == [[0, 0]]  # the later call was not made
    assert pool.submit(torch.zeros(1, 3, 2, 2), ["p"]).result()[0].shape == (1,) and calls[-1] == [None]
    pool.shutdown()


# ---- whole runs ---------------------------------------------------------------------------------
def _compare_runs(a, b) -> None:
    assert all(torch.equal(x, y) for x, y in zip(weights(a).values(), weights(b).values()))
    drop = ("seconds", "time/")
    ra, rb = ([{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in runs.read_jsonl(d / "metrics.jsonl")]
              for d in (a, b))
    assert ra == rb


def test_async_run_equals_the_synchronous_run_and_handles_failures_alike(tmp_path, capsys):
    """Two seeded iterations of Flow-GRPO with reward.async on and off: the same rewards logged and
    bit-identical weights, with one failed reward call (reward.max_failures=1) scored again and
    counted alike. A second failure stops the run with a checkpoint on either path, after the same
    calls: the worker makes no call the synchronous path would not have made."""
    torch.set_num_threads(1)  # two intra-op threads on a loaded 2-core machine make every tiny op wait (restored by conftest)
    reward = ["reward.name=tests.helpers.rewards:counting_reward", "reward.max_failures=1"]
    calls, out = {}, {}
    for mode in ("async", "sync"):
        out[mode] = tmp_path / mode
        args = [f"output_dir={out[mode]}", f"reward.async={mode == 'async'}", *reward, "reward.kwargs.fail_calls=[1]"]
        assert run_cli("train", CONFIG, *args, *RUN) == 0
        calls[mode] = list(helper_rewards.CALLS)
    _compare_runs(out["async"], out["sync"])
    assert calls["async"] == calls["sync"] == [2] * 10  # 8 chunks, the failed call made again, the final evaluation
    records = train_records(out["async"])
    assert [r["reward_failures"] for r in records] == [1, 1] and len({r["reward_mean"] for r in records}) == 2
    for mode in ("async", "sync"):
        stopped = tmp_path / f"stop-{mode}"
        args = [f"output_dir={stopped}", f"reward.async={mode == 'async'}", *reward, "reward.kwargs.fail_calls=[1,2]"]
        assert run_cli("train", CONFIG, *args, *RUN) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: stopped: counting reward: call 2 fails")
        calls[mode] = list(helper_rewards.CALLS)
        state = runs.load_checkpoint(runs.latest_checkpoint(stopped))
        assert state["iteration"] == 0 and state["stats"]["reward_failures"] == 2
    assert calls["async"] == calls["sync"] == [2, 2, 2]
