"""Policy, reference and critic modules, and the forward passes the update needs.

Devices are explicit: every module is placed with `.to(device)` from config; nothing is ever
wrapped in `nn.DataParallel` (TRL's auto-wrap spreads training onto the generation GPU).
With LoRA the frozen base doubles as the reference model (adapters disabled), so no second
copy is held.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from agent_rl.config import PREFIX_MAX_SHARE, AlgoConfig, ModelConfig, TrainConfig
from agent_rl.learn.batch import MicroBatch, to_device
from agent_rl.learn.losses import entropy_from_logits, token_logprobs
from agent_rl.rollout.padding import distinct, left_pad
from agent_rl.world import World

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(model_cfg: ModelConfig, path: str, device: str) -> Any:  # a transformers causal LM, or its peft wrapper
    """The trained policy. Trained parameters are float32 master weights whatever `model.dtype`
    says: AdamW on bf16 parameters rounds away every update below half a bf16 ulp (at lr 1e-6 an
    Adam step on a 0.02 weight is ~100x smaller), so a bf16 run would silently not learn. With
    LoRA the frozen base stays in `model.dtype` and the adapters are float32. Compute in bf16 is
    `train.bf16` (`compute_autocast`)."""
    from transformers import AutoModelForCausalLM

    dtype = _DTYPES[model_cfg.dtype] if model_cfg.lora.enabled else torch.float32
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if model_cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lora = model_cfg.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                task_type="CAUSAL_LM",
            ),
        )
    return model


def compute_autocast(train: TrainConfig, device: str | torch.device):
    """bf16 compute over fp32 weights in one process (`train.bf16`); a no-op otherwise. Under
    FSDP2 the MixedPrecisionPolicy does the casting instead (agent_rl.runtime.distributed.shard_model)."""
    if not train.bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def trainer_autocast(train: TrainConfig, world: World):
    """The arithmetic of the trainer's forwards: bf16 autocast in one process (`compute_autocast`); under FSDP its
    mixed-precision policy casts instead, so nothing here. Every forward whose log-probs are compared with the
    update's (the collapse guard's update signal) runs under it too."""
    return contextlib.nullcontext() if world.sharded else compute_autocast(train, train.device)


def frozen_copy(model: nn.Module, device: str, dtype: torch.dtype | None = None) -> nn.Module:
    import copy

    ref = copy.deepcopy(model).to(device=device, dtype=dtype) if dtype is not None else copy.deepcopy(model).to(device)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


@contextlib.contextmanager
def reference_mode(policy: Any, ref: nn.Module | None):
    """Yield the module that computes reference log-probs: the frozen copy, or the LoRA base."""
    if ref is not None:
        yield ref
    elif hasattr(policy, "disable_adapter"):
        with policy.disable_adapter():
            yield policy
    else:
        raise RuntimeError("no reference model: algo.kl_coef > 0 needs a frozen copy or LoRA")


class ValueModel(nn.Module):
    """The PPO critic: the policy's backbone (its own copy) plus a scalar head."""

    def __init__(self, causal_lm: Any):  # a transformers causal LM
        super().__init__()
        self.backbone = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.model
        hidden = causal_lm.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """values: (B, T); column t is the value of the state before token t (hidden of t-1)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # The head runs in its own (possibly FSDP-cast bf16) dtype; the values are float32.
        v = self.head(hidden.to(self.head.weight.dtype)).float().squeeze(-1)
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


def forward_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool = False,
    share_prefix: bool = False,
    selected: bool = True,
    chunk_tokens: int = 512,
    pack: bool = False,
    common_prefix: bool = False,
):
    """Token log-probs (B, T) aligned so column t scores token t; 0 where `loss_mask` is 0.

    The model runs to its last hidden state; the LM head, temperature, log-softmax and entropy are
    applied only at the positions that predict a trained token (`loss_mask` 1), so no
    (rows x sequence x vocab) tensor exists: the logits follow the trained tokens, not the prompt
    and the observations (slime#2253). The head is applied inside the model's own forward (a
    pre-hook on the output embedding picks the positions), so FSDP2's all-gathers, tied embeddings
    and LoRA work unchanged; the float32 log-softmax runs in chunks of `chunk_tokens` trained
    tokens, each recomputed in backward rather than stored. Logits are divided by the sampling
    temperature, as the engine sampled them (verl does the same). With `share_prefix`, rows with
    the same prompt (a GRPO group) run that prompt through the model once (`_prefix_plan`); with
    `common_prefix` too, the leading span every row of the micro-batch shares (a system prompt and the
    tools' schemas, in SFT's demonstrations) runs once where that runs fewer positions.
    `selected=False` is the plain full-vocabulary path, kept as the reference the tests and
    benchmarks compare with. With `pack` (and no shared prefix), rows run packed: several to a row
    of the same width, each with its own positions and a block-diagonal causal mask
    (`pack_plan`), so padding tokens mostly do not go through the model. Returns (logprobs,
    entropy or None).
    """
    if not selected:
        return _full_logprobs(model, mb, temperature, with_entropy, share_prefix, common_prefix)
    host = mb.on_host()  # every position and length below is read on the host, never from the device
    target = host.loss_mask > 0
    target[:, 0] = False  # nothing predicts the first token
    plan = _prefix_plan(mb, common_prefix) if share_prefix else None
    packed = pack_plan(mb) if pack else None
    if packed is not None and plan is not None:  # whichever runs fewer tokens through the model
        if packed.input_ids.numel() <= _prefix_cells(mb, plan):
            plan = None
        else:
            packed = None
    if plan is None:
        rows, cols = torch.nonzero(target, as_tuple=True)
        at_rows, at = (packed.row[rows], packed.offset[rows] + cols - 1) if packed is not None else (rows, cols - 1)
        rows, cols, labels, at_rows, at = _to(mb.input_ids.device, rows, cols, host.input_ids[rows, cols], at_rows, at)
        with _head_at(model, at_rows, at):
            if packed is not None:
                out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            else:
                out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        logits = out.logits[0]
    else:
        logits, rows, cols, labels = _shared_prefix_selected(model, mb, target, plan)
    lp, ent = selected_logprobs(logits, labels, temperature, with_entropy, chunk_tokens)
    shape = mb.input_ids.shape
    logprobs = torch.zeros(shape, dtype=lp.dtype, device=lp.device).index_put((rows, cols), lp)
    entropy = (
        None if ent is None else torch.zeros(shape, dtype=ent.dtype, device=ent.device).index_put((rows, cols), ent)
    )
    return logprobs, entropy


def _to(device: torch.device, *host: torch.Tensor) -> list[torch.Tensor]:
    """Host integer (or 0/1) tensors on `device`, in one copy (`to_device`) where that is not the host."""
    if device.type == "cpu":
        return list(host)
    flat = to_device(torch.cat([t.reshape(-1).long() for t in host]), device)
    parts = flat.split([t.numel() for t in host])
    return [part.view(t.shape).to(t.dtype) for part, t in zip(parts, host)]


def update_logprobs(
    algo: AlgoConfig,
    train: TrainConfig,
    model: nn.Module,
    mb: MicroBatch,
    temperature: float,
    share_prefix: bool = False,
):
    """The update's forward as the config sets it (the sampling temperature, entropy when the loss or the log
    reads it, packed rows): used by the update and by the preflight that must run the same pass."""
    return forward_logprobs(
        model,
        mb,
        temperature,
        with_entropy=algo.entropy_coef > 0 or algo.log_entropy,
        share_prefix=share_prefix,
        pack=train.pack_rows,
    )


@dataclass
class PackPlan:
    """Rows of a micro-batch packed into fewer rows of the same width.

    Row r of the micro-batch is columns `offset[r]` .. `offset[r] + length` of packed row `row[r]`.
    `position_ids` restart at 0 for every sequence (and for the padding at a packed row's end);
    given position ids and no attention mask, transformers builds the block-diagonal causal mask
    from where they restart, so no token attends across sequences.
    """

    input_ids: torch.Tensor  # (P, W) on the micro-batch's device
    position_ids: torch.Tensor  # (P, W) on the micro-batch's device
    row: torch.Tensor  # (B,) packed row of each row, on the host
    offset: torch.Tensor  # (B,) first column of each row in its packed row, on the host


def pack_plan(mb: MicroBatch) -> PackPlan | None:
    """First-fit decreasing of the rows into rows of the micro-batch's width; None when that saves
    no row (then padding costs nothing extra). Planned and laid out on the host (`MicroBatch.host`),
    then moved in one copy."""
    host = mb.on_host()
    lengths = host.lengths
    width = mb.input_ids.shape[1]
    used: list[int] = []
    place = [(0, 0)] * len(lengths)
    for r in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        b = next((b for b, u in enumerate(used) if u + lengths[r] <= width), len(used))
        if b == len(used):
            used.append(0)
        place[r] = (b, used[b])
        used[b] += lengths[r]
    if len(used) == len(lengths):
        return None
    row = torch.tensor([b for b, _ in place], dtype=torch.long)
    offset = torch.tensor([o for _, o in place], dtype=torch.long)
    n, cells = len(lengths), len(used) * width
    col = torch.arange(width)
    real = col[None] < torch.tensor(lengths)[:, None]  # (B, W)
    # each token's cell in the packed rows (flat); a padding token gets a spare cell of its own past them
    cell = torch.where(real, (row * width + offset)[:, None] + col, cells + torch.arange(n * width).view(n, width))
    ids = host.input_ids.new_zeros(cells + n * width).scatter_(0, cell.flatten(), host.input_ids.flatten())
    tail = (col[None] - torch.tensor(used)[:, None]).flatten()  # past a packed row's last sequence: a block of its own
    positions = torch.cat([tail, tail.new_zeros(n * width)]).scatter_(0, cell.flatten(), col.expand(n, width).flatten())
    ids, positions = _to(mb.input_ids.device, ids[:cells].view(-1, width), positions[:cells].view(-1, width))
    return PackPlan(ids, positions, row, offset)


@contextlib.contextmanager
def _head_at(model: Any, rows: torch.Tensor, positions: torch.Tensor):
    """While active, the model's output embedding sees only hidden[rows, positions] (as (1, N, H))."""

    def pick(module, args):
        return (args[0][rows, positions][None], *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()


def _chunk_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    lg = logits.float()
    if temperature > 0 and temperature != 1.0:
        lg = lg / temperature
    logp = torch.log_softmax(lg, dim=-1)
    lp = logp.gather(-1, labels[:, None]).squeeze(-1)
    if not with_entropy:
        return lp, lp.new_zeros(())
    return lp, -(logp.exp() * logp).sum(-1)


def selected_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool = False, chunk_tokens: int = 512
):
    """logits: (N, V) at the trained positions, labels: (N,) -> log-probs (N,), entropy (N,) or None.

    Float32 work in chunks of `chunk_tokens`; under autograd each chunk is recomputed in backward
    (activation checkpointing), so the float32 (N, V) softmax is never held for the backward.
    """
    from torch.utils.checkpoint import checkpoint

    lps, ents = [], []
    grad = torch.is_grad_enabled() and logits.requires_grad
    for lo in range(0, logits.shape[0], chunk_tokens):
        args = (logits[lo : lo + chunk_tokens], labels[lo : lo + chunk_tokens], temperature, with_entropy)
        lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = logits.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def _full_logprobs(
    model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool, share_prefix: bool, common: bool = False
):
    """The full-vocabulary reference: logits over every position, then log-softmax."""
    plan = _prefix_plan(mb, common) if share_prefix else None
    if plan is None:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]
        labels, cols, valid = mb.input_ids[:, 1:], None, None
    else:
        logits, labels, cols, valid = _shared_prefix_logits(model, mb, plan)
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    lp = token_logprobs(logits, labels)
    ent = entropy_from_logits(logits) if with_entropy else None
    if plan is None:
        logprobs = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
        entropy = None if ent is None else torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
    else:
        assert cols is not None and valid is not None
        logprobs = lp.gather(1, cols) * valid
        entropy = None if ent is None else ent.gather(1, cols) * valid
    return logprobs, entropy


@dataclass
class _Shared:
    """What a shared-prefix forward runs once: `prompts` (the distinct leading spans), the one each row
    opens with (`groups`), and where each row's own part begins (`starts`: its span's length)."""

    groups: list[int]
    prompts: list[tuple]
    starts: list[int]


def _prefix_plan(mb: MicroBatch, common: bool = False) -> _Shared | None:
    """What to run once, when sharing runs at most 90% of the padded token positions, else None: its second
    pass and the cache gather cost a few percent, which a smaller saving would not repay (the measurement
    behind the threshold: bench/RESULTS.md). The rows' prompts where rows repeat one (a GRPO group); with
    `common`, the span every row opens with (`_common_span`) where that runs fewer positions."""
    plans = []
    if mb.prompt_lengths:
        ids = mb.on_host().input_ids[:, : max(mb.prompt_lengths)].tolist()  # one read of the host copy
        prompts, groups = distinct(row[:n] for row, n in zip(ids, mb.prompt_lengths))
        if len(prompts) < len(groups):
            plans.append(_Shared(groups, prompts, list(mb.prompt_lengths)))
    span = _common_span(mb) if common else 0
    if span > 0:
        rows = int(mb.input_ids.shape[0])
        plans.append(_Shared([0] * rows, [tuple(mb.on_host().input_ids[0, :span].tolist())], [span] * rows))
    plans = [p for p in plans if max(_suffix_lengths(mb, p)) >= 1]
    if not plans:
        return None
    best = min(plans, key=lambda p: _prefix_cells(mb, p))
    return best if _prefix_cells(mb, best) <= PREFIX_MAX_SHARE * mb.num_tokens else None


def _common_span(mb: MicroBatch) -> int:
    """The leading tokens every row of the micro-batch has alike, up to the first trained token of any row
    (a trained token must be scored by a response pass or the prompt pass's last position, never inside the
    prompt), and short of every row's end."""
    host = mb.on_host()
    ids, trained = host.input_ids, host.loss_mask[:, 1:] > 0
    limit = min(host.lengths) - 1
    if bool(trained.any()):
        limit = min(limit, int(trained.any(0).long().argmax()) + 1)  # column of the first trained token
    if limit < 1 or len(ids) < 2:
        return 0
    same = (ids[:, :limit] == ids[:1, :limit]).all(0).long()
    return int(same.cumprod(0).sum())


def _prefix_cells(mb: MicroBatch, plan: _Shared) -> int:
    """Token positions the shared-prefix forward runs: each distinct span once, then the rows'
    suffixes in their response passes (`tail_buckets`)."""
    lengths = _suffix_lengths(mb, plan)
    passes = tail_buckets(lengths, _pass_cells(mb.input_ids.device))
    return len(plan.prompts) * max(len(p) for p in plan.prompts) + sum(len(b) * lengths[b[0]] for b in passes)


def _suffix_lengths(mb: MicroBatch, plan: _Shared) -> list[int]:
    return [n - p for n, p in zip(mb.on_host().lengths, plan.starts)]


def _pass_cells(device: torch.device) -> int:
    """What one more response pass costs, in token positions: a few on CPU (a pass's fixed work
    is small next to a token's matrices), many on a GPU (kernel launches, smaller kernels)."""
    return 64 if device.type == "cpu" else 4096


def tail_buckets(lengths: list[int], pass_cells: int) -> list[list[int]]:
    """Rows split into response passes of similar length, each padded only to its own longest:
    the split (of the rows sorted by length, longest first) that minimises the positions run plus
    `pass_cells` per pass. A GRPO group's responses often range from a few tokens to the turn's
    limit: one pass pads every row to the longest."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    n = len(order)
    best = [0] + [1 << 62] * n  # best[i]: cost of order[:i]
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):
            cost = best[j] + (i - j) * lengths[order[j]] + pass_cells
            if cost < best[i]:
                best[i], cut[i] = cost, j
    passes, i = [], n
    while i > 0:
        passes.append(order[cut[i] : i])
        i = cut[i]
    return passes[::-1]


def _gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] along dim 0, where `index` repeats rows (a group's prompt serves each of its rows).

    On CPU through `index_select`: the backward of `t[index]` is `index_put_(accumulate=True)`, which
    on CPU adds the repeated rows' gradients with parallel atomic float adds in whatever order the
    threads reach them, so the same seeded run rounded differently each time; index_select's backward
    (`index_add_`) adds them in index order, and is faster there too. Other devices keep `t[index]`
    (CUDA's accumulating index_put sorts the indices; its index_add uses atomics)."""
    return t.index_select(0, index) if t.device.type == "cpu" else t[index]


@dataclass
class _PrefixPass:
    """The prompt pass of a shared-prefix forward, and what the response passes after it need: the
    layout of the rows on the host (`MicroBatch.host`), the prompts' cache and mask on the device."""

    head: Any  # the prompt pass's model output (logits, past_key_values)
    prompt_attn: torch.Tensor  # (G, P) left-padded prompts' attention mask, on the device
    groups: torch.Tensor  # (B,) unique prompt of each row, on the host
    starts: torch.Tensor  # (B,) first response column of each row in the full layout, on the host
    ends: torch.Tensor  # (B,) length of each row, on the host
    input_ids: torch.Tensor  # (B, T) the micro-batch's rows, on the host

    def layout(self, rows: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A response pass over `rows` (host), right-padded to `width`, their longest response: the
        full-layout column of each slot (n, S), whether it holds a real token (0/1), the ids (pads 0) and
        each row's prompt; all on the host."""
        last = self.input_ids.shape[1] - 1
        starts = self.starts[rows]
        cols = starts[:, None] + torch.arange(width)[None]
        valid = cols < self.ends[rows][:, None]
        ids = torch.where(valid, self.input_ids[rows].gather(1, cols.clamp(max=last)), torch.zeros_like(cols))
        return cols, valid.long(), ids, self.groups[rows]

    def tail(self, model: nn.Module, g: torch.Tensor, cols: torch.Tensor, valid: torch.Tensor, ids: torch.Tensor):
        """The response pass over rows of prompts `g` (a `layout`, on the device): each response attends to
        its prompt's cached keys and values, gathered for these rows (`_gather_rows` keeps the graph:
        gradients reach the prompt pass)."""
        from transformers import DynamicCache

        cache = DynamicCache(
            [
                (_gather_rows(layer.keys, g), _gather_rows(layer.values, g))
                for layer in self.head.past_key_values.layers
            ],
            config=cast(Any, model).config,
        )
        return model(
            input_ids=ids,
            attention_mask=torch.cat([self.prompt_attn[g], valid], dim=1),
            position_ids=cols,
            past_key_values=cache,
            use_cache=True,
        )


def _prefix_pass(model: nn.Module, mb: MicroBatch, plan: _Shared, **kw) -> _PrefixPass:
    """Runs the unique prompts once (left-padded, with a KV cache); the response passes gather it.
    Prompts of one length go without an attention mask: transformers would read an all-ones mask back
    from the device only to find it can skip it."""
    host, prompts = mb.on_host(), plan.prompts
    p_ids, p_attn, p_pos = left_pad(prompts, 0)  # any pad id: padded positions are masked out
    p_ids, p_attn, p_pos = _to(mb.input_ids.device, p_ids, p_attn, p_pos)
    padded = min(len(p) for p in prompts) < max(len(p) for p in prompts)
    attn = p_attn if padded else None
    head = model(input_ids=p_ids, attention_mask=attn, position_ids=p_pos, use_cache=True, **kw)
    starts, ends = torch.tensor(plan.starts, dtype=torch.long), torch.tensor(host.lengths, dtype=torch.long)
    return _PrefixPass(head, p_attn, torch.tensor(plan.groups, dtype=torch.long), starts, ends, host.input_ids)


def _shared_prefix_logits(model: nn.Module, mb: MicroBatch, plan: _Shared):
    """Logits scoring every response token, the prompt run once per unique prompt.

    The responses (right-padded, one pass) attend to the gathered prompt cache (`_PrefixPass.tail`),
    so loss and gradient equal those of the full pass up to float rounding. Returns logits (B, S, V)
    and labels (B, S) over response columns, plus `cols` / `valid` (B, T) that map them back to the
    full layout.
    """
    x = _prefix_pass(model, mb, plan)
    width = max(_suffix_lengths(mb, plan))
    cols, valid, ids, g = x.layout(torch.arange(len(plan.starts)), width)
    back = torch.arange(mb.input_ids.shape[1])[None] - x.starts[:, None]
    valid_full = ((back >= 0) & (back < (x.ends - x.starts)[:, None])).float()
    cols, valid, ids, g, back, valid_full = _to(
        mb.input_ids.device, cols, valid, ids, g, back.clamp(0, width - 1), valid_full
    )
    logits = torch.cat(
        [_gather_rows(x.head.logits[:, -1:], g), x.tail(model, g, cols, valid, ids).logits[:, :-1]], dim=1
    )
    return logits, ids, back, valid_full


def _shared_prefix_selected(model: nn.Module, mb: MicroBatch, target: torch.Tensor, plan: _Shared):
    """`_shared_prefix_logits` with the head only at trained positions: logits (N, V), and the
    (rows, cols) of the full layout each one scores with their labels, on the device. The prompt pass
    keeps one position (its last, which predicts the first response token); the responses run in
    passes of rows of similar length (`tail_buckets`), the head at the positions before trained tokens.
    `target` (B, T) marks the trained positions on the host; every pass is planned from it there and
    its indices moved in one copy."""
    x = _prefix_pass(model, mb, plan, logits_to_keep=1)
    suffix = _suffix_lengths(mb, plan)
    passes = [b for b in tail_buckets(suffix, _pass_cells(mb.input_ids.device)) if suffix[b[0]] >= 2]
    # The part of the forward that scores each trained position: 0, the prompt pass (its last position predicts
    # a row's first response token); k, the k-th response pass (the later tokens); past them, none (a prompt
    # token). Positions are ordered as the passes score them: by part, then row in the pass's order, then column.
    rows, cols = torch.nonzero(target, as_tuple=True)
    starts, ends = x.starts[rows], x.ends[rows]
    n, none = len(suffix), len(passes) + 1
    pass_of = torch.full((n,), none, dtype=torch.long)
    place = torch.zeros(n, dtype=torch.long)  # of each row in its pass
    for k, bucket in enumerate(passes):
        pass_of[bucket] = k + 1
        place[bucket] = torch.arange(len(bucket))
    first = (cols == starts) & (ends > starts)
    part = torch.where(first, 0, torch.where((cols > starts) & (cols < ends), pass_of[rows], none))
    order = torch.argsort(torch.where(first, rows, n + ((part * n + place[rows]) * target.shape[1] + cols)))
    rows, cols, starts, part = rows[order], cols[order], starts[order], part[order]
    counts = torch.zeros(none + 1, dtype=torch.long).index_add_(0, part, torch.ones_like(part)).tolist()
    scored = sum(counts[:none])
    host = [rows[:scored], cols[:scored], x.input_ids[rows[:scored], cols[:scored]], x.groups[rows[: counts[0]]]]
    ran, lo = 0, counts[0]
    for k, bucket in enumerate(passes):
        hi = lo + counts[k + 1]
        if hi > lo:  # a pass with no trained token after its first is not run
            layout = x.layout(torch.tensor(bucket, dtype=torch.long), max(suffix[r] for r in bucket))
            # slot j of a response pass predicts response token j + 1
            host += [*layout, place[rows[lo:hi]], cols[lo:hi] - starts[lo:hi] - 1]
            ran += 1
        lo = hi
    moved = _to(mb.input_ids.device, *host)
    rows_d, cols_d, labels, first_groups = moved[:4]
    logits = [_gather_rows(x.head.logits[:, -1], first_groups)]
    for j in range(ran):
        cols_p, valid, ids, g, r_local, slot = moved[4 + 6 * j : 10 + 6 * j]
        with _head_at(model, r_local, slot):
            logits.append(x.tail(model, g, cols_p, valid, ids).logits[0])
    return torch.cat(logits, dim=0), rows_d, cols_d, labels


def assert_no_data_parallel(*modules: nn.Module | None) -> None:
    for m in modules:
        if m is None:
            continue
        for sub in m.modules():
            if isinstance(sub, nn.DataParallel):
                raise RuntimeError("nn.DataParallel found in the trainer; devices must be explicit")
