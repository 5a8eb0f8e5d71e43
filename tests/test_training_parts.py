"""The parts the Trainer composes (diffalign.training), each on its own: no model, no run directory."""

import math

import pytest
import torch

from diffalign.config_files import load_config
from diffalign.errors import NonFiniteError, RewardError
from diffalign.training import metrics
from diffalign.training.backend import Backend
from diffalign.training.checks import SelfCheckError, check_on_policy, max_log_ratio
from diffalign.training.groups import sample_level_batches, shuffled_share
from diffalign.training.evaluator import eval_items
from diffalign.training.policy import EMA
from diffalign.training.rewards import RewardPool, reward_info

SD3 = "configs/tiny/flow_grpo_sd3.yaml"


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def backend_for(module, accelerator, *overrides):
    cfg = load_config(SD3, ["optim.name=sgd", "optim.lr=0.5", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
                            *overrides])
    stats = {"nonfinite_rewards": 0, "nonfinite_losses": 0, "skipped_steps": 0}
    return Backend(module, cfg, accelerator, torch.device("cpu"), supports_fsdp=False, stats=stats, log=lambda m: None), stats


def test_backend_applies_a_finite_step_and_drops_a_poisoned_one(accelerator):
    lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0]]))
    backend, stats = backend_for(lin, accelerator, "train.max_nonfinite_losses=1")
    x = torch.tensor([[1.0, 1.0]])
    assert backend.accumulate(lin(x).sum())  # d/dw = x = (1, 1)
    norm, applied = backend.close_step(False)
    assert applied and norm == pytest.approx(math.sqrt(2))
    torch.testing.assert_close(lin.weight.detach(), torch.tensor([[0.5, 1.5]]))  # SGD, lr 0.5
    assert not backend.accumulate(lin(x).sum() * float("nan"))  # never reaches the weights
    norm, applied = backend.close_step(True)
    assert not applied and math.isnan(norm) and stats == {"nonfinite_rewards": 0, "nonfinite_losses": 1, "skipped_steps": 1}
    torch.testing.assert_close(lin.weight.detach(), torch.tensor([[0.5, 1.5]]))
    with pytest.raises(NonFiniteError, match="2 consecutive"):
        backend.close_step(True)


def test_optimizer_steps_split_micro_batches_and_count_terms(accelerator):
    backend, _ = backend_for(torch.nn.Linear(2, 1), accelerator, "train.optimizer_steps_per_iteration=3")
    steps = backend.plan_steps([2, 0, 0, 0, 1])  # np.array_split: micro-batches [0, 1], [2, 3], [4]
    assert [s.micro.tolist() for s in steps] == [[0, 1], [4]]  # the middle step has no term: left out
    assert [s.global_terms for s in steps] == [2.0, 1.0] and [s.forwards for s in steps] == [2, 1]
    assert backend.plan_steps([]) == []


def test_shuffled_share_and_sample_level_batches():
    perm = torch.tensor([4, 1, 3, 0, 2, 5])
    keep = torch.tensor([True, True, True, False, True, True])
    order_global, rows = shuffled_share(perm, 2, 3, keep)  # this process holds samples 2, 3, 4; 3 is not kept
    assert order_global.tolist() == [4, 2] and rows.tolist() == [2, 0]
    assert sample_level_batches(3, 2, 2) == [(slice(0, 2), 0), (slice(0, 2), 1), (slice(2, 4), 0), (slice(2, 4), 1)]


def test_backend_keeps_ema_of_the_trainable_weights(accelerator):
    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    backend, _ = backend_for(lin, accelerator, "train.ema.enabled=true", "train.ema.decay=0.5", "train.ema.every=1")
    backend.accumulate(lin(torch.ones(1, 1)).sum())
    backend.close_step(False)  # w: 1 -> 0.5; first update, warm-up decay min(0.5, 1/10) = 0.1: ema 0.1 * 1 + 0.9 * 0.5
    assert float(lin.weight.detach()) == 0.5 and float(backend.ema.shadow[0]) == pytest.approx(0.55)
    with backend.ema.swapped_in():
        assert float(lin.weight.detach()) == pytest.approx(0.55)
    assert float(lin.weight.detach()) == 0.5


def test_ema_updates_at_the_first_step_then_every_n_steps_with_a_warm_up():
    p = torch.nn.Parameter(torch.zeros(1))
    ema = EMA([p], decay=0.9, every=2)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()  # step 1: the first update, d_0 = min(0.9, 1/10) = 0.1 -> 0.1 * 0 + 0.9 * 1
    assert float(ema.shadow[0]) == pytest.approx(0.9) and ema.updates == 1
    ema.update()  # step 2: not an update step
    assert float(ema.shadow[0]) == pytest.approx(0.9) and ema.updates == 1
    with torch.no_grad():
        p.fill_(2.0)
    ema.update()  # step 3: d_1 = 2/11 -> 2/11 * 0.9 + 9/11 * 2
    assert float(ema.shadow[0]) == pytest.approx(2 / 11 * 0.9 + 9 / 11 * 2)
    assert ema.current_decay() == pytest.approx(3 / 12)
    ema.updates = 100
    assert ema.current_decay() == 0.9  # warm-up over: the configured decay


def test_ema_state_round_trips_and_reads_checkpoints_without_an_update_count():
    p = torch.nn.Parameter(torch.ones(1))
    ema = EMA([p], decay=0.9, every=8)
    for _ in range(9):
        ema.update()
    other = EMA([torch.nn.Parameter(torch.zeros(1))], decay=0.9, every=8)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 2 and other.steps == 9 and torch.equal(other.shadow[0], ema.shadow[0])
    old = {"shadow": [torch.ones(1)], "steps": 17}  # written before updates were counted: one per 8 steps
    other.load_state_dict(old)
    assert other.updates == 2


def test_reward_pool_counts_or_refuses_non_finite_rewards():
    calls = []

    def score(images, prompts, metadata):
        calls.append(len(prompts))
        return torch.tensor([1.0, float("nan")]), {"acc": 0.5}

    stats = {"nonfinite_rewards": 0}
    pool = RewardPool(score, asynchronous=True, reward_name="r", nonfinite="skip", stats=stats)
    rewards, info = pool.submit(torch.zeros(2, 3, 4, 4), ["a", "b"]).result()
    pool.shutdown()
    assert calls == [2] and info == {"acc": 0.5}
    pool.check(rewards, 0)
    assert stats["nonfinite_rewards"] == 1
    strict = RewardPool(score, asynchronous=False, reward_name="r", nonfinite="error", stats=stats)
    with pytest.raises(RewardError, match="1 non-finite values .* at iteration 3"):
        strict.check(strict.submit(torch.zeros(2, 3, 4, 4), ["a", "b"]).result()[0], 3)
    assert reward_info([(None, {"acc": 0.5}), (None, {"acc": 1.0})]) == {"reward/acc": 0.75}


def test_on_policy_check():
    assert max_log_ratio(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.5])) == 0.5
    check_on_policy(1e-5, 1e-4, "at step 0")
    with pytest.raises(SelfCheckError, match=r"\|log ratio\| = 0.5 .* at step 0"):
        check_on_policy(0.5, 1e-4, "at step 0")
    with pytest.raises(SelfCheckError):
        check_on_policy(float("nan"), 1e-4, "at step 0")


def test_stats_of_one_process_are_plain_means(accelerator):
    out = metrics.mean_stats(accelerator, torch.device("cpu"), {"loss": [1.0, 3.0], "kl": []})
    assert out["loss"] == 2.0 and math.isnan(out["kl"])
    assert metrics.gather_info(accelerator, {"a": 1.0}) == {"a": 1.0}
    assert metrics.format_eval({"eval/reward_mean": 0.5, "eval/seconds": 3.0}) == "reward_mean 0.500"


def test_eval_items_repeat_list_prompts():
    cfg = load_config(SD3, ["eval.num_prompts=1", "eval.samples_per_prompt=2"])
    assert eval_items(cfg.eval, ["a cat", "a dog"], shapes=False) == ["a cat", "a cat"]

