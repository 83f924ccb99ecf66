"""The HF engine's decode paths against each other on one device: dynamic, static and (CUDA) graph.

Usage: python bench/hf_decode_check.py --model DIR [--device cuda:0] [--dtype bfloat16] [--rows 64] [--new-tokens 64]

The same prompts (bench/engines.py's) generated greedily, then sampled with per-row seeds, by `HFEngine` with each
`decode` (agent_rl/rollout/engines/hf.py). Printed per path against dynamic: the rows whose token ids are identical,
and the largest log-prob difference over the tokens both produced before their first difference. graph replays
the static step's own kernels, so graph against static should read all rows identical and 0.0; static against
dynamic differs by the attention's length (the static cache's masked slots) and, in bf16, by rounding (near-flat
random-weight distributions flip tokens there). Exit 1 when, in float32, graph and static differ in a row's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def compare(a, b) -> dict:
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    diff = 0.0
    for x, y in zip(a, b):
        for tx, ty, lx, ly in zip(x.token_ids, y.token_ids, x.logprobs, y.logprobs):
            if tx != ty:
                break
            diff = max(diff, abs(lx - ly))
    return {"rows_identical": same, "rows": len(a), "max_logprob_diff": diff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    import torch
    from engines import _prompts
    from transformers import AutoModelForCausalLM

    from agent_rl.rollout.engines.hf import HFEngine
    from agent_rl.rollout.prompts import load_tokenizer

    tok = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
    prompts = _prompts(tok, args.rows)
    paths = ["dynamic", "static"] + (["graph"] if args.device.startswith("cuda") else [])
    report: dict = {"device": args.device, "dtype": args.dtype, "rows": args.rows, "new_tokens": args.new_tokens}
    ok = True
    for temperature in (0.0, 1.0):
        seeds = list(range(args.rows)) if temperature else None
        gens = {}
        for path in paths:
            engine = HFEngine(model, tok, args.device, batch_size=args.rows, seed=0, decode=path)
            gens[path] = engine.generate(prompts, [args.new_tokens] * args.rows, temperature, seeds=seeds)
        for path in paths[1:]:
            report[f"T{temperature:g} {path} vs dynamic"] = compare(gens[path], gens["dynamic"])
        if "graph" in gens:
            r = compare(gens["graph"], gens["static"])
            report[f"T{temperature:g} graph vs static"] = r
            ok &= args.dtype != "float32" or r["rows_identical"] == r["rows"]
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
