"""Generation throughput of the rollout engines on a real model: HF engine vs transformers' continuous
batching (`paged`) vs vLLM (CPU build), and the HF engine against transformers' own `generate()`.

Usage: .venv/bin/python bench/engines.py --model DIR [--rows 16 64] [--new-tokens 128] [--pairs 3]
       [--engines hf vllm] (any of: hf hf-dynamic hf-static hf-graph paged vllm generate generate-static
       generate-compile) [--device cuda:0] [--dtype bfloat16] (hf* and paged only; the others run on the CPU in
       float32)

`hf` is the HF engine as `rollout.hf_decode=auto` runs it (a CUDA graph a decode step on CUDA, the dynamic cache
elsewhere); hf-dynamic, hf-static and hf-graph name its decode path.

Each measurement runs in a fresh subprocess (its own engine start, one warm-up call, then one
timed `generate` of ROWS chat-templated HotpotQA questions from the test fixture, temperature 1,
no stop before `--new-tokens` other than eos / the tags). The engines alternate within each pair
(the order rotates from pair to pair) and the medians over pairs are printed, with each engine's
per-pair ratio to the first one named. Run it on an idle machine: two jobs on 2 cores slow each other.

`generate` is `model.generate(do_sample=True, top_k=0, ...)` over the same left-padded batch with the
engine's stop ids, returning the processed scores so that each sampled token's log-prob can be read
(what a rollout needs); `generate-static` adds `cache_implementation="static"`, `generate-compile` also
has transformers compile the decode step (`torch.compile`, which it does on GPUs only unless told to),
warmed up on the very call it is timed on, so no recompile is counted (a best case: a rollout's shapes
change from call to call). None of them draws per-row seeds, gives each row its own token limit,
prefills a repeated prompt once or drops finished rows: what the HF engine's own loop adds.

`paged` is `PagedEngine` as `build_engine` makes it for `rollout.engine=paged`: transformers' continuous
batching over its own copy of the weights, one manager per `generate` call (its start and stop are timed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _prompts(tok, rows: int) -> list[list[int]]:
    questions = [
        json.loads(line)["question"]
        for line in (ROOT / "tests" / "fixtures" / "hotpotqa100" / "questions.jsonl").read_text().splitlines()
    ]
    out = []
    for i in range(rows):
        q = questions[i % len(questions)]
        out.append(
            tok.apply_chat_template(
                [{"role": "user", "content": f"Answer the question briefly, then explain.\nQuestion: {q}"}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    return out


class _LibraryGenerate:
    """transformers' `generate()` behind the engine's `generate` call, for the comparison only."""

    def __init__(self, model_dir: str, tok, static: bool, compile: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        from agent_rl.rollout.engines.base import stop_token_ids
        from agent_rl.rollout.protocol import STOP_TAGS

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.static, self.compile = static or compile, compile
        self.stop_ids = stop_token_ids(tok, STOP_TAGS)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.stats = {"generated_tokens": 0}
        torch.manual_seed(0)

    def generate(self, prompts, max_new_tokens, temperature):
        import torch
        from transformers import CompileConfig

        from agent_rl.rollout.engines.base import Generation
        from agent_rl.rollout.padding import left_pad

        ids, attention, _ = left_pad(prompts, self.pad_id, "cpu")
        extra: dict = {"cache_implementation": "static"} if self.static else {}
        if self.compile:  # transformers compiles the decode step on GPUs only unless told to
            config = CompileConfig(fullgraph=False, dynamic=False)
            config._compile_all_devices = True
            extra["compile_config"] = config
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=attention,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max(max_new_tokens),
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
                return_dict_in_generate=True,
                output_scores=True,
                **extra,
            )
        new = out.sequences[:, ids.shape[1] :]
        logps = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        gens = []
        for row, lp in zip(new.tolist(), logps.tolist(), strict=True):
            n = next((i + 1 for i, t in enumerate(row) if t in self.stop_ids), len(row))
            gens.append(Generation(row[:n], lp[:n], "stop" if row[n - 1] in self.stop_ids else "length"))
        self.stats["generated_tokens"] += sum(len(g.token_ids) for g in gens)
        return gens


def worker(args) -> None:
    import torch

    from agent_rl.config import load_config
    from agent_rl.rollout.prompts import load_tokenizer

    rows = args.rows[0]
    tok = load_tokenizer(args.model)
    prompts = _prompts(tok, rows)
    start = time.perf_counter()
    if args.worker == "vllm":
        from agent_rl.rollout.engines import EngineSpec, VLLMEngine

        cfg = load_config(
            ROOT / "configs" / "tiny_cpu_grpo.yaml",
            [
                "rollout.engine=vllm",
                "rollout.device=cpu",
                f"model.path={args.model}",
                "model.warm_start=",
                "model.init_size=",
                "budget.max_total_tokens=1024",
                f"rollout.max_num_seqs={max(64, rows)}",
            ],
        )
        engine = VLLMEngine(args.model, tok, EngineSpec.from_config(cfg), seed=0)
    elif args.worker in HF_DECODES:
        from transformers import AutoModelForCausalLM

        from agent_rl.rollout.engines import EngineSpec, HFEngine

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
        decode = HF_DECODES[args.worker]
        engine = HFEngine(model, tok, args.device, batch_size=max(64, rows), seed=0, decode=decode)
    elif args.worker == "paged":
        from transformers import AutoModelForCausalLM

        from agent_rl.rollout.engines import EngineSpec, build_engine

        cfg = load_config(
            None,
            [
                "rollout.engine=paged",
                f"rollout.device={args.device}",
                f"train.device={args.device}",
                f"model.dtype={args.dtype}",
                f"train.bf16={args.dtype == 'bfloat16'}",
                f"model.path={args.model}",
                "budget.max_total_tokens=1024",
                f"rollout.generation_batch_size={max(64, rows)}",
                f"rollout.prompts_per_step={rows}",
                "algo.group_size=2",
            ],
        )
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
        engine = build_engine(
            EngineSpec.from_config(cfg), model, tok, seed=0
        )  # its own copy in the compute dtype, as in training
    else:
        engine = _LibraryGenerate(
            args.model, tok, static=args.worker == "generate-static", compile=args.worker == "generate-compile"
        )
    startup = time.perf_counter() - start
    start = time.perf_counter()
    if args.worker == "generate-compile":  # compiled for the shapes it will be timed on (a best case)
        engine.generate(prompts, [args.new_tokens] * len(prompts), 1.0)
    else:
        engine.generate(prompts[:2], [8, 8], 1.0)
    warmup = time.perf_counter() - start
    before = engine.stats["generated_tokens"]
    start = time.perf_counter()
    gens = engine.generate(prompts, [args.new_tokens] * len(prompts), 1.0)
    wall = time.perf_counter() - start
    tokens = engine.stats["generated_tokens"] - before
    assert tokens == sum(len(g.token_ids) for g in gens)
    result = {"engine": args.worker, "rows": rows, "tokens": tokens, "seconds": wall}
    print(json.dumps({**result, "startup_s": startup, "warmup_s": warmup}))


# the HF engine by its decode path (agent_rl/rollout/engines/hf.py): hf is rollout.hf_decode=auto
HF_DECODES = {"hf": "auto", "hf-dynamic": "dynamic", "hf-static": "static", "hf-graph": "graph"}
ENGINES = (*HF_DECODES, "paged", "vllm", "generate", "generate-static", "generate-compile")


def _run(engine: str, rows: int, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        engine,
        "--model",
        args.model,
        "--rows",
        str(rows),
        "--new-tokens",
        str(args.new_tokens),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{engine} worker failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        required=True,
        help="Hugging Face model directory, e.g. the converted SmolLM2 (agent-rl init-model --preset smollm2-135m)",
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=ENGINES)
    ap.add_argument("--device", default="cpu", help="device of the hf and paged engines (cpu, cuda:0, ...)")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights of the hf engine and compute dtype of paged's copy (bfloat16: model.dtype and train.bf16)",
    )
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    first = args.engines[0]
    for rows in args.rows:
        tps: dict[str, list[float]] = {e: [] for e in args.engines}
        ratios: dict[str, list[float]] = {e: [] for e in args.engines[1:]}
        for pair in range(args.pairs):
            shift = pair % len(args.engines)
            order = args.engines[shift:] + args.engines[:shift]
            got = {e: _run(e, rows, args) for e in order}
            for e, r in got.items():
                tps[e].append(r["tokens"] / r["seconds"])
            for e in ratios:
                ratios[e].append(tps[e][-1] / tps[first][-1])
            print(
                f"rows {rows} pair {pair + 1}: "
                + ", ".join(
                    f"{e} {got[e]['tokens']} tok in {got[e]['seconds']:.2f} s "
                    f"({got[e]['tokens'] / got[e]['seconds']:.1f} tok/s, start {got[e]['startup_s']:.1f} s, "
                    f"warm-up {got[e]['warmup_s']:.1f} s)"
                    for e in order
                ),
                flush=True,
            )
        print(
            f"rows {rows}: median tokens/s  "
            + "  ".join(f"{e} {statistics.median(tps[e]):.1f}" for e in args.engines)
            + "  "
            + "  ".join(f"{e}/{first} {statistics.median(r):.2f}x" for e, r in ratios.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
