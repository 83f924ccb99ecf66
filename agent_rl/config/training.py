"""Sections of how a batch of trajectories trains the policy: the algorithm, the optimisation, the
reward, the buffer, the supervised warm start, the collapse guard and the planner's memory budgets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic import with_config

from agent_rl.config.base import Bool, ConfigError, Float, Int, List, Str, _check_choices, _f
from agent_rl.config.plugins import BUILTIN_REWARDS, load_reward

# `train.share_prompt_prefix`: a group's prompt runs once when that leaves at most this share of the
# micro-batch's padded token positions (learn.policy takes it; the memory planner plans with it).
PREFIX_MAX_SHARE = 0.9


@with_config(extra="forbid")
@dataclass
class AlgoConfig:
    name: Str = _f(
        "grpo",
        "grpo (no critic; the advantage is algo.advantage's, group-normalised by default) | ppo (critic + GAE).",
    )
    advantage: Str = _f(
        "auto",
        "Advantage estimator. auto: what algo.name implies (grpo -> grpo, ppo -> gae). grpo: (r - group mean) / "
        "group std, one value per trajectory (algo.norm_adv_by_std=false: Dr. GRPO's advantage). rloo: REINFORCE "
        "Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024): r minus the mean of the other samples of its prompt "
        "(algo.group_size >= 2). reinforce_pp: REINFORCE++ (Hu 2025): per-token return of the reward with the k1 "
        "KL to the reference folded in (algo.kl_type=k1, algo.kl_coef), discounted by algo.gamma, normalised over "
        "the whole batch's trained tokens. reinforce_pp_baseline: REINFORCE++ with the group mean reward "
        "subtracted before that normalisation. gae: the critic's GAE (algo.name=ppo only). Every estimator but gae "
        "runs without a critic, under algo.name=grpo; algo.name=ppo takes gae alone (its critic would go unused).",
    )
    group_size: Int = _f(8, "Samples per prompt (GRPO's n). PPO uses it too when > 1.")
    norm_adv_by_std: Bool = _f(
        True,
        "GRPO: divide by the group std (False: Dr. GRPO's advantage; its loss: algo.loss_agg=seq-mean-token-sum-norm).",
    )
    gamma: Float = _f(1.0, "PPO (GAE) and REINFORCE++: discount.")
    lam: Float = _f(1.0, "PPO: GAE lambda.")
    clip_ratio_low: Float = _f(
        0.2, "Lower clip of the probability ratio (1 - low); gspo clips the sequence ratio; cispo does not use it."
    )
    clip_ratio_high: Float = _f(
        0.2, "Upper clip of the probability ratio (1 + high); gspo: the sequence ratio's; cispo: the weight's cap."
    )
    policy_loss: Str = _f(
        "ppo_clip",
        "Policy loss. ppo_clip: PPO's clipped surrogate per token (DAPO's clip-higher when clip_ratio_high > "
        "clip_ratio_low). gspo: GSPO (Zheng et al. 2025), in its GSPO-token form: one importance ratio per "
        "trajectory, exp of the mean over its trained tokens of (logp - old logp), clipped to [1 - clip_ratio_low, "
        "1 + clip_ratio_high] and applied to each of its tokens; the length-normalised ratio sits much closer to 1 "
        "than a token's, so set far smaller clip ranges than PPO's 0.2 (the paper uses clip_ratio_low=3e-4, "
        "clip_ratio_high=4e-4), and the paper averages per trajectory (algo.loss_agg=seq-mean-token-mean). cispo: "
        "CISPO (MiniMax-M1, 2025): -min(ratio, 1 + clip_ratio_high), detached, x advantage x logp per token, so "
        "every token keeps its gradient (none is clipped out; MiniMax sets no lower bound).",
    )
    loss_agg: Str = _f(
        "token-mean",
        "Loss aggregation. token-mean: over every trained token of the batch. seq-mean-token-mean: each "
        "trajectory's token mean, then the mean over trajectories. seq-mean-token-sum-norm: each trajectory's token "
        "sum over a constant (algo.loss_agg_tokens), then the mean over trajectories: Dr. GRPO's (Liu et al. 2025) "
        "length-unbiased loss, with algo.norm_adv_by_std=false for the whole of Dr. GRPO (verl's mode of that name).",
    )
    loss_agg_tokens: Int = _f(
        0,
        "The constant divisor of algo.loss_agg=seq-mean-token-sum-norm (unread by the others); 0 = the most tokens "
        "a trajectory can train on, min(budget.max_total_tokens - budget.max_prompt_tokens, (budget.max_turns + 1) x "
        "budget.max_tokens_per_turn), Dr. GRPO's generation budget. It scales the loss as a learning rate would.",
    )
    kl_coef: Float = _f(0.0, "Coefficient of the KL to the frozen reference (0 = no reference model is kept).")
    kl_type: Str = _f(
        "low_var_kl",
        "low_var_kl (k3, as a loss term) | k1 (subtracted from the token rewards, PPO style; read by algo.advantage "
        "gae, reinforce_pp and reinforce_pp_baseline).",
    )
    entropy_coef: Float = _f(0.0, "Entropy bonus coefficient.")
    log_entropy: Bool = _f(
        False,
        "Report the policy's entropy at trained tokens (actor/entropy) even when entropy_coef is 0; costs one "
        "pass over the vocabulary per trained token, no backward.",
    )
    filter_groups: Bool = _f(
        False,
        "Dynamic sampling (DAPO; verl's algorithm.filter_groups): keep only groups whose rewards differ (a group "
        "of equal rewards has zero advantage and teaches nothing) and sample further batches of "
        "rollout.prompts_per_step prompts until that many groups are kept or algo.max_gen_batches is reached; "
        "the update sees rollout.prompts_per_step informative groups (fewer when the batches run out).",
    )
    max_gen_batches: Int = _f(
        4,
        "With algo.filter_groups: most rollout batches sampled in one step (>= 1); then the step trains on what "
        "it kept.",
    )
    ppo_epochs: Int = _f(1, "Update epochs over each rollout batch.")
    mini_batch_size: Int = _f(
        0,
        "Trajectories per optimizer step (0 = the whole rollout batch in one step); a shorter remainder joins "
        "the last step.",
    )
    tis_cap: Float = _f(
        0.0,
        "Truncated importance sampling: weight each token's surrogate by min(pi_old / pi_engine, tis_cap) to correct "
        "the engine-trainer mismatch (verl, OpenRLHF; 2.0 is common). 0 = off.",
    )
    value_clip: Float = _f(0.2, "PPO: clip range of the value loss (0 = unclipped).")
    critic_lr: Float = _f(1e-4, "PPO: learning rate of the critic.")

    def resolved_advantage(self) -> str:
        """The estimator `advantage` names; auto: grpo under algo.name=grpo, gae under ppo."""
        if self.advantage == "auto":
            return "gae" if self.name == "ppo" else "grpo"
        return self.advantage

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "name": ("grpo", "ppo"),
        "advantage": ("auto", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"),
        "policy_loss": ("ppo_clip", "gspo", "cispo"),
        "loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        "kl_type": ("low_var_kl", "k1"),
    }

    def validate(self) -> None:
        """The algo section's own checks; a message names the key and says what to do."""
        _check_choices("algo", self, self.CHOICES)
        advantage = self.resolved_advantage()
        if self.name == "ppo" and advantage != "gae":
            raise ConfigError(
                f"algo.advantage={advantage} with algo.name=ppo: PPO trains a critic for GAE, and {advantage} would "
                f"leave it unused. Set algo.name=grpo (no critic) to train with {advantage}, or algo.advantage=auto "
                "(GAE) to keep the critic"
            )
        if self.name == "grpo" and advantage == "gae":
            raise ConfigError(
                "algo.advantage=gae needs a critic, which only algo.name=ppo trains; set algo.name=ppo, or pick a "
                "critic-free algo.advantage (grpo, rloo, reinforce_pp, reinforce_pp_baseline)"
            )
        if advantage in ("grpo", "rloo") and self.kl_type == "k1" and self.kl_coef > 0:
            raise ConfigError(
                f"algo.kl_type=k1 puts the KL into per-token rewards, which only GAE and REINFORCE++ read; "
                f"algo.advantage={advantage} would ignore it. Set algo.kl_type=low_var_kl (KL as a loss term, as "
                "Search-R1's GRPO runs do), or algo.advantage=reinforce_pp (or algo.name=ppo)"
            )
        if advantage == "rloo" and self.group_size < 2:
            raise ConfigError(
                f"algo.group_size={self.group_size} with algo.advantage=rloo: each sample's baseline is the mean "
                "of the other samples of its prompt, so a prompt needs 2 or more; set algo.group_size=4 or more"
            )
        if advantage in ("grpo", "reinforce_pp_baseline") and self.group_size < 2:
            raise ConfigError(
                f"algo.group_size must be >= 2 for algo.advantage={advantage} (advantages are relative to the "
                "group); set algo.group_size=5 or more, or algo.advantage=reinforce_pp (no group baseline)"
            )
        if self.filter_groups and self.max_gen_batches < 1:
            raise ConfigError(f"algo.max_gen_batches must be >= 1, got {self.max_gen_batches}")
        if self.tis_cap < 0 or 0 < self.tis_cap < 1:
            raise ConfigError(f"algo.tis_cap={self.tis_cap}: use 0 (off) or a cap >= 1 (2.0 is common)")


@with_config(extra="forbid")
@dataclass
class TrainConfig:
    device: Str = _f("cpu", "Device that holds the trained weights, gradients and optimizer state.")
    lr: Float = _f(3e-4, "Peak learning rate of AdamW.")
    weight_decay: Float = _f(0.0, "AdamW weight decay.")
    betas: List = _f([0.9, 0.999], "AdamW betas.")
    warmup_steps: Int = _f(0, "Linear warmup steps.")
    lr_schedule: Str = _f("constant", "constant | cosine (after warmup).")
    max_grad_norm: Float = _f(1.0, "Gradient clipping norm (0 = off).")
    max_tokens_per_microbatch: Int = _f(8192, "Hard cap on padded tokens (rows x longest row) in one forward/backward.")
    share_prompt_prefix: Bool = _f(
        True,
        "Run a GRPO group's common prompt through the model once per micro-batch (its KV cache, with gradient, "
        "serves every response); in `agent-rl sft`, the span every demonstration of a micro-batch opens with (the "
        "system prompt, the tools' schemas). Same loss and gradient up to float rounding. Not used under torchrun "
        "or with gradient checkpointing.",
    )
    pack_rows: Bool = _f(
        True,
        "In the update's and SFT's passes, pack a micro-batch's rows several to a row (own positions, block-diagonal "
        "causal mask) so padding does not run through the model; same loss and gradient up to float rounding. Where a "
        "shared prompt prefix saves more tokens, that is used instead.",
    )
    offload_optimizer: Bool = _f(False, "Keep AdamW states in host RAM (a no-op on CPU-only runs, which says so).")
    offload_params: Bool = _f(False, "FSDP: keep parameters in host RAM between uses (torchrun/GPU only).")
    skip_zero_advantage: Bool = _f(
        True,
        "Leave rows whose advantage is 0 on every token (a GRPO group with equal rewards) out of the update's "
        "forward and backward; they stay in the loss normaliser, so the gradient is unchanged. Only when no "
        "KL-in-loss, entropy or value term reads them.",
    )
    host_mmap_threshold_mib: Float = _f(
        1.0,
        "CPU training on glibc (no allocator preloaded by the launcher): host allocations of at least "
        "this size get their own mapping, returned to the system "
        "when freed (mallopt M_MMAP_THRESHOLD). glibc's default moves the threshold up as tensors are freed, so "
        "freed activations stay in the heap as holes, and peak RSS grows past what is held. 0 = glibc's default. "
        "Not set on a CUDA run.",
    )
    bf16: Bool = _f(
        False,
        "Compute in bfloat16 over float32 master weights: torch.autocast in one process (CPU or CUDA), FSDP2 "
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) under torchrun. Updates smaller than a bf16 ulp "
        "are kept.",
    )

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"lr_schedule": ("constant", "cosine")}

    def validate(self) -> None:
        """The train section's own checks; a message names the key and says what to do."""
        _check_choices("train", self, self.CHOICES)
        if self.offload_optimizer and self.device.startswith("cuda"):
            raise ConfigError(
                "train.offload_optimizer is not implemented on CUDA: under torchrun set train.offload_params=true "
                "(FSDP2 CPU offload keeps parameters, gradients and the AdamW step in host RAM), or set "
                "train.offload_optimizer=false"
            )


@with_config(extra="forbid")
@dataclass
class RewardConfig:
    fn: Str | List = _f(
        "em",
        "The reward, a function (trajectory, golden_answers) -> float: em | f1 (on the last <answer> of the "
        "policy's own text) | em_format (EM counted only when the response is well formed) | search_found (1 when a "
        "search's passages, as shown, hold a gold answer: a process reward to weigh beside em) | a dotted import path "
        "`module:function` of your own; or a list of {fn: ..., weight: w} whose weighted sum is the reward, e.g. "
        "[{fn: em, weight: 1.0}, {fn: mypkg.rewards:brevity, weight: 0.1}].",
    )
    format_coef: Float = _f(
        0.0, "Bonus added to the reward when the response is well formed, the total capped at 1 (0 = off)."
    )

    @property
    def name(self) -> str:
        """The old `reward.name`, for callers not yet scoring with `agent_rl.rollout.rewards.Reward`
        (which alone knows lists, `em_format` and the user's functions)."""
        if not isinstance(self.fn, str):
            raise ConfigError("reward.fn is a list: score with agent_rl.rollout.rewards.Reward(cfg.reward)")
        return self.fn

    def terms(self) -> list[tuple[str, float]]:
        """`fn` as (function spec, weight) pairs."""
        if isinstance(self.fn, str):
            return [(self.fn, 1.0)]
        return [(str(item["fn"]), float(item.get("weight", 1.0))) for item in self.fn]

    def validate(self) -> None:
        """Each term names a built-in or an importable function; a list's items are {fn, weight} mappings."""
        items = [self.fn] if isinstance(self.fn, str) else self.fn
        if not items:
            raise ConfigError("reward.fn is an empty list: name one reward, e.g. reward.fn=em")
        for i, item in enumerate(items):
            key = "reward.fn" if isinstance(self.fn, str) else f"reward.fn[{i}]"
            if not isinstance(item, str):
                extra = sorted(set(item) - {"fn", "weight"}) if isinstance(item, dict) else []
                if not isinstance(item, dict) or "fn" not in item or extra:
                    raise ConfigError(
                        f"{key} = {item!r}: each item of a reward list is {{fn: NAME_OR_PATH, weight: FLOAT}}"
                    )
                weight = item.get("weight", 1.0)
                if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                    raise ConfigError(f"{key}.weight = {weight!r}: a number")
                item = item["fn"]
            if not isinstance(item, str) or not item:
                raise ConfigError(f"{key}: name a reward ({', '.join(BUILTIN_REWARDS)}) or a module:function path")
            if item not in BUILTIN_REWARDS:
                load_reward(item, key)


@with_config(extra="forbid")
@dataclass
class BufferConfig:
    max_tokens: Int = _f(2_000_000, "Most tokens (prompt + response) the trajectory buffer holds.")
    max_trajectories: Int = _f(100_000, "Most trajectories the buffer holds.")


@with_config(extra="forbid")
@dataclass
class SftConfig:
    steps: Int = _f(800, "Optimizer steps of the supervised warm start on scripted demonstrations.")
    batch_size: Int = _f(32, "Demonstrations per step.")
    lr: Float = _f(2e-3, "Learning rate of the warm start.")
    wrong_fraction: Float = _f(
        0.5, "Chance that a drawn demonstration ends with a wrong answer, redrawn on every draw (keeps RL headroom)."
    )
    second_hop_fraction: Float = _f(
        1.0,
        "Share of draws in which a two-hop demonstration makes its second search; the others stop after the first "
        "search and answer with its finding (a weaker demonstrator, as real warm starts are; 1 = always both hops).",
    )
    answer_in_observation: Bool = _f(
        False,
        "Keep only demonstrations whose observations (the passages as the demonstration reads them, after the "
        "observation budget) hold a gold answer: rejection sampling of the scripted demonstrator, so the warm start "
        "learns to answer from what it read, never to answer from memory what its passage does not say.",
    )
    observation_loss: Float = _f(
        0.0,
        "Weight of the observation tokens (the tools' answers as the demonstration reads them) in the warm start's "
        "loss, against 1 for the demonstrated calls and answers: 0 = untrained, as in RL; 1 = TRL's SFT without "
        "assistant_only_loss. The prompt is never trained. A passage repeats its title's name, so a model trained "
        "from scratch practises there the copy its searches and answers need (bench/RESULTS.md, tool_calls demo).",
    )
    observation_loss_steps: Int = _f(
        0,
        "SFT steps over which sft.observation_loss falls linearly to 0 (its full weight at step 1, none after "
        "these steps): the observations teach the copy early, then the calls and answers have the loss to themselves. "
        "0 = the weight holds for the whole run.",
    )
    opening_free_fraction: Float = _f(
        0.0,
        "The share of SFT steps, the first ones, that train every demonstration without the opening all their prompts "
        "share (the system prompt, the tools' schemas, the template's markers before the question): a curriculum "
        "for a model trained from scratch, whose copy from the question forms in fewer steps without a long "
        "constant text before it (bench/RESULTS.md, tool_calls demo); the later steps see the whole prompt. "
        "0 = every step sees the whole prompt.",
    )

    def validate(self) -> None:
        """The sft section's own checks; a message names the key and says what to do."""
        for key in ("wrong_fraction", "second_hop_fraction", "observation_loss", "opening_free_fraction"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"sft.{key} must be within [0, 1], got {getattr(self, key)}")
        if self.observation_loss_steps < 0:
            raise ConfigError(
                f"sft.observation_loss_steps must be >= 0 (0 = no decay), got {self.observation_loss_steps}"
            )


@with_config(extra="forbid")
@dataclass
class GuardConfig:
    action: Str = _f("warn", "Collapse guard: off | warn | stop | rollback.")
    window: Int = _f(10, "Healthy steps (no signal) the relative signals compare a step with.")
    min_history: Int = _f(3, "Healthy steps the window must hold before a relative signal can fire.")
    replay_size: Int = _f(
        8,
        "Responses that earned a reward in earlier steps (one per prompt) scored under the policy after every "
        "update: guard/replay_logprob, one forward pass over this many rows. 0 = off.",
    )
    replay_every: Int = _f(
        1,
        "Score the replay set after every Nth update only (steps divisible by N): the replay signal can fire on "
        "those steps only, so it may come up to N-1 steps later; the cost is one forward over replay_size rows "
        "a scored step.",
    )
    replay_drop: Float = _f(
        0.25,
        "replay signal: the replay set's mean log-prob per token fell this many nats below its best since the start "
        "or the last rollback (the policy is unlearning what it got right); chosen between the demo's healthy runs "
        "and the collapse config's run (bench/RESULTS.md). 0 = a metric only.",
    )
    update_rows: Int = _f(
        256,
        "Rows with a positive advantage (the step's first ones) whose log-prob change across the update is read "
        "every step: guard/update_logprob_change, the mean over their trained tokens with a positive advantage of "
        "(after - before), which the update should raise. Both come from forwards over these rows alone, before and "
        "after the update, in the trainer's arithmetic (no backward, in train.max_tokens_per_microbatch), so they "
        "differ by what the update changed and nothing else: two forwards a step. Per row the change is noisy, "
        "so all of a step's rewarded rows (a sample of 16 raised false alarms on a healthy run, bench/RESULTS.md). "
        "0 = off.",
    )
    update_window: Int = _f(
        3,
        "update signal: the median of guard/update_logprob_change over the last N updates is below "
        "-update_threshold (most recent updates lowered the likelihood of the responses they rewarded; a median, "
        "not a mean, so that one bad update of a healthy run does not fire it; chosen from the runs in "
        "bench/RESULTS.md). 0 = a metric only.",
    )
    update_threshold: Float = _f(
        1e-4,
        "update signal: how far below 0 (nats per token) the median change must be. A converged healthy run's "
        "updates change their rewarded rows by a few 1e-4 either way; at 0 the demo's seed 2 raised a false alarm.",
    )
    grad_factor: Float = _f(
        0.0,
        "grad_norm signal: the median gradient norm (before clipping) of the last 3 steps is above this factor x the "
        "window median. A metric only by default (0): on the toy world it rose no earlier than the replay signal "
        "and healthy runs also rose (bench/RESULTS.md).",
    )
    entropy_factor: Float = _f(
        0.0,
        "entropy signal: actor/entropy (algo.log_entropy) above this factor x, or below 1/factor x, the window "
        "median. 0 = a metric only.",
    )
    format_rise: Float = _f(
        0.3, "format signal: the share of malformed responses is this much above the window median. 0 = a metric only."
    )
    repeat_rise: Float = _f(
        0.2,
        "repeat signal: the share of responses repeating a 4-token n-gram 3+ times is this much above the window "
        "median. 0 = a metric only.",
    )
    search_ratio: Float = _f(
        0.5,
        "search signal: searches per trajectory fell below this fraction of the window median (only when that "
        "median is 0.5 or more). 0 = a metric only.",
    )
    logprob_gap: Float = _f(
        0.0,
        "logprob_gap signal: the engine-trainer log-prob gap at sampled tokens (rollout/logprob_diff_mean) above "
        "this. 0 = a metric only.",
    )
    length_factor: Float = _f(
        3.0, "length signal (late): mean response length above this factor x the window median. 0 = off."
    )
    budget_hit_frac: Float = _f(
        0.3, "budget_total signal (late): more than this share of trajectories ends on budget_total. 0 = off."
    )
    invalid_frac: Float = _f(0.9, "invalid signal (late): more than this share of actions is invalid. 0 = off.")
    healthy_every: Int = _f(
        5,
        "rollback: also checkpoint every N steps that raised no signal (besides run.save_every). A rollback "
        "returns to the newest checkpoint two or more steps before the step that fired (the step before's policy "
        "generated the rollouts that raised it), so at most N + 1 steps back. 0 = run.save_every's checkpoints only.",
    )
    lr_factor: Float = _f(0.5, "rollback: multiply the learning rate by this.")
    kl_factor: Float = _f(2.0, "rollback: multiply the KL coefficient by this.")
    entropy_coef_factor: Float = _f(
        0.5,
        "rollback: multiply algo.entropy_coef (the entropy bonus, when there is one) by this: a bonus too strong "
        "for the reward flattens the policy into noise, and a lower rate alone only slows that down.",
    )
    kl_floor: Float = _f(
        0.001,
        "rollback with algo.kl_coef 0: the KL coefficient to start from; the reference is the restored healthy "
        "policy (the LoRA base with LoRA). A torchrun FSDP run has no reference then: it lowers the rate only.",
    )
    max_rollbacks: Int = _f(3, "rollback: give up (stop) after this many rollbacks.")

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"action": ("off", "warn", "stop", "rollback")}

    def validate(self) -> None:
        """The guard section's own checks; a message names the key and says what to do."""
        _check_choices("guard", self, self.CHOICES)
        if self.replay_every < 1:
            raise ConfigError(
                f"guard.replay_every must be >= 1 (1 = score the replay set every step), got {self.replay_every}"
            )


@with_config(extra="forbid")
@dataclass
class MemoryConfig:
    host_mem_gib: Float = _f(
        0.0, "Host RAM budget checked by `agent-rl plan` and at start-up (0 = this machine's RAM)."
    )
    gpu_mem_gib: Float = _f(0.0, "GPU memory per device for `agent-rl plan` (0 = the visible device's).")
    retriever_on_gpu_gib: Float = _f(
        0.0, "GPU memory a retriever index takes on the training GPUs (Search-R1's flat wiki-18 is ~65)."
    )
