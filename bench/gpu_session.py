"""The Python half of bench/gpu_session.sh: the device's datasheet peaks, the memory-bandwidth bound of decoding,
the engines step, the NQ recipe's engine choice, and the session's summary and JSON.

Usage (bench/gpu_session.sh runs these; each works alone too):
    python bench/gpu_session.py engines --model DIR [--shape smollm2-1.7b] [--rows 128 512] [--new-tokens 256]
           [--engines hf paged] [--device cuda:0] [--seconds S] --out FILE.json
    python bench/gpu_session.py fastest-engine ENGINES.json [--default hf]
    python bench/gpu_session.py summary OUT_DIR

`engines` runs bench/engines.py (its command line only) once per model and engine, `--pairs 1`, each run given what
is left of `--seconds` (a run cut there is killed with its workers, and what it printed is kept), and sets each
measured tokens/s beside the memory-bandwidth bound of the same work (`decode_bound`): every decode step reads the
weights once and each row's KV cache once, at the device's datasheet bandwidth (DEVICES), with every row generating
all `--new-tokens` (random weights rarely stop early; a real model's rows that stop early make its tokens/s lower
than the bound by more than the engine's own overhead). The weights and KV are counted in the dtype the engine
runs in. The bound leaves out the prefill and everything but those reads, so it is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# (part of torch.cuda.get_device_name, dense bf16 FLOP/s, memory bandwidth in bytes/s), from the vendor's datasheets;
# the first match wins ("NVIDIA H100 80GB HBM3" is the SXM part).
DEVICES = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100", 989e12, 3.35e12),
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PAIR_LINE = re.compile(r"^rows (\d+) pair \d+: (.*)$")
SKIPPED = 3  # the exit code of a step that could not run here (bench/gpu_session.sh records it as skipped)
RUN = re.compile(r"(\S+) (\d+) tok in ([\d.]+) s \(([\d.]+) tok/s, start ([\d.]+) s, warm-up ([\d.]+) s\)")


def device_specs(name: str) -> dict | None:
    """{"bf16_flops", "bandwidth"} of a device by its torch name; None for one not in DEVICES (a CPU)."""
    for part, flops, bandwidth in DEVICES:
        if part in name:
            return {"bf16_flops": flops, "bandwidth": bandwidth}
    return None


def decode_bound(
    weight_bytes: int, kv_bytes_per_token: int, prompt_tokens: list[int], new_tokens: int, bandwidth: float
) -> dict:
    """Tokens/s of generating `new_tokens` for each of the rows (one prompt length each) if every decode step only
    read the weights once and each row's KV cache (prompt and tokens so far) once, at `bandwidth` bytes/s."""
    rows = len(prompt_tokens)
    kv_tokens = new_tokens * sum(prompt_tokens) + rows * new_tokens * (new_tokens - 1) // 2
    read = new_tokens * weight_bytes + kv_tokens * kv_bytes_per_token
    seconds = read / bandwidth
    return {"bytes": read, "seconds": seconds, "tokens_per_s": rows * new_tokens / seconds}


def model_bytes(model_dir: Path, dtype: str) -> tuple[int, int]:
    """(bytes of the weights, bytes of K and V a token over all layers) in `dtype`."""
    from agent_rl.planning.plan import read_arch

    arch = read_arch(str(model_dir))
    size = DTYPE_BYTES[dtype]
    return arch.params() * size, 2 * arch.layers * arch.kv_heads * arch.head_dim * size


def parse_engines_output(text: str) -> list[dict]:
    """The per-pair lines bench/engines.py prints, as one dict per engine and row count."""
    runs = []
    for line in text.splitlines():
        m = PAIR_LINE.match(line.strip())
        if not m:
            continue
        for engine, tokens, seconds, tps, start, warm in RUN.findall(m.group(2)):
            runs.append(
                {
                    "engine": engine,
                    "rows": int(m.group(1)),
                    "tokens": int(tokens),
                    "seconds": float(seconds),
                    "tokens_per_s": float(tps),
                    "startup_s": float(start),
                    "warmup_s": float(warm),
                }
            )
    return runs


def engines_flags() -> set[str]:
    """The long options bench/engines.py's --help names."""
    res = subprocess.run([sys.executable, str(BENCH / "engines.py"), "--help"], capture_output=True, text=True)
    return set(re.findall(r"--[a-z][a-z-]*", res.stdout))


def _run_until(cmd: list[str], log: Path, seconds: float) -> tuple[int | None, str]:
    """Run `cmd` in its own process group, output to `log`; kill the group after `seconds`.
    (exit code or None when cut, the output)."""
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, log.read_text()


def prompt_lengths(model_dir: Path, rows: int) -> list[int]:
    """The token count of each of the `rows` prompts bench/engines.py generates from."""
    from engines import _prompts

    from agent_rl.rollout.prompts import load_tokenizer

    return [len(p) for p in _prompts(load_tokenizer(str(model_dir)), rows)]


def run_engines(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.seconds
    out = Path(args.out)
    logs = out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    flags = engines_flags()
    cuda = args.device.startswith("cuda")
    results: dict = {"device": args.device, "new_tokens": args.new_tokens, "rows": args.rows, "runs": [], "notes": []}
    extra: list[str] = []
    dtype = "float32"  # what bench/engines.py loads without a --dtype flag
    if cuda:
        missing = [f for f in ("--device", "--dtype") if f not in flags]
        if "--device" in missing:
            note = f"bench/engines.py has no {' / '.join(missing)} flag: its workers run on the CPU; nothing measured"
            results["skipped"] = note
            out.write_text(json.dumps(results, indent=1))
            print(f"engines: skipped: {note}", flush=True)
            return SKIPPED
        extra += ["--device", args.device]
        if "--dtype" in flags:
            extra += ["--dtype", "bfloat16"]
            dtype = "bfloat16"
        import torch

        results["device_name"] = torch.cuda.get_device_name(args.device)
    results["dtype"] = dtype
    specs = device_specs(results.get("device_name", "cpu"))
    results["bandwidth"] = specs["bandwidth"] if specs else None
    models = [(Path(args.model).name, Path(args.model))]
    if args.shape:
        from plan_vs_measured_gpu import shape_dir

        models.append((args.shape, shape_dir(args.shape, Path(args.model))))
    # engine by engine, each on every model: the first engines named are measured on both before a slow one runs
    for engine in args.engines:
        for label, folder in models:
            left = deadline - time.monotonic()
            if left < args.min_run_s:
                results["notes"].append(f"{label} {engine}: not run, {left:.0f} s left")
                print(f"engines: {label} {engine}: not run ({left:.0f} s left)", flush=True)
                continue
            cmd = [sys.executable, str(BENCH / "engines.py"), "--model", str(folder), "--engines", engine]
            cmd += ["--rows", *map(str, args.rows), "--new-tokens", str(args.new_tokens), "--pairs", "1", *extra]
            code, text = _run_until(cmd, logs / f"{label}_{engine}.log", left)
            runs = [{"model": label, **r} for r in parse_engines_output(text)]
            results["runs"] += runs
            for r in runs:
                print(f"engines: {label} {engine} rows {r['rows']}: {r['tokens_per_s']:.0f} tok/s", flush=True)
            if code != 0:
                why = "cut at the step's time" if code is None else f"exit {code}: {text.strip()[-300:]}"
                results["notes"].append(f"{label} {engine}: {why}")
                print(f"engines: {label} {engine}: {why}", flush=True)
            out.write_text(json.dumps(results, indent=1))
    for label, folder in models:
        if results["bandwidth"] and any(r["model"] == label for r in results["runs"]):
            weights, kv = model_bytes(folder, dtype)
            results.setdefault("bounds", {})[label] = {
                str(rows): decode_bound(
                    weights, kv, prompt_lengths(folder, rows), args.new_tokens, results["bandwidth"]
                )
                | {"weight_bytes": weights, "kv_bytes_per_token": kv}
                for rows in args.rows
            }
    for r in results["runs"]:
        bound = results.get("bounds", {}).get(r["model"], {}).get(str(r["rows"]))
        r["of_bound"] = r["tokens_per_s"] / bound["tokens_per_s"] if bound else None
    out.write_text(json.dumps(results, indent=1))
    return 0


def fastest_engine(path: Path, default: str) -> str:
    """The engine with the most tokens/s on the first model at its fewest rows measured, else `default`."""
    if not path.is_file():
        return default
    runs = json.loads(path.read_text()).get("runs", [])
    if not runs:
        return default
    first = runs[0]["model"]
    rows = min(r["rows"] for r in runs if r["model"] == first)
    best = max((r for r in runs if r["model"] == first and r["rows"] == rows), key=lambda r: r["tokens_per_s"])
    return best["engine"]


# ---- summary ----


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(out: Path) -> list[dict]:
    rows = []
    for line in (out / "steps.tsv").read_text().splitlines() if (out / "steps.tsv").is_file() else []:
        name, status, seconds, budget, note = (line.split("\t") + [""] * 5)[:5]
        rows.append({"step": name, "status": status, "seconds": int(seconds), "budget_s": int(budget), "note": note})
    return rows


def nq_result(nq: Path) -> dict | None:
    """bench/real_model_learns.py's results.json; for a run cut short, the GRPO steps it logged."""
    if (res := _load(nq / "results.json")) is not None:
        return res
    metrics = nq / "grpo" / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/em" in r]
    return {
        "cut": True,
        "steps": len(steps),
        "step_s": [r.get("timing/step_s") for r in steps],
        "reward": [r["reward/mean"] for r in steps],
        "eval_em": [{k: v for k, v in r.items() if k.startswith("eval/") and k.endswith("/em")} for r in evals],
    }


def summarise(out: Path) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    session = _load(out / "session_env.json") or {}
    steps = _steps(out)
    ran = {s["step"] for s in steps if s["status"] != "skipped"}  # OUT may hold other steps' files from older runs
    session.update(torch=ver("torch"), transformers=ver("transformers"), steps=steps)
    session["engines"] = _load(out / "engines.json") if "engines" in ran else None
    update = {p.stem.removeprefix("update_"): _load(p) for p in sorted(out.glob("update_*.json"))}
    session["update"] = update if "update" in ran else {}
    session["planner"] = _load(out / "planner.json") if "planner" in ran else None
    session["nq"] = nq_result(out / "nq") if "nq" in ran else None
    return session


def render(s: dict) -> str:
    lines = [
        f"== gpu_session {s.get('date', '')}: {s.get('device', 'cpu')}, torch {s['torch']}, transformers "
        f"{s['transformers']}{' (smoke)' if s.get('smoke') == '1' else ''}",
        f"{'step':<9}{'status':<9}{'s':>6}{'budget':>8}  note",
    ]
    for st in s["steps"]:
        lines.append(f"{st['step']:<9}{st['status']:<9}{st['seconds']:>6}{st['budget_s']:>8}  {st['note']}")
    eng = s.get("engines") or {}
    if eng.get("runs"):
        bound = (
            f"bound: weights and KV read once a decode step at {eng['bandwidth'] / 1e12:.2f} TB/s"
            if eng.get("bandwidth")
            else "no bandwidth bound for this device"
        )
        lines.append(f"engines ({eng.get('dtype')}, {eng.get('new_tokens')} new tokens a row; {bound}):")
        for r in eng["runs"]:
            of = f"{r['of_bound']:.2f} of the bound" if r.get("of_bound") else ""
            lines.append(
                f"  {r['model']:<16}{r['engine']:<7}rows {r['rows']:>4} {r['tokens_per_s']:>10.0f} tok/s  {of}"
            )
    for name, res in (s.get("update") or {}).items():
        if not res:
            continue
        lines.append(f"update {name} (lora {res['lora']}, checkpointing {res['gradient_checkpointing']}):")
        for cap, r in res["caps"].items():
            if r.get("oom"):
                lines.append(f"  cap {cap:>6}: out of memory at {r['rows']} rows")
                continue
            mfu = f"MFU {r['mfu']:.3f}" if r.get("mfu") is not None else ""
            peak = f"{r['peak_gib']:.1f} GiB" if "peak_gib" in r else ""
            lines.append(
                f"  cap {cap:>6}: {r['rows']:>4} rows {r['s_per_microbatch']:.3f} s {r['tokens_per_s']:>9.0f} tok/s "
                f"{r['model_tflops_per_s']:7.1f} TFLOP/s {mfu} {peak}"
            )
    for shape, cases in ((s.get("planner") or {}).get("shapes") or {}).items():
        for case, r in cases.items():
            lines.append(
                f"planner {shape} {case}: plan {r['plan_update_gib']:.2f} GiB, torch peak {r['measured_peak_gib']:.2f}"
                f" GiB, plan/measured {r['plan_over_measured']:.3f}"
            )
    nq = s.get("nq")
    if nq and nq.get("cut"):
        lines.append(f"nq: cut after {nq['steps']} GRPO steps (no evaluation after): rewards {nq['reward']}")
    elif nq:
        for source, r in nq["held_out"].items():
            lo, hi = r["em_diff_ci95"]
            lines.append(
                f"nq {source} (n {r['n']}): EM {r['em_before']:.3f} -> {r['em_after']:.3f}, {r['em_diff']:+.3f} "
                f"[{lo:+.3f}, {hi:+.3f}]"
            )
        tr = nq["training"]
        lines.append(
            f"nq: {tr['steps']} steps of {tr['trajectories_per_step']:.0f} trajectories, {tr['step_s_mean']:.1f} s a "
            f"step (rollout {tr['rollout_s_mean']:.1f}, update {tr['update_s_mean']:.1f}), "
            f"total {nq['time_s']['total']:.0f} s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engines", help="bench/engines.py on the model and a shape, beside the bandwidth bound")
    e.add_argument("--model", required=True)
    e.add_argument("--shape", help="also a random-weight shape of bench/plan_vs_measured_gpu.py's SHAPES")
    e.add_argument("--rows", type=int, nargs="+", default=[128, 512])
    e.add_argument("--new-tokens", type=int, default=256)
    e.add_argument("--engines", nargs="+", default=["hf", "paged"])
    e.add_argument("--device", default="cpu")
    e.add_argument("--seconds", type=float, default=120.0, help="the step's time; runs past it are cut")
    e.add_argument("--min-run-s", type=float, default=15.0, help="start no run with less time left")
    e.add_argument("--out", required=True)
    f = sub.add_parser("fastest-engine", help="print the engine with the most tokens/s in an engines JSON")
    f.add_argument("path")
    f.add_argument("--default", default="hf")
    s = sub.add_parser("summary", help="print the session's summary and write OUT_DIR/session.json")
    s.add_argument("out")
    args = ap.parse_args(argv)
    if args.cmd == "engines":
        return run_engines(args)
    if args.cmd == "fastest-engine":
        print(fastest_engine(Path(args.path), args.default))
        return 0
    out = Path(args.out)
    session = summarise(out)
    (out / "session.json").write_text(json.dumps(session, indent=1))
    print(render(session))
    print(f"JSON: {out / 'session.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
