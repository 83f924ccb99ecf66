"""TokenBudget arithmetic and the token-capped micro-batching of the trajectory buffer."""

import random

import pytest

from agent_rl.learn.batch import collate, pack_microbatches
from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.buffer import TrajectoryBuffer
from agent_rl.rollout.trajectory import Trajectory


def test_budget_allowances():
    """Turns get min(per-turn, room); observations keep one full turn free for the answer."""
    b = TokenBudget(max_turns=2, max_prompt_tokens=10, max_tokens_per_turn=5, max_obs_tokens=8, max_total_tokens=30)
    assert b.turn_allowance(10) == 5
    assert b.turn_allowance(27) == 3
    assert b.turn_allowance(30) == 0
    assert b.obs_allowance(10) == 8  # room 20 - 5 reserved = 15 -> capped at 8
    assert b.obs_allowance(20) == 5  # room 10 - 5
    assert b.obs_allowance(26) == 0
    assert b.admits_prompt(10) and not b.admits_prompt(11)
    assert not b.is_final_turn(1) and b.is_final_turn(2)


def _traj(n_prompt, n_resp):
    t = Trajectory("p", "toy", list(range(n_prompt)), ["a"])
    t.append(list(range(n_resp)), sampled=True)
    return t


def test_pack_microbatches_hard_cap():
    """Every micro-batch has rows x longest row <= cap, and every row lands exactly once."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(300)]
    packs = pack_microbatches(lengths, 256)
    assert sorted(i for p in packs for i in p) == list(range(300))
    for p in packs:
        assert len(p) * max(lengths[i] for i in p) <= 256
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        pack_microbatches([300], 256)


def test_buffer_admits_whole_groups_only():
    """A group that would overflow the token bound is refused whole and counted."""
    buf = TrajectoryBuffer(max_tokens=100, max_trajectories=10)
    assert buf.add_group([_traj(10, 20), _traj(10, 20)])  # 60 tokens
    assert not buf.add_group([_traj(10, 10), _traj(10, 15)])  # +45 > 100
    assert buf.counters["buffer/dropped_groups"] == 1 and buf.counters["buffer/dropped_tokens"] == 45
    assert len(buf) == 2 and buf.tokens == 60
    assert len(buf.drain()) == 2 and buf.tokens == 0


def test_collate_aligns_mask_with_tokens():
    """The loss mask is 0 on prompt, padding and inserted tokens, 1 on sampled ones."""
    t = Trajectory("p", "toy", [1, 2, 3], ["a"])
    t.append([4, 5], sampled=True)
    t.append([6, 7, 8], sampled=False)
    t.append([9], sampled=True)
    short = _traj(2, 1)
    mb = collate([t, short], [0, 1], pad_id=0)
    assert mb.input_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert mb.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert mb.loss_mask[1].tolist() == [0, 0, 1, 0, 0, 0, 0, 0, 0]
    assert mb.attention_mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0]
