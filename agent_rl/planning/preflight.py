"""Preflight, largest first: one forward + backward at the largest admissible micro-batch.

Before step 1 the trainer runs the worst case the budgets allow (the micro-batch of the most tokens the packing
can form, `plan.largest_microbatch`: rows x longest row within the cap, rows up to max_total_tokens long, no more
rows than a rank's step holds), so a run that will run out of memory fails in its first minute
with the planner's advice, not hours later when the longest sample finally appears.
"""

from __future__ import annotations

import time
import traceback

import torch

from agent_rl.config import Config
from agent_rl.learn.batch import MicroBatch
from agent_rl.learn.policy import compute_autocast, update_logprobs
from agent_rl.runtime.memory import peak_rss_bytes


class PreflightError(RuntimeError):
    pass


def _is_oom(err: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator raises a plain RuntimeError."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and (
        "can't allocate memory" in text or "not enough memory" in text or "out of memory" in text.lower()
    )


def _optimizer_state_stand_in(optimizer) -> list[torch.Tensor]:
    """Zeros the size of the state AdamW allocates at its first step (two moments per trained
    parameter), held through the pass so its peak is a real step's; the
    optimizer's own state stays empty, so the first step is the step it would have been."""
    if optimizer is None or any(optimizer.state.values()):
        return []
    return [
        torch.zeros_like(p)  # beside the parameter, as AdamW keeps them (FSDP's offload: in host RAM)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad
        for _ in range(2)
    ]


def run_preflight(model, cfg: Config, device: str, optimizer=None) -> dict:
    """One forward and backward at the largest admissible micro-batch, with `optimizer`'s state
    (not allocated before its first step) stood in for, so what runs out of memory here would run out
    in the first update."""
    from agent_rl.planning.plan import largest_microbatch, optimizer_step_rows

    held = _optimizer_state_stand_in(optimizer)
    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    cap, longest = cfg.train.max_tokens_per_microbatch, cfg.budget.max_total_tokens
    rows, length = largest_microbatch(cap, longest, -(-optimizer_step_rows(cfg) // ranks))
    vocab = model.config.vocab_size if hasattr(model, "config") else 1000
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length), generator=gen).to(device)
    start = time.perf_counter()
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    try:
        # The most tokens a trajectory can have trained: every turn at its cap (the LM head runs on these).
        trained = min(length - 1, (cfg.budget.max_turns + 1) * cfg.budget.max_tokens_per_turn)
        mask = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        mask[:, length - trained :] = 1.0
        mb = MicroBatch(index=list(range(rows)), input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask)
        with compute_autocast(cfg.train, device):
            lp, _ = update_logprobs(cfg.algo, cfg.train, model, mb, cfg.rollout.temperature)
        lp.sum().backward()
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        if not _is_oom(err):
            raise
        # The failed pass's activations live on in the traceback's frames: freed before the planner
        # runs, which needs memory of its own (the machine has just run out).
        traceback.clear_frames(err.__traceback__)
        advice = ""
        try:
            from agent_rl.planning.plan import plan

            res = plan(cfg)
            advice = "; ".join(f["fix"] for f in res.fixes[:3])
        except Exception:  # the advice is best effort; the OOM is the message
            pass
        raise PreflightError(
            f"preflight at the largest micro-batch ({rows} x {length} tokens) ran out of memory: {err}. Try: "
            + (
                advice
                or "lower train.max_tokens_per_microbatch or budget.max_total_tokens, "
                "or turn on model.gradient_checkpointing"
            )
        ) from err
    finally:
        model.zero_grad(set_to_none=True)
    report = {
        "rows": rows,
        "tokens": rows * length,
        "seconds": round(time.perf_counter() - start, 2),
        "peak_rss_gib": round(peak_rss_bytes() / 2**30, 3),
        "optimizer_state_gib": round(sum(t.numel() * t.element_size() for t in held) / 2**30, 6),
    }
    del held
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        report["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return report
