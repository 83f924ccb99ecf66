"""Memory levers: LoRA trains adapters only with the base as reference; explicit split devices."""

import random

import pytest
import torch

from agent_rl.config import load_config
from agent_rl.learn.batch import collate
from agent_rl.learn.policy import assert_no_data_parallel, forward_logprobs, load_policy, reference_mode
from agent_rl.learn.update import prepare_batch, update
from agent_rl.rollout.engines import EngineSpec, build_engine
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.run import sync_weights


def _batch(vocab: int, groups: int = 2, n: int = 2):
    g = torch.Generator().manual_seed(0)
    trajs = []
    for gi in range(groups):
        prompt = torch.randint(10, vocab, (12,), generator=g).tolist()
        for j in range(n):
            t = Trajectory(f"toy-{gi}", "toy", prompt, ["x"], sample_idx=j)
            t.append(torch.randint(10, vocab, (6,), generator=g).tolist(), sampled=True, logprobs=[-1.0] * 6)
            t.append(torch.randint(10, vocab, (5,), generator=g).tolist(), sampled=False)
            t.append(torch.randint(10, vocab, (4,), generator=g).tolist(), sampled=True, logprobs=[-1.0] * 4)
            t.reward = float(j % 2)
            trajs.append(t)
    return trajs


def _cfg(model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", "budget.max_total_tokens=1000", "train.lr=1e-2", *extra])


def test_lora_trains_adapters_only_and_base_is_reference(tiny_model_dir):
    """With model.lora.enabled only adapter weights change, the optimizer holds adapters only, and
    the reference log-probs (adapters disabled) equal the untouched base model's."""
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tiny_model_dir, "model.lora.enabled=true", "model.lora.rank=4", "algo.kl_coef=0.1")
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trainable = [p for p in policy.parameters() if p.requires_grad]
    total = sum(p.numel() for p in policy.parameters())
    n_train = sum(p.numel() for p in trainable)
    assert 0 < n_train < total / 5
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trajs = _batch(policy.config.vocab_size)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    update(cfg.algo, cfg.train, policy, None, opt, None, batch, random.Random(0), temperature=cfg.rollout.temperature)
    after = policy.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    state_numel = sum(s.numel() for st in opt.state.values() for s in st.values() if torch.is_tensor(s) and s.dim() > 0)
    assert state_numel == 2 * n_train  # exp_avg + exp_avg_sq for adapters only
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    mb = collate(trajs, list(range(len(trajs))), 0)
    with torch.no_grad(), reference_mode(policy, None) as ref:
        ref_lp, _ = forward_logprobs(ref, mb, 1.0)
        base_lp, _ = forward_logprobs(base, mb, 1.0)
    with torch.no_grad():  # outside reference_mode: adapters active again
        pol_lp, _ = forward_logprobs(policy, mb, 1.0)
    assert torch.allclose(ref_lp, base_lp, atol=1e-5)
    assert not torch.allclose(pol_lp, base_lp, atol=1e-5)


def test_split_devices_sync_weights_explicitly(tiny_model_dir):
    """rollout.device != train.device: the engine holds its own copy, synced after an update; no DataParallel."""
    cfg = _cfg(tiny_model_dir, "rollout.device=cpu:0", "train.device=cpu")
    from agent_rl.rollout.prompts import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    engine = build_engine(EngineSpec.from_config(cfg), policy, tok)
    assert engine.model is not policy
    same = build_engine(EngineSpec.from_config(_cfg(tiny_model_dir)), policy, tok)
    assert same.model is policy  # one device: shared module, nothing to sync
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    trajs = _batch(policy.config.vocab_size)
    update(
        cfg.algo,
        cfg.train,
        policy,
        None,
        opt,
        None,
        prepare_batch(cfg.algo, cfg.train, policy, None, None, trajs, 0, False, temperature=cfg.rollout.temperature),
        random.Random(0),
        temperature=cfg.rollout.temperature,
    )
    name, p = next(iter(policy.named_parameters()))
    assert not torch.equal(dict(engine.model.named_parameters())[name], p)
    seconds = sync_weights(engine, policy)
    assert seconds >= 0 and torch.equal(dict(engine.model.named_parameters())[name], p)
    assert_no_data_parallel(policy, engine.model)
    with pytest.raises(RuntimeError, match="DataParallel"):
        assert_no_data_parallel(torch.nn.DataParallel(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("rewards", ["half_equal", "all_equal"])
def test_zero_advantage_rows_skip_the_update_and_leave_the_step_unchanged(tiny_model_dir, rewards):
    """GRPO groups with equal rewards have advantage 0 on every token: with KL and entropy off they
    are left out of the forward/backward (kept in the normaliser), and the parameters after two
    steps (with momentum) equal the plain path's to float tolerance. SGD, not AdamW: Adam divides
    the k_proj bias's float-noise gradient (exactly 0 in theory: softmax ignores a shift of every
    key) by its own size, so both paths would move it by noise-signed full steps."""
    results = {}
    for skip in (True, False):
        torch.manual_seed(0)
        cfg = _cfg(
            tiny_model_dir, f"train.skip_zero_advantage={str(skip).lower()}", "algo.kl_coef=0", "algo.entropy_coef=0"
        )
        policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
        opt = torch.optim.SGD(policy.parameters(), lr=0.5, momentum=0.9)
        metrics = []
        for step in range(2):
            trajs = _batch(policy.config.vocab_size, groups=3, n=2)
            for (
                t
            ) in trajs:  # group toy-0 keeps its 0/1 rewards (not at step 2 of all_equal); the others get equal rewards
                if t.prompt_id != "toy-0" or (rewards == "all_equal" and step == 1):
                    t.reward = 1.0 if t.prompt_id == "toy-1" else 0.0
            batch = prepare_batch(
                cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
            )
            metrics.append(
                update(
                    cfg.algo,
                    cfg.train,
                    policy,
                    None,
                    opt,
                    None,
                    batch,
                    random.Random(step),
                    temperature=cfg.rollout.temperature,
                )
            )
        results[skip] = ({k: v.clone() for k, v in policy.state_dict().items()}, metrics)
    (skipped_params, skipped_metrics), (plain_params, plain_metrics) = results[True], results[False]
    assert skipped_metrics[0]["train/skipped_zero_advantage_rows"] == 4  # groups toy-1 and toy-2
    assert skipped_metrics[1]["train/skipped_zero_advantage_rows"] == (
        4 if rewards == "half_equal" else 5
    )  # all equal: one row still runs
    assert plain_metrics[0]["train/skipped_zero_advantage_rows"] == 0
    moved = [k for k in plain_params if not torch.equal(plain_params[k], _initial(tiny_model_dir)[k])]
    assert moved
    for k in plain_params:
        assert torch.allclose(skipped_params[k], plain_params[k], atol=1e-6, rtol=1e-5), k


def _initial(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def test_trainer_adamw_is_fused_on_plain_params_and_steps_like_the_default(tiny_model_dir):
    """The trainer's AdamW runs fused on plain CPU parameters; three steps with weight decay move
    every parameter as torch's default per-tensor AdamW does (float tolerance), and the state dict
    loads into either (checkpoints resume across both)."""
    from agent_rl.learn.update import adamw

    runs = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = (
            adamw(model.parameters(), 1e-2, (0.9, 0.95), 0.1)
            if fused
            else torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        )
        assert bool(opt.defaults["fused"]) is fused
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        runs[fused] = (model.state_dict(), opt.state_dict())
    for k, v in runs[False][0].items():
        assert torch.allclose(runs[True][0][k], v, atol=1e-6, rtol=1e-5), k
    other = adamw(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).parameters(), 1e-2
    )
    other.load_state_dict(runs[False][1])  # a default-AdamW checkpoint into the fused one
    assert len(other.state) == 4
