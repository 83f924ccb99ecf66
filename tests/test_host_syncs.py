"""The update never waits for the device a number of times that grows with the batch: the host syncs of one
micro-batch's forward and backward (`update._microbatch_step`) are the same for 4 and 12 rows and for 2 and 4
layers, on each forward path (shared prompt prefix, packed rows, padded rows); and the rest of the update reads its
metrics on the host once, not once a micro-batch, so its count does not grow with the micro-batches either.

What is counted (`count_host_syncs` in bench/update_profile.py, the same on any device): the aten ops that hand a
value to the host or size their output by the values, seen by `torch.profiler` whoever calls them (transformers'
mask checks too): `aten::_local_scalar_dense` (`.item()`, `float()`, `int()`, `bool()`, a tensor as an index),
`aten::nonzero` (which boolean-mask indexing runs too), `masked_select`, `unique`; and every Python call of
`Tensor.tolist`, `Tensor.numpy` and `Tensor.cpu`. On a CPU run these also count reads of host tensors that cost
nothing here (a forward plans from its micro-batch's host copy): a fixed number per forward, so the count is not
zero, but it must not grow. Host-to-device copies are not counted. The optimizer is SGD: CPU's fused AdamW reads
each parameter's step count on the host (a CUDA one does not), which would grow with the layers.
"""

import random
import sys
from pathlib import Path

import pytest
import torch

from agent_rl.config import load_config
from agent_rl.learn import update as update_mod
from agent_rl.learn.policy import load_policy
from agent_rl.rollout.trajectory import Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from update_profile import count_host_syncs  # noqa: E402

PATHS = {  # the forward each micro-batch takes, pinned by the config
    "shared prefix": ["train.share_prompt_prefix=true", "train.pack_rows=false"],
    "packed rows": ["train.share_prompt_prefix=false", "train.pack_rows=true"],
    "padded rows": ["train.share_prompt_prefix=false", "train.pack_rows=false"],
}


@pytest.fixture(scope="module")
def layered_models(tiny_model_dir, tmp_path_factory) -> dict[int, Path]:
    """The tiny Qwen2's architecture with 2 and 4 layers, random weights."""
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    fields = {
        k: v
        for k, v in AutoConfig.from_pretrained(tiny_model_dir).to_dict().items()
        if k not in ("layer_types", "num_hidden_layers", "transformers_version")
    }
    out = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"qwen2_{layers}_layers")
        Qwen2ForCausalLM(Qwen2Config(**fields, num_hidden_layers=layers)).save_pretrained(path)
        out[layers] = path
    return out


def _trajs(rows: int, vocab: int) -> list[Trajectory]:
    """Groups of 4 sharing a 24-token prompt: a sampled turn, an observation (mask 0), an answer; rows of 64, 32,
    50 and 32 tokens (the two short ones pack into one row, the responses run in passes of their own length);
    rewards 1, 0, 1, 0 (no row skipped)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for gi in range(rows // 4):
        prompt = torch.randint(10, vocab, (24,), generator=g).tolist()
        for j, (turn, answer) in enumerate([(20, 14), (1, 1), (12, 8), (1, 1)]):
            t = Trajectory(f"toy-{gi}", "toy", prompt, ["x"], sample_idx=j)
            t.append(torch.randint(10, vocab, (turn,), generator=g).tolist(), sampled=True, logprobs=[-1.0] * turn)
            t.append(torch.randint(10, vocab, (6,), generator=g).tolist(), sampled=False)
            t.append(torch.randint(10, vocab, (answer,), generator=g).tolist(), sampled=True, logprobs=[-1.0] * answer)
            t.reward = float(j % 2 == 0)
            out.append(t)
    return out


def _count(model_dir: Path, rows: int, path: str, microbatches: int = 1) -> tuple[dict, dict, int]:
    """One GRPO update of `rows` trajectories in `microbatches` micro-batches: the syncs inside the micro-batch
    steps (per step, by kind), those of the rest of the update (by kind), and how many steps ran."""
    cap = 64 * rows // microbatches
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "model.lora.enabled=true",
            "budget.max_prompt_tokens=24",
            "budget.max_tokens_per_turn=20",
            "budget.max_total_tokens=64",
            "algo.group_size=4",
            "algo.tis_cap=2.0",
            "algo.log_entropy=true",
            f"train.max_tokens_per_microbatch={cap}",
            *PATHS[path],
        ],
    )
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(model_dir), "cpu")
    trajs = _trajs(rows, policy.config.vocab_size)
    batch = update_mod.prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    passes: list[int] = []  # rows of each pass through the model
    hook = policy.get_decoder().register_forward_pre_hook(
        lambda m, a, kw: passes.append(len(kw["input_ids"])), with_kwargs=True
    )
    step = update_mod._microbatch_step
    steps = 0

    def counted_step(*args, **kwargs):
        nonlocal steps
        steps += 1
        with counter.region("step"):
            return step(*args, **kwargs)

    report: dict[int, list[float] | None] = {i: None for i in range(rows)}  # every row's log-probs reported
    update_mod._microbatch_step = counted_step
    try:
        with count_host_syncs() as counter:
            metrics = update_mod.update(
                cfg.algo,
                cfg.train,
                policy,
                None,
                optimizer,
                None,
                batch,
                random.Random(0),
                trainer_logprobs=report,
                temperature=cfg.rollout.temperature,
            )
    finally:
        update_mod._microbatch_step = step
        hook.remove()
    assert metrics["train/microbatches"] == microbatches == steps
    if microbatches == 1:  # the path taken: the prompts once, then the responses; fewer rows; every row
        want = {"shared prefix": passes[0] == rows // 4 and len(passes) > 1, "packed rows": passes == [rows * 3 // 4]}
        assert want.get(path, passes == [rows]), (path, passes)
    assert all(v is not None for v in report.values())
    inside = counter.regions["step"]
    outside = {k: v - inside.get(k, 0) for k, v in counter.total.items() if v - inside.get(k, 0)}
    return {k: v / steps for k, v in inside.items()}, outside, steps


@pytest.mark.parametrize("path", list(PATHS))
def test_microbatch_syncs_do_not_grow_with_rows_or_layers(layered_models, path):
    """The syncs of one micro-batch's forward and backward, by kind, are the same for 4 and 12 rows and for 2 and
    4 layers; so are those of the rest of the update (metrics, reported log-probs: read once)."""
    seen = {
        (layers, rows): _count(model_dir, rows, path)
        for layers, model_dir in layered_models.items()
        for rows in (4, 12)
    }
    steps = {key: inside for key, (inside, _, _) in seen.items()}
    rest = {key: outside for key, (_, outside, _) in seen.items()}
    assert len({tuple(sorted(c.items())) for c in steps.values()}) == 1, steps
    assert len({tuple(sorted(c.items())) for c in rest.values()}) == 1, rest


def test_update_reads_metrics_once_not_once_a_microbatch(layered_models):
    """12 rows in 1 or 3 micro-batches: the update outside its micro-batch steps makes the same host reads (the
    normalisers once a mini-batch, the metrics and reported log-probs once at the end)."""
    _, one, _ = _count(layered_models[2], 12, "padded rows", microbatches=1)
    _, three, steps = _count(layered_models[2], 12, "padded rows", microbatches=3)
    assert steps == 3
    assert one == three, (one, three)
