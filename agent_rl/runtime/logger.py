"""One logger object for every metric: JSONL (always), TensorBoard and Weights & Biases (optional), a progress line.

Keys are namespaced (`rollout/`, `budget/`, `loss/`, `actor/`, `critic/`, `retriever/`,
`memory/`, `timing/`, `eval/`); each JSONL line is one flat object with `step`. TensorBoard and W&B
get the same names at the same steps. W&B plots every key against its own `step` metric rather than
its internal step counter, so the steps a resumed run logs again after its last checkpoint are kept,
not dropped as out of order. `log_trajectories` shows the first `TABLE_ROWS` trajectories of a file
the run wrote as a table (a `wandb.Table`; a Markdown table in TensorBoard's text tab).

A backend that fails to start stops the run at start-up, or with `run.wandb_on_missing=warn` is left
out with a warning; a backend whose call raises later is warned about once and switched off, so a
logging failure never ends a run. Only rank 0 writes (`enabled=False` elsewhere).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_rl.config import Config, ConfigError, RunConfig

# Rows of each trajectory table, and their columns (keys of `Trajectory.to_record` plus EM and F1).
TABLE_ROWS = 8
TABLE_COLUMNS = (
    "prompt_id",
    "sample_idx",
    "data_source",
    "prompt_text",
    "response_text",
    "golden_answers",
    "reward",
    "em",
    "num_turns",
    "end_reason",
    "total_tokens",
)
# The W&B run id, kept beside metrics.jsonl so that `--resume` continues the same W&B run.
WANDB_ID_FILE = "wandb_run_id"


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | Path,
        tensorboard: bool = True,
        enabled: bool = True,
        wandb: RunConfig | None = None,
        config: dict | None = None,
        resume: bool = False,
    ):
        """`wandb`: the run settings (`run.wandb_*`) when W&B is on; `config` becomes the W&B run's
        config; `resume` continues the W&B run whose id OUTPUT_DIR/wandb_run_id holds."""
        self.enabled = enabled
        self.out_dir = Path(output_dir)
        self.path = self.out_dir / "metrics.jsonl"
        self._tb: Any = None
        self._wandb: Any = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if wandb is not None:  # first: a start-up error leaves nothing open
            self._start_wandb(wandb, config or {}, resume)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except ImportError:
                print("[logger] tensorboard is not installed; metrics go to metrics.jsonl only", file=sys.stderr)

    @classmethod
    def from_config(cls, cfg: Config, enabled: bool = True, resume: bool = False) -> MetricsLogger:
        """The run's logger: `run.tensorboard` and `run.wandb*`, with `cfg` (as resolved) the W&B config."""
        run = cfg.run
        return cls(run.output_dir, run.tensorboard, enabled, run if run.wandb else None, cfg.to_dict(), resume)

    def _start_wandb(self, opts: RunConfig, config: dict, resume: bool) -> None:
        try:
            import wandb
        except ImportError as err:
            self._wandb_unavailable(
                opts,
                f"run.wandb=true but the wandb package cannot be imported ({err}): run "
                "`pip install 'agent-rl[wandb]'` (or `pip install wandb`), or set run.wandb=false",
            )
            return
        mode: Any = opts.wandb_mode or os.environ.get("WANDB_MODE") or "offline"  # W&B checks $WANDB_MODE
        id_file = self.out_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        try:
            run = wandb.init(
                project=opts.wandb_project,
                entity=opts.wandb_entity or None,
                name=self.out_dir.name,
                dir=os.environ.get("WANDB_DIR") or str(self.out_dir),
                id=run_id or None,
                # Offline, W&B ignores `resume` (with a warning): `wandb sync` joins the runs of one id.
                resume="allow" if run_id and mode == "online" else None,
                config=config,
                mode=mode,
                reinit="create_new",
            )
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
        except Exception as err:  # no credentials, service unreachable, bad WANDB_* settings
            where = f"run.wandb_mode={mode}" if opts.wandb_mode else f"mode {mode} (run.wandb_mode empty: $WANDB_MODE)"
            self._wandb_unavailable(
                opts,
                f"run.wandb=true but W&B did not start in {where} ({type(err).__name__}: {err}). "
                "Online it needs `wandb login` (or WANDB_API_KEY) and a reachable service: fix that, or set "
                "run.wandb_mode=offline (upload later with `wandb sync`)",
            )
            return
        id_file.write_text(f"{run.id}\n")
        self._wandb = run

    @staticmethod
    def _wandb_unavailable(opts: RunConfig, message: str) -> None:
        if opts.wandb_on_missing == "error":
            raise ConfigError(f"{message}; or set run.wandb_on_missing=warn to train without W&B")
        warnings.warn(
            f"{message}. Training goes on without W&B (run.wandb_on_missing=warn)", RuntimeWarning, stacklevel=4
        )

    def _safely(self, backend: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """`call(*args, **kwargs)` on one backend; on an error warn once and switch that backend off (metrics.jsonl
        goes on)."""
        try:
            call(*args, **kwargs)
        except Exception as err:
            warnings.warn(
                f"[logger] {backend} failed ({type(err).__name__}: {err}); it is off for the rest of the run, "
                f"metrics still go to {self.path}",
                RuntimeWarning,
                stacklevel=3,
            )
            if backend == "tensorboard":
                self._tb = None
            else:
                self._wandb = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {
            k: (float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None)
            for k, v in metrics.items()
        }
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, **clean}) + "\n")
        finite = {k: v for k, v in clean.items() if v is not None}
        if self._tb is not None:
            self._safely("tensorboard", self._tb_scalars, step, finite)
        if self._wandb is not None:
            self._safely("wandb", self._wandb.log, {"step": step, **finite})

    def _tb_scalars(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def log_trajectories(self, step: int, key: str, path: str | Path) -> None:
        """The first TABLE_ROWS trajectories of the JSONL file `path` (`agent-rl view`'s records, as the run
        writes them under trajectories/ and eval_trajectories/) as a table under `key` at `step`."""
        if not self.enabled or (self._tb is None and self._wandb is None):
            return
        with Path(path).open() as fh:
            records = [json.loads(line) for line in itertools.islice(fh, TABLE_ROWS)]
        rows = [[_cell(r.get(c)) for c in TABLE_COLUMNS] for r in records]
        if self._tb is not None:
            self._safely("tensorboard", self._tb.add_text, key, _markdown(rows), step)
        if self._wandb is not None:
            self._safely("wandb", self._wandb_table, step, key, rows)

    def _wandb_table(self, step: int, key: str, rows: list[list[Any]]) -> None:
        import wandb

        self._wandb.log({"step": step, key: wandb.Table(columns=list(TABLE_COLUMNS), data=rows)})

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

    def close(self, failed: bool = False) -> None:
        """Close the backends (once; later calls do nothing); `failed` marks the W&B run as failed."""
        tb, run = self._tb, self._wandb
        self._tb = self._wandb = None
        if tb is not None:
            self._safely("tensorboard", tb.close)
        if run is not None:
            self._safely("wandb", run.finish, exit_code=1 if failed else 0)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Closed at the end of a `with` block, as failed when an exception leaves it."""
        self.close(failed=exc_type is not None)


def _cell(value: Any) -> Any:
    """A table cell: lists joined into one string, numbers and text as they are (None stays empty)."""
    if isinstance(value, list):
        return " | ".join(str(v) for v in value)
    return value


def _markdown(rows: list[list[Any]]) -> str:
    """A Markdown table for TensorBoard's text tab (pipes and newlines escaped inside cells)."""

    def fmt(v: Any) -> str:
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
