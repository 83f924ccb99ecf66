"""Packed rows in the update (`train.pack_rows`): several trajectories to a row, each with its own
positions and a block-diagonal causal mask, so padding does not run through the model.

The packed forward equals the padded one in log-probs and every parameter gradient, on the tiny
Qwen2 and on the real SmolLM2 (Llama); whichever of packing and the shared prompt prefix runs
fewer tokens is used; and the parameters after two update steps equal the padded path's.
"""

import random

import pytest
import torch
from test_losses import _trajs

from agent_rl.config import load_config
from agent_rl.learn.batch import collate
from agent_rl.learn.policy import forward_logprobs, load_policy, pack_plan, tail_buckets
from agent_rl.learn.update import prepare_batch, update


def _varied(vocab: int) -> list:
    """Three long trajectories (prompt 40) and three short ones (prompt 4): two short fit beside each other."""
    long = _trajs(vocab, groups=1, n=3, prompt_len=40)
    short = _trajs(vocab, groups=1, n=3, prompt_len=4)
    for t in short:
        t.prompt_id = "toy-short"
    return long + short


def test_pack_plan_places_every_row_once_in_fewer_rows():
    lengths = [30, 12, 10, 18, 7, 29, 5]
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.arange(1, n + 1) + 100 * r
        attn[r, :n] = 1
    mb = collate_like(ids, attn)
    plan = pack_plan(mb)
    assert plan is not None and plan.input_ids.shape[1] == width and len(plan.input_ids) < len(lengths)
    taken = torch.zeros(plan.input_ids.shape, dtype=torch.long)
    for r, n in enumerate(lengths):
        b, o = int(plan.row[r]), int(plan.offset[r])
        assert o + n <= width
        assert torch.equal(plan.input_ids[b, o : o + n], ids[r, :n])
        assert torch.equal(plan.position_ids[b, o : o + n], torch.arange(n))
        taken[b, o : o + n] += 1
    assert int(taken.max()) == 1 and int(taken.sum()) == sum(lengths)
    # rows that cannot share a row: nothing to gain, no plan
    assert pack_plan(collate_like(ids[[0, 5]], attn[[0, 5]])) is None


def collate_like(ids, attn):
    from agent_rl.learn.batch import MicroBatch

    return MicroBatch(index=list(range(len(ids))), input_ids=ids, attention_mask=attn, loss_mask=attn.float())


def _compare(policy, mb, share: bool):
    weights = torch.rand(mb.loss_mask.shape, generator=torch.Generator().manual_seed(1)) * mb.loss_mask
    out = {}
    for pack in (False, True):
        policy.zero_grad()
        rows = []
        hook = policy.get_decoder().register_forward_pre_hook(
            lambda m, a, kw: rows.append(len(kw["input_ids"])), with_kwargs=True
        )
        lp, ent = forward_logprobs(policy, mb, 0.7, with_entropy=True, share_prefix=share, pack=pack)
        hook.remove()
        ((lp + 0.1 * ent) * weights).sum().backward()
        grads = [p.grad.clone() for p in policy.parameters() if p.requires_grad]
        out[pack] = (lp.detach(), ent.detach(), grads, rows)
    (lp0, ent0, g0, rows0), (lp1, ent1, g1, rows1) = out[False], out[True]
    assert torch.allclose(lp0, lp1, atol=2e-5) and torch.allclose(ent0, ent1, atol=2e-5)
    for a, b in zip(g0, g1):
        assert float((a - b).norm()) <= 1e-4 * float(a.norm()) + 1e-6
    return rows0, rows1


def test_packed_forward_equals_padded_tiny(tiny_model_dir):
    """Tiny Qwen2: 6 rows run as 5 (two short ones share a row); same log-probs, entropy, gradients."""
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "budget.max_total_tokens=1000"])
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _varied(policy.config.vocab_size)
    mb = collate(trajs, list(range(len(trajs))), 0)
    rows_padded, rows_packed = _compare(policy, mb, share=False)
    assert rows_padded == [6] and rows_packed == [5]


def test_shared_prefix_or_packing_whichever_runs_fewer_tokens(tiny_model_dir):
    """Groups with long common prompts: the shared prefix runs fewer tokens than packing and is kept
    (two passes: prompts, then suffixes); rows with distinct prompts of unequal length: packing."""
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "budget.max_total_tokens=1000"])
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    grouped = _trajs(policy.config.vocab_size, groups=2, n=3, prompt_len=40)
    _, rows = _compare(policy, collate(grouped, list(range(6)), 0), share=True)
    assert rows == [2, 6]  # the two prompts once, then six suffixes
    distinct = _varied(policy.config.vocab_size)
    for i, t in enumerate(distinct):
        t.prompt_id = f"p{i}"
        t.prompt_ids = [10 + i] + t.prompt_ids[1:]  # no two prompts alike: nothing to share
    _, rows = _compare(policy, collate(distinct, list(range(6)), 0), share=True)
    assert rows == [5]


def test_tail_buckets_split_rows_only_where_a_pass_pays():
    assert tail_buckets([5, 5, 6, 4], 64) == [[2, 0, 1, 3]]  # similar lengths: one pass
    assert tail_buckets([3, 200, 2, 190, 4], 64) == [[1, 3], [4, 0, 2]]
    assert tail_buckets([3, 200, 2, 190, 4], 4096) == [[1, 3, 4, 0, 2]]  # costly passes: one


def test_shared_prefix_responses_of_varied_length_run_in_passes_of_their_own(tiny_model_dir):
    """GRPO groups whose responses range from 2 to 120 tokens: the prompts run once, the responses
    in passes of similar length (far fewer positions than one pass padded to 120), with the same
    log-probs, entropy and gradients as the full-vocabulary single-pass reference."""
    from test_selected_logits import _compare as compare_full

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "budget.max_total_tokens=1000"])
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, groups=2, n=4, prompt_len=60)
    g = torch.Generator().manual_seed(3)
    for i, t in enumerate(trajs):
        extra = [120, 2, 90, 6][i % 4]  # a long and a short answer in every group
        t.append(torch.randint(10, policy.config.vocab_size, (extra,), generator=g).tolist(), sampled=True)
    mb = collate(trajs, list(range(len(trajs))), 0)
    seen = []
    hook = policy.get_decoder().register_forward_pre_hook(
        lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    compare_full(policy, mb, share=True, chunk=64)
    hook.remove()
    reference, selected = seen[:2], seen[2:]  # the full reference ran first: prompts, then one padded pass
    assert len(reference) == 2 and len(selected) > 2
    assert selected[0] == reference[0]  # the same prompt pass
    assert sum(r * c for r, c in selected[1:]) < 0.75 * reference[1][0] * reference[1][1]


def test_update_with_packed_rows_equals_padded_update(tiny_model_dir):
    """Two SGD-momentum update steps (old log-probs too) with rows packed vs padded: same parameters."""
    results = {}
    for pack in (True, False):
        torch.manual_seed(0)
        cfg = load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                "budget.max_total_tokens=1000",
                "algo.group_size=3",
                "algo.ppo_epochs=2",
                f"train.pack_rows={str(pack).lower()}",
                "train.share_prompt_prefix=false",
                "train.skip_zero_advantage=false",
            ],
        )
        policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
        initial = {k: v.clone() for k, v in policy.state_dict().items()}
        opt = torch.optim.SGD(policy.parameters(), lr=0.5, momentum=0.9)
        rows: list[int] = []
        policy.get_decoder().register_forward_pre_hook(
            lambda m, a, kw: rows.append(len(kw["input_ids"])), with_kwargs=True
        )
        trajs = _varied(policy.config.vocab_size)
        batch = prepare_batch(
            cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=True, temperature=cfg.rollout.temperature
        )
        update(
            cfg.algo, cfg.train, policy, None, opt, None, batch, random.Random(0), temperature=cfg.rollout.temperature
        )
        assert rows == ([5] if pack else [6]) * 3  # the old log-probs pass, then one pass per epoch
        results[pack] = {k: v.clone() for k, v in policy.state_dict().items()}
    assert any(not torch.equal(results[False][k], initial[k]) for k in initial)
    for k in results[False]:
        assert torch.allclose(results[True][k], results[False][k], atol=1e-6, rtol=1e-5), k


@pytest.mark.real_model
def test_packed_forward_equals_padded_smollm2(smollm2_dir):
    """The real SmolLM2 (Llama, tied embeddings): the block-diagonal mask holds there too."""
    cfg = load_config(None, [f"model.path={smollm2_dir}", "budget.max_total_tokens=1000"])
    policy = load_policy(cfg.model, str(smollm2_dir), "cpu")
    trajs = _varied(policy.config.vocab_size)
    rows_padded, rows_packed = _compare(policy, collate(trajs, list(range(len(trajs))), 0), share=False)
    assert rows_padded == [6] and rows_packed == [5]
