"""Faults of the GPU path that show on CPU: bf16 without fp32 master weights does not learn, the
PPO critic under FSDP2 bf16, LoRA keys while LoRA is off, optimizer offload on CUDA.

bf16 runs on CPU through `torch.autocast("cpu", torch.bfloat16)` and FSDP2's bf16
MixedPrecisionPolicy runs on gloo ranks, so each fault is reproduced here without a GPU.
"""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from agent_fixtures import torchrun_cmd

from agent_rl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def _trajectories(vocab: int):
    from agent_rl.rollout.trajectory import Trajectory

    rng = random.Random(7)
    out = []
    for g in range(3):
        prompt = [rng.randrange(3, vocab) for _ in range(10)]
        for s, reward in enumerate((1.0, 0.0, 0.0, 1.0)):
            t = Trajectory(
                prompt_id=f"toy-{g}", data_source="toy", prompt_ids=list(prompt), golden_answers=["x"], sample_idx=s
            )
            t.append([rng.randrange(3, vocab) for _ in range(8)], sampled=True, logprobs=[-5.0] * 8)
            t.append([rng.randrange(3, vocab) for _ in range(6)], sampled=False)
            t.append([rng.randrange(3, vocab) for _ in range(5)], sampled=True, logprobs=[-5.0] * 5)
            t.reward, t.end_reason = reward, "answer"
            out.append(t)
    return out


def _one_step(model_dir, overrides, pure_bf16=False):
    from agent_rl.learn.policy import load_policy
    from agent_rl.learn.update import prepare_batch, update

    cfg = load_config(
        ROOT / "configs" / "tiny_cpu_grpo.yaml",
        [f"model.path={model_dir}", "model.warm_start=", "train.lr=1e-6", "train.max_grad_norm=0", *overrides],
    )
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(model_dir), "cpu")
    if pure_bf16:  # what every GPU config did before: bf16 parameters and AdamW state
        policy = policy.to(torch.bfloat16)
    before = {n: p.detach().float().clone() for n, p in policy.named_parameters()}
    trajs = _trajectories(policy.config.vocab_size)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    update(cfg.algo, cfg.train, policy, None, opt, None, batch, random.Random(0), temperature=cfg.rollout.temperature)
    dtypes = {p.dtype for p in policy.parameters()}
    return {n: p.detach().float() - before[n] for n, p in policy.named_parameters()}, dtypes


def test_bf16_step_at_lr_1e6_moves_parameters_as_fp32_does(tiny_model_dir):
    """`model.dtype=bfloat16 train.bf16=true`: parameters and AdamW state stay fp32 (master
    weights), compute runs in bf16, and one step at lr 1e-6 moves the parameters as the fp32 run
    does (same signs, same size up to the bf16 forward's rounding). Pure bf16 parameters (the old
    behaviour) leave most of them where they were."""
    fp32, dtypes32 = _one_step(tiny_model_dir, [])
    mixed, dtypes16 = _one_step(tiny_model_dir, ["model.dtype=bfloat16", "train.bf16=true"])
    pure, _ = _one_step(tiny_model_dir, ["model.dtype=bfloat16"], pure_bf16=True)
    assert dtypes32 == dtypes16 == {torch.float32}
    moved = lambda deltas: sum(int((d != 0).sum()) for d in deltas.values()) / sum(d.numel() for d in deltas.values())  # noqa: E731
    a = torch.cat([d.flatten() for d in fp32.values()])
    b = torch.cat([d.flatten() for d in mixed.values()])
    live = a.abs() > 1e-7
    assert moved(fp32) > 0.9 and moved(mixed) > 0.9
    assert (torch.sign(a[live]) == torch.sign(b[live])).float().mean() > 0.9
    assert float(b.abs().mean()) == pytest.approx(float(a.abs().mean()), rel=0.1)
    assert moved(pure) < 0.1  # the fault: updates below half a bf16 ulp round away


def test_ppo_critic_under_fsdp2_bf16_on_two_gloo_ranks(toy_warm_start, tmp_path):
    """torchrun, 2 gloo ranks, PPO with `train.bf16=true`: the critic's value head is all-gathered
    in bf16 and fed bf16 hidden states (it used to raise a dtype error); the run trains 1 step."""
    from test_train import _overrides

    cache = toy_warm_start["cache"]  # the session's toy world, tiny model and index
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [
        *torchrun_cmd(2, "-m", "agent_rl", "train", "configs/tiny_cpu_grpo.yaml"),
        *_overrides(cache, out, 1),
        "algo.name=ppo",
        "algo.advantage=auto",  # GAE, not the demo config's REINFORCE++
        "algo.kl_coef=0.01",
        "algo.kl_type=k1",
        "train.bf16=true",
        "run.preflight=false",
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert (out / "checkpoints" / "step_1" / "dcp").is_dir()
    assert "loss/value" in (out / "metrics.jsonl").read_text()


def test_lora_keys_without_lora_enabled_are_an_error():
    """`model.lora.rank=8` with LoRA off would silently train full weights: refused, naming
    model.lora.enabled; with model.lora.enabled=true it loads."""
    with pytest.raises(ConfigError, match="model.lora.enabled"):
        load_config(ROOT / "configs" / "tiny_cpu_grpo.yaml", ["model.lora.rank=8"])
    assert (
        load_config(
            ROOT / "configs" / "tiny_cpu_grpo.yaml", ["model.lora.rank=8", "model.lora.enabled=true"]
        ).model.lora.rank
        == 8
    )


def test_offload_optimizer_on_cuda_is_refused_with_the_alternative():
    """train.offload_optimizer did nothing on CUDA: it is refused and the message names
    train.offload_params (FSDP2 CPU offload)."""
    with pytest.raises(ConfigError, match="train.offload_params"):
        load_config(None, ["train.offload_optimizer=true", "train.device=cuda"])


def test_cuda_process_group_has_a_cpu_backend_for_offloaded_tensors():
    """CUDA ranks get a process group with gloo for CPU tensors as well as nccl for CUDA ones, so
    `train.offload_params` can clip gradients on host shards; a plain "nccl" group (the fault)
    maps no backend to CPU tensors. Parsed by torch's own BackendConfig (nccl itself needs a GPU)."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    from agent_rl.runtime.distributed import process_group_backend

    device_map = lambda s: BackendConfig(Backend(s)).get_device_backend_map()  # noqa: E731
    assert "cpu" not in device_map("nccl")  # why offload failed at clipping
    assert device_map(process_group_backend(torch.device("cuda", 1))) == {"cpu": "gloo", "cuda": "nccl"}
    assert device_map(process_group_backend(torch.device("cpu")))["cpu"] == "gloo"


def test_hf_engine_samples_in_the_trainers_compute_dtype(tiny_model_dir):
    """With `train.bf16` the HF engine generates under bf16 autocast, as the trainer computes: its
    log-probs of the sampled tokens are closer to the trainer's bf16 log-probs than to float32 ones.
    Without it, engine and float32 trainer agree to float32 rounding."""
    from agent_rl.learn.batch import collate
    from agent_rl.learn.policy import compute_autocast, forward_logprobs, load_policy
    from agent_rl.rollout.engines import EngineSpec, build_engine
    from agent_rl.rollout.prompts import load_tokenizer
    from agent_rl.rollout.trajectory import Trajectory

    tok = load_tokenizer(str(tiny_model_dir))
    prompt = tok("Question: who wrote the book?", add_special_tokens=False)["input_ids"]
    for bf16 in (True, False):
        cfg = load_config(
            None, [f"model.path={tiny_model_dir}", f"train.bf16={str(bf16).lower()}", "budget.max_total_tokens=1000"]
        )
        torch.manual_seed(0)
        policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
        engine = build_engine(EngineSpec.from_config(cfg), policy, tok, seed=0)
        assert engine.bf16 is bf16
        trajs = []
        for g in engine.generate([prompt] * 4, [24] * 4, 1.0):
            t = Trajectory("p", "toy", prompt, ["x"])
            t.append(list(g.token_ids), sampled=True, logprobs=list(g.logprobs))
            trajs.append(t)
        mb = collate(trajs, list(range(4)), tok.pad_token_id)
        with torch.no_grad():
            fp32, _ = forward_logprobs(policy, mb, 1.0)
            with compute_autocast(load_config(None, ["train.bf16=true"]).train, "cpu"):
                half, _ = forward_logprobs(policy, mb, 1.0)
        m = mb.loss_mask.bool()
        m[:, 0] = False
        to_fp32 = float((mb.rollout_logprobs[m] - fp32[m]).abs().mean())
        to_bf16 = float((mb.rollout_logprobs[m] - half[m]).abs().mean())
        if bf16:
            assert to_bf16 < to_fp32 and to_fp32 > 1e-4
        else:
            assert to_fp32 < 1e-5 < to_bf16


def test_vllm_arguments_follow_the_rollout_device():
    """vLLM's arguments: on CPU the vLLM-CPU workarounds (eager, whole prefills in one step); on CUDA
    vLLM's own defaults (CUDA graphs, its chunked prefill and batched-token budget); a value the
    config sets wins on either device. Built without starting vLLM."""
    from agent_rl.rollout.engines import EngineSpec, vllm_engine_kwargs

    def kwargs(*overrides):
        cfg = load_config(ROOT / "configs" / "tiny_cpu_grpo.yaml", ["rollout.engine=vllm", *overrides])
        return vllm_engine_kwargs("m", EngineSpec.from_config(cfg), seed=0, sleep_mode=False, distributed=False)

    cpu = kwargs("rollout.device=cpu")
    assert cpu["enforce_eager"] is True and cpu["enable_chunked_prefill"] is False
    assert cpu["max_num_batched_tokens"] >= 2048
    assert "gpu_memory_utilization" not in cpu
    cuda = kwargs("rollout.device=cuda", "train.device=cuda")
    assert cuda["enforce_eager"] is False
    assert "enable_chunked_prefill" not in cuda and "max_num_batched_tokens" not in cuda
    assert cuda["gpu_memory_utilization"] == 0.4 and cuda["tensor_parallel_size"] == 1
    set_ = kwargs(
        "rollout.device=cuda",
        "rollout.enforce_eager=true",
        "rollout.enable_chunked_prefill=false",
        "rollout.max_num_batched_tokens=4096",
    )
    assert set_["enforce_eager"] is True and set_["enable_chunked_prefill"] is False
    assert set_["max_num_batched_tokens"] == 4096
    cpu_set = kwargs("rollout.device=cpu", "rollout.enforce_eager=false")
    assert cpu_set["enforce_eager"] is False


def test_tensor_parallel_with_in_process_weight_sync_is_refused():
    """rollout.tensor_parallel_size > 1 makes vLLM start worker processes even when its engine core
    runs in the trainer's process, so handing tensors over in the weight sync would send CUDA
    tensors through vLLM's message queue: refused at load, naming both ways out; with
    rollout.vllm_in_process=false (weights as safetensors bytes) the config loads."""
    base = ["rollout.engine=vllm", "rollout.device=cuda:0", "train.device=cuda:0", "rollout.tensor_parallel_size=2"]
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=2.*vllm_in_process=false.*size=1"):
        load_config(ROOT / "configs" / "tiny_cpu_grpo.yaml", base)
    cfg = load_config(ROOT / "configs" / "tiny_cpu_grpo.yaml", [*base, "rollout.vllm_in_process=false"])
    assert cfg.rollout.tensor_parallel_size == 2
