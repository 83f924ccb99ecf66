"""`agent-rl`: one console script, one subcommand per job (the command-line contract in docs/DESIGN.md).

Every subcommand on `configs/tiny_cpu_grpo.yaml` prepares what it lacks (toy world, tiny
model, index) on first use, so each works on its own on a fresh checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent_rl.config import ModelConfig
    from agent_rl.rollout.engines import Engine, EngineSpec
    from agent_rl.world import World

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _config(args):
    from agent_rl.config import load_config

    return load_config(args.config, args.overrides)


def _with_config(p: argparse.ArgumentParser) -> None:
    from agent_rl.config import Config

    sections = ", ".join(f.name for f in dataclasses.fields(Config))
    p.add_argument("config", help="YAML config, e.g. configs/tiny_cpu_grpo.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        help=f"section.key=value overrides, e.g. run.max_steps=10 (sections: {sections}; keys documented in "
        "docs/CONFIG.md)",
    )


def cmd_train(args) -> int:
    from agent_rl.train import train

    train(_config(args), resume=args.resume)
    return 0


def cmd_sft(args) -> int:
    from agent_rl.sft import sft

    sft(_config(args))
    return 0


def resolve_model_dir(path: str) -> str:
    """A checkpoint `step_N/` holds the model in `model/` (its own config.json is the run's
    config, not a model's); a plain model dir is used as is."""
    p = Path(path)
    for d in (p / "model", p):
        if (d / "config.json").exists() or (d / "adapter_config.json").exists():
            return str(d)
    raise FileNotFoundError(f"{path} holds no model (no config.json in it or in its model/ folder)")


def _is_lora(model_dir: str) -> bool:
    return (Path(model_dir) / "adapter_config.json").exists()


def _load_tokenizer(model_cfg, model_dir: str):
    """The model dir's own tokenizer; a checkpoint saved without one uses the run's start model's."""
    from agent_rl.rollout.prompts import load_tokenizer

    has_own = (Path(model_dir) / "tokenizer_config.json").exists()
    return load_tokenizer(model_dir if has_own else (model_cfg.warm_start or model_cfg.path))


def _load_model(model_dir: str):
    """A plain Hugging Face model, or LoRA adapters over their base model (peft finds the base
    through adapter_config.json), on the CPU."""
    if _is_lora(model_dir):
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(model_dir)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def _engine(spec: EngineSpec, model_cfg: ModelConfig, model_path: str) -> tuple[Engine, object]:
    """(engine, tokenizer) for generating with the model in `model_path` as `spec` says."""
    from agent_rl.rollout.engines import build_engine

    tokenizer = _load_tokenizer(model_cfg, model_path)
    vllm = spec.engine == "vllm"
    if vllm and _is_lora(model_path):
        raise SystemExit(
            f"{model_path} holds LoRA adapters; vLLM here serves plain weights. Merge them first: "
            f"agent-rl export CONFIG --checkpoint {model_path} --out DIR --merge, then pass --checkpoint DIR"
        )
    # vLLM loads the weights itself; the HF engine generates with the model moved onto rollout.device.
    model = None if vllm else _load_model(model_path).to(spec.device)
    return build_engine(spec, model, tokenizer, model_path=model_path), tokenizer


@contextmanager
def _engine_model_dir(
    spec: EngineSpec, model_cfg: ModelConfig, model_path: str, world: World, near: Path
) -> Iterator[str]:
    """The model dir every rank's rollout engine loads: `model_path`, or for LoRA adapters under vLLM
    (which serves plain weights) the adapters merged into their base as `agent-rl export --merge`
    writes them. Rank 0 merges once into a temporary directory in `near` (the evaluation's output
    folder, which every rank shares) and removes it on exit, error or not; the caller keeps rank 0
    inside until every rank has loaded its engine."""
    if spec.engine != "vllm" or not _is_lora(model_path):
        yield model_path
        return
    if world.is_main:
        near.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".merged-lora-", dir=near) if world.is_main else nullcontext(None) as tmp:
        if tmp is not None:
            print(f"[agent-rl] {model_path} holds LoRA adapters: merged into {tmp} for vLLM", file=sys.stderr)
            export_model(model_cfg, model_path, Path(tmp), merge=True)
        yield world.broadcast_object(tmp)


def cmd_rollout(args) -> int:
    from agent_rl.bootstrap.prepare import prepare
    from agent_rl.rollout.engines import EngineSpec
    from agent_rl.rollout.loop import rollout_metrics
    from agent_rl.rollout.prompts import load_prompts
    from agent_rl.rollout.rewards import Reward
    from agent_rl.rollout.trajectory import write_trajectories
    from agent_rl.run import open_loop
    from agent_rl.world import LOCAL

    cfg = _config(args)
    prepare(cfg)
    model_path = (
        resolve_model_dir(args.checkpoint)
        if args.checkpoint
        else (cfg.model.warm_start if cfg.model.warm_start and Path(cfg.model.warm_start).exists() else cfg.model.path)
    )
    out = Path(args.out)
    spec = EngineSpec.from_config(cfg)
    with _engine_model_dir(spec, cfg.model, model_path, LOCAL, out.parent) as engine_dir:
        engine, tokenizer = _engine(spec, cfg.model, engine_dir)
        with open_loop(cfg, engine, tokenizer) as loop:
            prompts = loop.admit(load_prompts(cfg.data.train_files, tokenizer, loop.budget, args.num_prompts))
            trajs = loop.run(
                prompts.items,
                cfg.algo.group_size if args.group_size is None else args.group_size,
                cfg.rollout.temperature,
                cfg.rollout.top_p,
            )
    reward = Reward(cfg.reward)
    for t in trajs:
        t.reward = reward(t)
    write_trajectories(out, trajs, tokenizer)
    m = rollout_metrics(trajs, loop.counters)
    print(json.dumps({k: round(v, 4) for k, v in m.items()}, indent=1))
    print(f"wrote {len(trajs)} trajectories to {out}")
    return 0


def cmd_eval(args) -> int:
    """The papers' table over one or more test sets: per data_source EM, F1 (95% bootstrap
    intervals), searches, response tokens and end reasons, and the unweighted mean over datasets.
    Resumable, and sharded over torchrun ranks or `--shard i/n` processes (agent_rl/evaluation.py)."""
    from agent_rl import evaluation
    from agent_rl.bootstrap.prepare import prepare
    from agent_rl.rollout.engines import EngineSpec
    from agent_rl.rollout.prompts import load_prompts
    from agent_rl.rollout.rewards import Reward, answer_scores
    from agent_rl.run import open_loop

    cfg = _config(args)
    if args.retriever_url:
        cfg.retriever.url = args.retriever_url
    if args.pass_k < 1 or args.chunk_size < 1:
        print("agent-rl eval: error: --pass-k and --chunk-size must be >= 1", file=sys.stderr)
        return 2
    try:
        shard, shards = evaluation.parse_shard(args.shard)
    except ValueError as err:
        print(f"agent-rl eval: error: {err}", file=sys.stderr)
        return 2
    world = evaluation.join_ranks(cfg.retriever, cfg.rollout)
    if world.world_size > 1:
        if args.shard:
            print("agent-rl eval: error: --shard and torchrun both split the questions; use one", file=sys.stderr)
            return 2
        shard, shards = world.rank, world.world_size
    if args.fresh and shards > 1 and not world.world_size > 1:
        print(
            "agent-rl eval: error: --fresh with --shard would discard the other shards' scores; delete the "
            "questions folder once before starting the shards",
            file=sys.stderr,
        )
        return 2
    if world.is_main:
        prepare(cfg, need_index=not args.retriever_url)
    world.barrier()  # rank 0 built whatever was missing
    model_path = resolve_model_dir(args.checkpoint)
    data = args.data or cfg.data.test_files
    out = Path(args.out or Path(cfg.run.output_dir) / "eval.json")
    folder = evaluation.questions_dir(out)
    # A LoRA checkpoint under vLLM: merged into a temporary dir, removed when the evaluation ends.
    engine_spec = EngineSpec.from_config(cfg)
    with _engine_model_dir(engine_spec, cfg.model, model_path, world, out.parent) as engine_dir:
        engine, tokenizer = _engine(engine_spec, cfg.model, engine_dir)
        with open_loop(cfg, engine, tokenizer, world) as loop:
            assert loop.client is not None  # open_loop's
            prompts = evaluation.select(
                loop.admit(load_prompts(data, tokenizer, loop.budget, args.max_samples)), args.per_source, cfg.run.seed
            )
            spec = evaluation.make_spec(
                cfg.rollout,
                cfg.budget,
                cfg.run.seed,
                args.checkpoint,
                model_path,
                data,
                prompts,
                evaluation.describe_retriever(loop.client, cfg.retriever),
                max_samples=args.max_samples,
                per_source=args.per_source,
                pass_k=args.pass_k,
                chunk_size=args.chunk_size,
            )
            refused = None
            if world.is_main or world.world_size == 1:
                try:
                    evaluation.open_folder(folder, spec, fresh=args.fresh)
                except evaluation.EvalMismatch as err:
                    refused = str(err)
            refused = world.broadcast_object(refused)
            if refused:
                print(f"agent-rl eval: error: {refused}", file=sys.stderr)
                world.barrier()  # every rank's engine has loaded before rank 0 removes a merged model
                loop.engine.close()
                world.close()
                return 2
            traj_path = Path(args.trajectories) if args.trajectories else None
            if traj_path is not None and world.world_size > 1:
                traj_path = traj_path.with_name(f"{traj_path.stem}.rank{world.rank}{traj_path.suffix}")
            kept: list = []
            reward = Reward(cfg.reward)
            if traj_path is not None:
                traj_path.parent.mkdir(parents=True, exist_ok=True)
                traj_path.write_text("")

            def keep(trajs: list) -> None:  # this process's trajectories, appended chunk by chunk
                assert traj_path is not None
                with traj_path.open("a") as fh:
                    for t in trajs:
                        t.reward = reward(t)
                        rec = {**t.to_record(tokenizer), **answer_scores(t.response_text, t.golden_answers)}
                        fh.write(json.dumps(rec) + "\n")
                kept.extend(t.prompt_id for t in trajs)

            evaluation.score_shard(
                loop, prompts, spec, folder, shard, shards, on_trajectories=keep if traj_path is not None else None
            )
            # Every rank's share is in before rank 0 merges the parts, stops the retriever, removes a merged model.
            world.barrier()
        loop.engine.close()  # before the process group: vLLM's own groups are built on it
    world.close()
    if traj_path is not None:
        print(f"wrote {len(kept)} trajectories to {traj_path} (see them with: agent-rl view {traj_path} --out DIR)")
    if not world.is_main:
        return 0
    return _write_eval_report(folder, out, other_shards=shards > 1 and world.world_size == 1)


def _write_eval_report(folder: Path, out: Path, other_shards: bool) -> int:
    """Merge the folder's part files into OUT (JSON) and OUT with .md (Markdown); print the table."""
    from agent_rl import evaluation
    from agent_rl.reports.eval_report import to_markdown

    try:
        report = evaluation.merge(folder)
    except evaluation.EvalMismatch as err:
        if other_shards:  # the other shards are still running: the last one to finish writes the table
            print(f"[eval] this shard is done; {err}. Then: agent-rl eval-report {folder}", file=sys.stderr)
            return 0
        print(f"agent-rl eval: error: {err}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    md = out.with_suffix(".md")
    md.write_text(to_markdown(report))
    print(md.read_text(), end="")
    print(f"wrote {out} and {md} (per-question scores in {folder})")
    return 0


def cmd_eval_report(args) -> int:
    """The table of an evaluation from its questions folder (after `--shard` runs)."""
    from agent_rl import evaluation

    folder = Path(args.questions_dir)
    if not (folder / evaluation.SPEC).exists():
        print(
            f"agent-rl eval-report: error: {folder} holds no {evaluation.SPEC} (not an agent-rl eval folder)",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out) if args.out else folder.with_name(folder.name.removesuffix("_questions") + ".json")
    return _write_eval_report(folder, out, other_shards=False)


def cmd_view(args) -> int:
    from agent_rl.reports.view import write_report

    try:
        index = write_report([Path(p) for p in args.inputs], Path(args.out))
    except (FileNotFoundError, ValueError) as err:
        print(f"agent-rl view: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {index} (open it in a browser; no server needed)")
    return 0


def export_model(model_cfg, src: str, out: Path, merge: bool) -> None:
    """Write the model in `src` to `out` as a Hugging Face directory with its tokenizer; LoRA
    adapters folded into the base weights when `merge` (peft's `merge_and_unload`)."""
    model = _load_model(src)
    if _is_lora(src):
        if merge:
            model = model.merge_and_unload()
        else:
            print("exporting the LoRA adapters only (add --merge for a full model)")
    model.save_pretrained(out)
    _load_tokenizer(model_cfg, src).save_pretrained(out)


def cmd_export(args) -> int:
    """Write a checkpoint's model as a plain Hugging Face directory; LoRA adapters merged with --merge."""
    out = Path(args.out)
    export_model(_config(args).model, resolve_model_dir(args.checkpoint), out, args.merge)
    print(f"wrote {out}")
    return 0


def cmd_plot(args) -> int:
    from agent_rl.reports.plot import plot_run

    for p in plot_run(Path(args.run_dir)):
        print(p)
    return 0


def _print_stage_table(stages: list[tuple[str, dict[str, float]]], temperature: float) -> None:
    """Test EM (greedy and sampled) and greedy searches per trajectory at each stage, overall and per
    question type."""
    types = sorted({k.split("/")[2] for _, m in stages for k in m if k.startswith("eval/type/")})
    groups = [("all", "eval", "eval_sampled")] + [(t, f"eval/type/{t}", f"eval_sampled/type/{t}") for t in types]
    cols = [
        ("greedy EM", lambda g: f"{g[1]}/em"),
        (f"EM, one sample at T={temperature:g}", lambda g: f"{g[2]}/em"),
        ("searches per trajectory (greedy)", lambda g: f"{g[1]}/searches_mean"),
    ]
    width = 9 * len(groups)
    print(f"{'':<16}" + "".join(f"| {title:<{width}}" for title, _ in cols))
    print(f"{'':<16}" + ("| " + "".join(f"{g[0]:>9}" for g in groups)) * len(cols))
    for name, m in stages:
        cells = []
        for _, key in cols:
            cells.append("| " + "".join(f"{m[key(g)]:>9.3f}" if key(g) in m else f"{'-':>9}" for g in groups))
        print(f"{name:<16}" + "".join(cells))


def _estimator(algo) -> str:
    """The RL run's name in the demo's table: its advantage estimator (and policy loss when not PPO's clip)."""
    names = {"grpo": "GRPO", "gae": "PPO", "rloo": "RLOO", "reinforce_pp": "REINFORCE++"}
    name = names.get(algo.resolved_advantage(), algo.resolved_advantage())
    return name if algo.policy_loss == "ppo_clip" else f"{name} ({algo.policy_loss})"


def cmd_demo(args) -> int:
    """The embedded default end to end: prepare, evaluate the base model, SFT warm start, RL,
    evaluate, plot, and print test EM at each stage."""
    from agent_rl.bootstrap.prepare import prepare
    from agent_rl.evaluation import evaluate_all
    from agent_rl.reports.plot import plot_run
    from agent_rl.rollout.engines import EngineSpec
    from agent_rl.rollout.prompts import load_prompts
    from agent_rl.run import open_loop
    from agent_rl.train import train

    cfg = _config(args)
    prepare(cfg)
    base: dict[str, float] = {}
    if cfg.data.test_files:
        engine, tokenizer = _engine(EngineSpec.from_config(cfg), cfg.model, cfg.model.path)
        with open_loop(cfg, engine, tokenizer) as loop:
            test_set = loop.admit(load_prompts(cfg.data.test_files, tokenizer, loop.budget, cfg.run.eval_max_samples))
            base = evaluate_all(loop, test_set, cfg.rollout, cfg.run)
    final = train(cfg)
    out = Path(cfg.run.output_dir)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if m.get("eval/em") is not None]
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    plots = plot_run(out)
    print("\n=== agent-rl demo finished ===")
    stages = [
        ("base model", base),
        ("SFT warm start", evals[0] if evals else {}),
        (f"after {_estimator(cfg.algo)}", final),
    ]
    _print_stage_table(stages, cfg.rollout.temperature)
    for key, what in (("eval/em", "greedy"), ("eval_sampled/em", f"one sample at T={cfg.rollout.temperature:g}")):
        if evals and key in evals[0]:
            line = [f"base model {base[key]:.3f}"] if key in base else []
            line += [
                f"after the SFT warm start {evals[0][key]:.3f}",
                f"after {_estimator(cfg.algo)} {final.get(key, evals[-1][key]):.3f}",
            ]
            print(f"test EM ({what}): " + " -> ".join(line))
    if len(rewards) >= 10:
        k = max(1, len(rewards) // 4)
        print(
            f"train reward (sampled): {sum(rewards[:k]) / k:.3f} over the first {k} steps -> "
            f"{sum(rewards[-k:]) / k:.3f} over the last {k}"
        )
    print(f"metrics:     {out / 'metrics.jsonl'}")
    print(f"tensorboard: tensorboard --logdir {out / 'tb'}")
    print(f"checkpoints: {out / 'checkpoints'}")
    print(f"plots:       {', '.join(str(p) for p in plots)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """agent-rl's commands, each with its options and the function it runs (`func`)."""
    parser = argparse.ArgumentParser(
        prog="agent-rl", description="Search-augmented agentic RL: PPO/GRPO over multi-turn retrieval trajectories."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from agent_rl.bootstrap import model_init

    model_init.add_cli(sub)
    from agent_rl.planning import plan

    plan.add_cli(sub)

    p = sub.add_parser("train", help="train with PPO or GRPO (prepares what the config lacks)")
    _with_config(p)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUTPUT_DIR/checkpoints")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sft", help="supervised warm start on scripted demonstrations (saved to model.warm_start)")
    _with_config(p)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("rollout", help="run rollouts only and write one JSON line per trajectory")
    _with_config(p)
    p.add_argument("--num-prompts", type=int, required=True, help="number of training prompts to roll out")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--checkpoint", help="model or checkpoint dir (default: the warm start or model.path)")
    p.add_argument("--group-size", type=int, help="samples per prompt (default algo.group_size)")
    p.set_defaults(func=cmd_rollout)

    p = sub.add_parser(
        "eval",
        help="multi-turn evaluation over one or more test sets: the papers' table (EM/F1 per data_source, "
        "their unweighted mean, bootstrap intervals); resumable, sharded under torchrun or --shard",
    )
    _with_config(p)
    p.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint dir (step_N) or model dir; LoRA adapters under rollout.engine=vllm are merged into a "
        "temporary dir beside --out for the evaluation",
    )
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",
        help="parquet files of test prompts from data-prep (default data.test_files)",
    )
    p.add_argument("--retriever-url", help="use this running retriever instead of starting one")
    p.add_argument("--max-samples", type=int, default=0, help="evaluate the first N prompts over the files (0 = all)")
    p.add_argument(
        "--per-source",
        type=int,
        default=0,
        help="at most N questions of each data_source, a sample seeded by run.seed (0 = all)",
    )
    p.add_argument(
        "--pass-k",
        type=int,
        default=1,
        help="1: one trajectory per question at rollout.eval_temperature (greedy); K > 1: K samples at "
        "rollout.temperature, and pass@K counts a question when any sample is right",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=128,
        help="questions per rollout batch and per fsync'd write; a killed evaluation redoes at most one chunk",
    )
    p.add_argument(
        "--shard", help="i/n: score only chunks c with c mod n == i (one process per shard, without torchrun)"
    )
    p.add_argument("--fresh", action="store_true", help="discard the per-question scores of an earlier evaluation")
    p.add_argument(
        "--out",
        help="JSON table (default OUTPUT_DIR/eval.json); the Markdown table goes beside it (.md), the per-question "
        "scores to the folder OUT_questions/",
    )
    p.add_argument(
        "--trajectories",
        help="also write the trajectories this process evaluated as JSON lines here (for `agent-rl view`)",
    )
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "eval-report", help="merge the per-question scores of a (sharded) evaluation into its table, JSON and Markdown"
    )
    p.add_argument("questions_dir", help="an evaluation's OUT_questions folder (holds spec.json and part-*.jsonl)")
    p.add_argument("--out", help="JSON table (default: beside the folder, OUT.json); the Markdown goes beside it")
    p.set_defaults(func=cmd_eval_report)

    p = sub.add_parser(
        "view",
        help="write a static HTML report of trajectories, token by token "
        "(rollout/eval output or a run's trajectories/)",
    )
    p.add_argument(
        "inputs", nargs="+", help="JSONL files of trajectories, or folders of them (OUTPUT_DIR/trajectories)"
    )
    p.add_argument("--out", required=True, help="output directory (index.html and one page per trajectory)")
    p.set_defaults(func=cmd_view)

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model dir (--merge folds LoRA adapters in)")
    _with_config(p)
    p.add_argument("--checkpoint", required=True, help="checkpoint dir (step_N) or model dir")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--merge", action="store_true", help="merge LoRA adapters into the base weights")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("plot", help="write PNG curves of reward, EM, response length and budget hits")
    p.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("demo", help="the embedded default end to end (what `make demo` runs)")
    _with_config(p)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may also follow the options (`rollout CONFIG --out F key=value`).
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from agent_rl.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError) as err:
        print(f"agent-rl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
