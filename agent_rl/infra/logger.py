"""One logger object for every metric: JSONL (always), TensorBoard (optional), a progress line.

Keys are namespaced (`rollout/`, `budget/`, `loss/`, `actor/`, `critic/`, `retriever/`,
`memory/`, `timing/`, `eval/`); each JSONL line is one flat object with `step`.
Only rank 0 writes (`enabled=False` elsewhere).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


class MetricsLogger:
    def __init__(self, output_dir: str | Path, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(output_dir) / "tb"))
            except ImportError:
                print("[logger] tensorboard is not installed; metrics go to metrics.jsonl only", file=sys.stderr)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {
            k: (float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None)
            for k, v in metrics.items()
        }
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if v is not None:
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines a killed run wrote after its last checkpoint."""
        if not self.enabled or not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def progress(self, step: int, total: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        parts = [f"step {step}/{total}"]
        for key, label in (
            ("reward/mean", "reward"),
            ("rollout/response_length_mean", "resp_len"),
            ("timing/tokens_per_s", "tok/s"),
            ("eval/em", "eval_em"),
            ("loss/policy", "pg_loss"),
        ):
            if key in metrics and metrics[key] is not None:
                parts.append(f"{label} {metrics[key]:.3f}")
        print(" | ".join(parts), flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
