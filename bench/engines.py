"""Generation throughput of the two rollout engines on a real model: HF engine vs vLLM (CPU build).

Usage: .venv/bin/python bench/engines.py --model DIR [--rows 16 64] [--new-tokens 128] [--pairs 3]

Each measurement runs in a fresh subprocess (its own engine start, one warm-up call, then one
timed `generate` of ROWS chat-templated HotpotQA questions from the test fixture, temperature 1,
no stop before `--new-tokens` other than eos / the tags). The two engines alternate within each
pair (HF first in odd pairs, vLLM first in even ones) and the medians over pairs are printed,
with the per-pair ratio. Run it on an idle machine: two jobs on 2 cores slow each other.
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


def worker(args) -> None:
    import torch

    from agent_rl.config import load_config
    from agent_rl.rollout.prompts import load_tokenizer

    rows = args.rows[0]
    tok = load_tokenizer(args.model)
    prompts = _prompts(tok, rows)
    start = time.perf_counter()
    if args.worker == "vllm":
        from agent_rl.rollout.engines import VLLMEngine

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
        engine = VLLMEngine(args.model, tok, cfg, seed=0)
    else:
        from transformers import AutoModelForCausalLM

        from agent_rl.rollout.engines import HFEngine

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        engine = HFEngine(model, tok, "cpu", batch_size=max(64, rows), seed=0)
    startup = time.perf_counter() - start
    engine.generate(prompts[:2], [8, 8], 1.0)  # warm-up
    before = engine.stats["generated_tokens"]
    start = time.perf_counter()
    gens = engine.generate(prompts, [args.new_tokens] * len(prompts), 1.0)
    wall = time.perf_counter() - start
    tokens = engine.stats["generated_tokens"] - before
    assert tokens == sum(len(g.token_ids) for g in gens)
    print(json.dumps({"engine": args.worker, "rows": rows, "tokens": tokens, "seconds": wall, "startup_s": startup}))


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
    ap.add_argument("--worker", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    for rows in args.rows:
        tps = {"hf": [], "vllm": []}
        ratios = []
        for pair in range(args.pairs):
            order = ["hf", "vllm"] if pair % 2 == 0 else ["vllm", "hf"]
            got = {e: _run(e, rows, args) for e in order}
            for e, r in got.items():
                tps[e].append(r["tokens"] / r["seconds"])
            ratios.append(tps["vllm"][-1] / tps["hf"][-1])
            print(
                f"rows {rows} pair {pair + 1}: "
                + ", ".join(
                    f"{e} {got[e]['tokens']} tok in {got[e]['seconds']:.2f} s "
                    f"({got[e]['tokens'] / got[e]['seconds']:.1f} tok/s, start {got[e]['startup_s']:.1f} s)"
                    for e in order
                ),
                flush=True,
            )
        print(
            f"rows {rows}: median tokens/s  hf {statistics.median(tps['hf']):.1f}  vllm "
            f"{statistics.median(tps['vllm']):.1f}  vllm/hf {statistics.median(ratios):.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
