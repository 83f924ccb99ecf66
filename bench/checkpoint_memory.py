"""Host memory while a checkpoint is saved and loaded: peak RSS over the live training state.

Usage: .venv/bin/python bench/checkpoint_memory.py [--sizes tiny,small,medium]

For each size a fresh subprocess builds the random Qwen2 of `agent-rl init-model --size S`
(no tokenizer needed), takes one AdamW step so the optimizer holds its two moments, then
measures peak RSS (VmHWM, reset through /proc/self/clear_refs before each phase) while
`agent_rl.runtime.checkpoint.save_checkpoint` writes model + optimizer + RNG atomically, and while
`load_checkpoint` restores them. "extra" is the peak above the RSS the process held before the
phase: what a host needs free on top of the training state to checkpoint it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent_rl.runtime.memory import proc_status_bytes  # noqa: E402


def _status(key: str) -> int:
    value = proc_status_bytes(key)
    if value is None:
        raise RuntimeError(f"{key} not in /proc/self/status (this bench needs Linux)")
    return value


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def run_one(size: str) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agent_rl.bootstrap.model_init import SIZES
    from agent_rl.runtime.checkpoint import load_checkpoint, save_checkpoint

    spec = dict(SIZES[size])
    config = Qwen2Config(vocab_size=spec.pop("vocab"), max_position_embeddings=2048, tie_word_embeddings=True, **spec)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    n_params = sum(p.numel() for p in model.parameters())
    out = {
        "size": size,
        "params_m": n_params / 1e6,
        "weights_mib": n_params * 4 / 2**20,
        "adam_mib": n_params * 8 / 2**20,
    }
    with tempfile.TemporaryDirectory() as tmp:
        before = _status("VmRSS")
        _reset_peak()
        path = save_checkpoint(Path(tmp), 1, model, opt, None, {}, {}, keep_last=1)
        out.update(rss_before_save_mib=before / 2**20, save_peak_mib=_status("VmHWM") / 2**20)
        out["save_extra_mib"] = out["save_peak_mib"] - out["rss_before_save_mib"]
        out["checkpoint_mib"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
        before = _status("VmRSS")
        _reset_peak()
        load_checkpoint(path, model, opt, None)
        out.update(rss_before_load_mib=before / 2**20, load_peak_mib=_status("VmHWM") / 2**20)
        out["load_extra_mib"] = out["load_peak_mib"] - out["rss_before_load_mib"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small,medium")
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.size:
        print(json.dumps(run_one(args.size)))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    print(
        f"{'size':<7} {'params M':>8} {'weights':>8} {'adam':>8} {'ckpt MiB':>9} {'RSS before':>10} "
        f"{'save peak':>10} {'save extra':>10} {'load extra':>10}"
    )
    for size in args.sizes.split(","):
        res = subprocess.run([sys.executable, __file__, "--size", size], capture_output=True, text=True, env=env)
        if res.returncode:
            print(res.stderr[-2000:])
            raise SystemExit(f"{size} failed")
        r = json.loads(res.stdout.strip().splitlines()[-1])
        print(
            f"{r['size']:<7} {r['params_m']:>8.1f} {r['weights_mib']:>8.0f} {r['adam_mib']:>8.0f} "
            f"{r['checkpoint_mib']:>9.0f} "
            f"{r['rss_before_save_mib']:>10.0f} {r['save_peak_mib']:>10.0f} {r['save_extra_mib']:>10.0f} "
            f"{r['load_extra_mib']:>10.0f}"
        )


if __name__ == "__main__":
    main()
