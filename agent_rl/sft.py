"""`agent-rl sft`: a supervised warm start on scripted demonstration trajectories.

A demonstration follows the row's `metadata.queries` (the natural query per hop, as the toy world
writes it): `<search> q </search>` + the real observation from the retriever (loss mask 0, exactly
as in RL) ... `<answer> a </answer>`; in `rollout.protocol: tool_calls` the same searches as tool
calls and tool messages in the chat template, the answer ending its turn. Each time a demonstration
is drawn into a batch, with probability `sft.wrong_fraction` it ends with a wrong answer drawn
afresh from the answer pool, so SFT teaches the format and the search habit without saturating EM
and RL has headroom. The wrong answer is redrawn on every draw, never fixed per demonstration: a
fixed wrong answer can only be learnt by memorising the entity, which pulls the policy away from
reading the passage.

The demonstrator can be made weaker the way real warm starts are: with `sft.second_hop_fraction`
below 1, a two-hop demonstration (one whose `metadata.hop_answers` names the first hop's finding)
makes its second search only that share of the draws; otherwise it stops after the first search
and answers with what that search found (the founder, not the founder's city). The warm start then
knows the second search but rarely takes it, which is the skill RL has to find and reinforce.

With `sft.observation_loss` > 0 the observations are trained too, at that weight (TRL's SFT trains
tool messages unless `assistant_only_loss` is set): a passage repeats its title's name, so a model
trained from scratch practises the copy that its searches and answers need; the prompt never is.
"""

from __future__ import annotations

import random
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch

from agent_rl.config import Config, SftConfig
from agent_rl.learn.batch import collate, pack_microbatches
from agent_rl.learn.policy import forward_logprobs, load_policy
from agent_rl.learn.update import share_prefix
from agent_rl.rollout.engines import Engine
from agent_rl.rollout.prompts import load_prompts, load_tokenizer
from agent_rl.rollout.retriever import format_documents
from agent_rl.rollout.tools import search_depth
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.rollout.turns import Turns
from agent_rl.run import open_loop
from agent_rl.world import LocalWorld
from retriever_server.answers import contains_answer


def build_demonstrations(cfg: Config, turns: Turns) -> Demonstrations:
    """The scripted prefix of every demonstration (prompt, searches, observations) and the answer pool, in the
    protocol of `turns` (a loop `open_loop` assembled: its tokenizer, budget, format and retriever client);
    nothing is generated."""
    tokenizer, budget, fmt, obs, client = turns.tok, turns.budget, turns.format, turns.obs, turns.client
    assert client is not None  # the demonstrations' observations are real searches
    prompts = turns.admit(load_prompts(cfg.data.train_files, tokenizer, budget))
    answers_pool = sorted({a for it in prompts.items for a in it.golden_answers[:1]})
    rows = [(it, meta) for it, meta in zip(prompts.items, prompts.metadata) if meta.get("queries")]
    if not rows:
        raise ValueError(
            "no training row carries metadata.queries: scripted demonstrations need the toy world (data.toy_world)"
        )
    unique = sorted({q for _, m in rows for q in m["queries"][: cfg.budget.max_turns]})
    cache: dict[str, list[dict]] = {}
    for lo in range(0, len(unique), 64):
        chunk = unique[lo : lo + 64]
        for q, docs in zip(chunk, client.retrieve(chunk, search_depth(cfg))):
            cache[q] = docs
    demos, stops = [], []
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for it, meta in rows:
        t = Trajectory(it.prompt_id, it.data_source, turns._prompt(it.prompt_ids), list(it.golden_answers))
        queries = meta["queries"][: cfg.budget.max_turns]
        hop_answers = meta.get("hop_answers") or []
        stop = None  # a two-hop row: (response length after the first observation, the first hop's answer)
        seen: set[str] = set()  # with retriever.new_passages a search shows what the demonstration has not read
        for i, q in enumerate(queries):
            t.append(enc(fmt.call_text("search", q)), sampled=True)
            docs = [d for d in cache[q] if d.get("id") not in seen][: cfg.retriever.topk]
            seen |= {str(d.get("id")) for d in docs} if cfg.retriever.new_passages else set()
            ids, _ = obs.build(format_documents(docs), budget.obs_allowance(t.total_tokens))
            t.append(ids, sampled=False)
            if i == 0 and len(queries) > 1 and len(hop_answers) > 1:
                stop = (len(t.response_ids), hop_answers[0])
        demos.append(t)  # the prefix: prompt, searches and observations; the answer is added per draw
        stops.append(stop)
    if cfg.sft.answer_in_observation:
        found = [i for i, t in enumerate(demos) if contains_answer(observed_text(tokenizer, t), t.golden_answers)]
        print(
            f"[sft] sft.answer_in_observation: {len(found)} of {len(demos)} demonstrations read a gold answer",
            file=sys.stderr,
        )
        if not found:
            raise ValueError(
                "sft.answer_in_observation: no demonstration's observations hold a gold answer "
                f"(retriever.topk={cfg.retriever.topk}); raise retriever.topk or set sft.answer_in_observation=false"
            )
        demos, stops = [demos[i] for i in found], [stops[i] for i in found]
    finals = answers_pool + [it.golden_answers[0] for it, _ in rows] + [s[1] for s in stops if s]
    answer_ids = {a: enc(fmt.answer_text(a)) for a in finals}
    longest = max(len(v) for v in answer_ids.values())
    keep = [i for i, t in enumerate(demos) if t.total_tokens + longest <= budget.max_total_tokens]
    return Demonstrations([demos[i] for i in keep], answers_pool, answer_ids, [stops[i] for i in keep])


def observed_text(tokenizer, t: Trajectory) -> str:
    """What a trajectory read: its observation tokens decoded, tags as spaces (so that "Oslo.</information>"
    still holds the word "Oslo" for `contains_answer`)."""
    text = tokenizer.decode([i for i, m in zip(t.response_ids, t.loss_mask) if not m])
    return re.sub(r"<[^>]*>", " ", text)


class Demonstrations:
    """Scripted prefixes plus the answer pool; `draw` appends the golden answer or, with probability
    wrong_fraction, a wrong one drawn afresh; a two-hop prefix is cut after its first search, answered
    with the first hop's finding, unless a draw below second_hop_fraction keeps the second search."""

    def __init__(
        self,
        prefixes: list[Trajectory],
        pool: list[str],
        answer_ids: dict[str, list[int]],
        stops: list[tuple[int, str] | None],
    ):
        self.prefixes, self.pool, self.answer_ids, self.stops = prefixes, pool, answer_ids, stops

    def __len__(self) -> int:
        return len(self.prefixes)

    def draw(
        self, index: int, wrong_fraction: float, rng: random.Random, second_hop_fraction: float = 1.0
    ) -> Trajectory:
        prefix, stop = self.prefixes[index], self.stops[index]
        end = len(prefix.response_ids)
        answer = prefix.golden_answers[0]
        if stop is not None and rng.random() >= second_hop_fraction:
            end, answer = stop  # the weaker demonstrator: one search, then what it found
        elif rng.random() < wrong_fraction:
            wrong = [a for a in self.pool if a not in prefix.golden_answers]
            answer = rng.choice(wrong) if wrong else answer
        t = Trajectory(prefix.prompt_id, prefix.data_source, prefix.prompt_ids, prefix.golden_answers)
        t.response_ids, t.loss_mask, t.logprobs = (
            prefix.response_ids[:end],
            prefix.loss_mask[:end],
            prefix.logprobs[:end],
        )
        t.append(self.answer_ids[answer], sampled=True)
        return t


def sft(cfg: Config) -> Path:
    """`agent-rl sft`: the host allocator, first-use preparation, then `train_sft`."""
    from agent_rl.bootstrap.prepare import prepare
    from agent_rl.runtime import allocator

    host_allocator = allocator.setup(allocator.mmap_threshold_mib(cfg.train, cfg.rollout))
    print(f"[sft] host allocator: {host_allocator}", file=sys.stderr)
    prepare(cfg)
    return train_sft(cfg)


def observation_weight(sft_cfg: SftConfig, step: int) -> float:
    """The observations' weight in the loss at SFT step `step` (from 1): `sft.observation_loss`, held, or falling
    linearly to 0 over the first `sft.observation_loss_steps` steps (0 after them)."""
    weight, span = sft_cfg.observation_loss, sft_cfg.observation_loss_steps
    return weight if span <= 0 else weight * max(0.0, 1.0 - (step - 1) / span)


def shared_opening(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares, less one: what `sft.opening_free_fraction` cuts (each
    prompt keeps at least its last token)."""
    first, shortest = prompts[0], min(len(p) for p in prompts)
    n = 0
    while n < shortest - 1 and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def without_opening(t: Trajectory, opening: int) -> Trajectory:
    """`t` with its prompt's first `opening` tokens cut; the response (and what it trains) as it was."""
    return replace(t, prompt_ids=t.prompt_ids[opening:])


def train_sft(cfg: Config) -> Path:
    """Train on scripted demonstrations; save to `model.warm_start` (or OUTPUT_DIR/sft). What the config
    names must exist (`prepare`): `sft` and the trainer's setup, which has prepared it, call this."""
    out = Path(cfg.model.warm_start or Path(cfg.run.output_dir) / "sft")
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    model = load_policy(cfg.model, cfg.model.path, cfg.train.device)
    with open_loop(cfg, cast(Engine, None), tokenizer) as loop:  # the loop's turns; nothing generated
        demos = build_demonstrations(cfg, loop)
    print(
        f"[sft] {len(demos)} scripted demonstrations; {cfg.sft.steps} steps of batch {cfg.sft.batch_size}",
        file=sys.stderr,
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.sft.lr)
    # Linear warm-up over 50 steps (a quarter of a shorter run), then linear decay to 5% at the end.
    warmup = min(50, max(1, cfg.sft.steps // 4))
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / max(1, cfg.sft.steps))
    )
    every = max(1, min(100, cfg.sft.steps // 10))
    opening_free = round(cfg.sft.opening_free_fraction * cfg.sft.steps)
    opening = shared_opening([t.prompt_ids for t in demos.prefixes]) if opening_free else 0
    if opening:
        print(f"[sft] steps 1-{opening_free} without the {opening}-token shared opening", file=sys.stderr)
    model.train()
    share = share_prefix(cfg.train, model, LocalWorld())
    start = time.perf_counter()
    for step in range(1, cfg.sft.steps + 1):
        weight = observation_weight(cfg.sft, step)  # of each observation token in the loss; 1 for a demonstrated one
        batch = [
            demos.draw(rng.randrange(len(demos)), cfg.sft.wrong_fraction, rng, cfg.sft.second_hop_fraction)
            for _ in range(cfg.sft.batch_size)
        ]
        if step <= opening_free:
            batch = [without_opening(t, opening) for t in batch]
        mask_tokens = sum(sum(1.0 if m else weight for m in t.loss_mask) for t in batch)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for index in pack_microbatches([t.total_tokens for t in batch], cfg.train.max_tokens_per_microbatch):
            mb = collate(batch, index, tokenizer.pad_token_id, cfg.train.device, weight)
            # The head only at trained tokens: the demonstrated ones, and the observations only at a weight above
            # 0 (`sft.observation_loss`, their weight in mb.loss_mask); the prompt never. The span every
            # demonstration opens with (the system prompt, the tools' schemas) runs once, or the rows run packed:
            # whichever runs fewer positions.
            logprobs, _ = forward_logprobs(
                model, mb, 1.0, share_prefix=share, common_prefix=True, pack=cfg.train.pack_rows
            )
            loss = -(logprobs * mb.loss_mask).sum() / max(1, mask_tokens)  # the mask holds each token's weight
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        sched.step()
        if step % every == 0 or step == cfg.sft.steps:
            print(
                f"[sft] step {step}/{cfg.sft.steps} loss {total:.4f} ({time.perf_counter() - start:.0f}s)", flush=True
            )
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out) if not out.exists() else (__import__("shutil").rmtree(out), tmp.replace(out))
    print(f"[sft] saved the warm start to {out}", file=sys.stderr)
    return out
