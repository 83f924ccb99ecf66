"""The W&B backend beside TensorBoard, with the real `wandb` package in offline mode (no network): the
logger is driven as `agent-rl train` drives it, then the offline run's `.wandb` file is read back."""

import json
import math
import struct
import sys
import time
import warnings
from pathlib import Path

import pytest
from agent_fixtures import free_port

from agent_rl.config import ConfigError, load_config
from agent_rl.runtime.logger import TABLE_COLUMNS, TABLE_ROWS, WANDB_ID_FILE, MetricsLogger

wandb = pytest.importorskip("wandb", reason="the wandb extra (`make setup` installs it)")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch) -> Path:
    """W&B offline, with every folder it writes under tmp_path and no credentials; returns WANDB_DIR."""
    root = tmp_path / "wandb_home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(root))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(root / var.lower()))
    monkeypatch.setenv("NETRC", str(root / "no_netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    # Nothing may leave the machine even if a run went online: the "service" is a closed local port.
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    return root


def _config(tmp_path: Path, *extra: str):
    return load_config(None, [f"run.output_dir={tmp_path / 'run'}", "run.wandb=true", "run.wandb_project=t", *extra])


def _trajectory_file(path: Path, n: int = TABLE_ROWS + 2) -> Path:
    """A trajectories JSONL as the run writes it (`Trajectory.to_record` plus EM and F1, fields trimmed)."""
    rows = [
        {
            "prompt_id": f"toy_{i}",
            "sample_idx": 0,
            "data_source": "toy",
            "prompt_text": "Question: who? | a pipe\nand a newline",
            "response_text": "<search>x</search><answer>y</answer>",
            "golden_answers": ["y", "z"],
            "reward": None if i == 1 else float(i % 2),
            "em": float(i % 2),
            "f1": 0.5,
            "num_turns": 2,
            "end_reason": "answer",
            "total_tokens": 40 + i,
            "response_ids": [1, 2, 3],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _drive(logger: MetricsLogger, traj: Path, steps: range) -> list[tuple[int, dict]]:
    """What `train` does: an evaluation at step 0 (metrics and its trajectories), then per step the rollout's
    trajectories and the step's metrics (one of them not finite, as a metric can be). Returns what was logged."""
    logged = [(0, {"eval/em": 0.25, "eval/toy/em": 0.25})]
    logger.log(*logged[0])
    logger.log_trajectories(0, "eval/trajectories", traj)
    for step in steps:
        metrics = {"reward/mean": 0.1 * step, "loss/policy": -0.01 * step, "timing/step_s": 1.5, "actor/kl": math.nan}
        logger.log_trajectories(step, "rollout/trajectories", traj)
        logger.log(step, metrics)
        logged.append((step, metrics))
    return logged


def _records(run_dir: Path, timeout_s: float = 30.0) -> list:
    """The records of an offline run's `.wandb` file: LevelDB-log framing (32 KiB blocks, 7-byte chunk
    headers: CRC, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) after a 7-byte W&B header. W&B's
    service writes the file in the background and may still be writing it when `finish()` has returned,
    so this reads until the run's exit record is there."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        out, pos, chunk = [], 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _crc, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if pos + 7 + size > len(data):
                break  # a chunk still being written
            chunk += data[pos + 7 : pos + 7 + size]
            pos += 7 + size
            if kind in (1, 4):
                rec = pb.Record()
                rec.ParseFromString(chunk)
                out.append(rec)
                chunk = b""
        if any(r.WhichOneof("record_type") == "exit" for r in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def _of(records: list, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def _history(records: list) -> list[dict]:
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in h.item}
        for h in _of(records, "history")
    ]


def _runs(wandb_dir: Path) -> list[Path]:
    """The offline run folders, oldest first (by the start time in each run's record)."""
    folders = (wandb_dir / "wandb").glob("offline-run-*")
    return sorted(folders, key=lambda d: _of(_records(d), "run")[0].start_time.ToNanoseconds())


def test_wandb_gets_tensorboards_metrics_the_config_and_trajectory_tables(wandb_env, tmp_path):
    """Offline W&B: the metric names and steps are TensorBoard's exactly (non-finite values left out by both),
    the resolved config is the run's config, each trajectory file is a table of TABLE_ROWS rows in W&B and in
    TensorBoard's text tab, the run id is stored in the run directory, and the run finishes with exit code 0."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _config(tmp_path, "run.max_steps=7")
    logger = MetricsLogger.from_config(cfg)
    with logger:  # as `train` holds it
        logged = _drive(logger, _trajectory_file(tmp_path / "traj.jsonl"), range(1, 4))

    (run_dir,) = _runs(wandb_env)
    records = _records(run_dir)
    (run,) = _of(records, "run")
    assert run.project == "t" and run.display_name == "run"
    assert (tmp_path / "run" / WANDB_ID_FILE).read_text().strip() == run.run_id
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["run"]["max_steps"] == 7 and config["run"]["wandb"] is True
    assert config["algo"] == cfg.to_dict()["algo"]

    history = _history(records)
    scalars = {(k, row["step"]) for row in history for k in row if "/" in k and "trajectories" not in k}
    expected = {(k, step) for step, m in logged for k, v in m.items() if math.isfinite(v)}
    assert scalars == expected
    events = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    tb = {(tag, e.step) for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert tb == expected
    assert {tag for tag in events.Tags()["tensors"]} >= {"eval/trajectories/text_summary"}

    tables = [(row["step"], k) for row in history for k in row if k.endswith("trajectories/_type")]
    assert tables == [(0, "eval/trajectories/_type")] + [(s, "rollout/trajectories/_type") for s in (1, 2, 3)]
    assert all(row[k] == "table-file" for row in history for k in row if k.endswith("trajectories/_type"))
    (eval_table,) = run_dir.glob("files/media/table/eval/trajectories_*.table.json")
    table = json.loads(eval_table.read_text())
    assert table["columns"] == list(TABLE_COLUMNS) and len(table["data"]) == TABLE_ROWS
    assert table["data"][0][TABLE_COLUMNS.index("golden_answers")] == "y | z"
    assert table["data"][1][TABLE_COLUMNS.index("reward")] is None

    (exit_record,) = _of(records, "exit")
    assert exit_record.exit_code == 0
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
        2,
        3,
    ]


def test_an_exception_finishes_the_wandb_run_as_failed(wandb_env, tmp_path):
    """An exception leaving the logger's block (the training loop's) finishes the W&B run with exit code 1;
    closing again afterwards does nothing."""
    logger = MetricsLogger.from_config(_config(tmp_path, "run.tensorboard=false"))
    with pytest.raises(RuntimeError, match="boom"), logger:
        logger.log(1, {"reward/mean": 1.0})
        raise RuntimeError("boom")
    logger.close()
    (exit_record,) = _of(_records(_runs(wandb_env)[0]), "exit")
    assert exit_record.exit_code == 1


def test_a_failing_log_call_warns_once_and_switches_that_backend_off(wandb_env, tmp_path, monkeypatch):
    """A W&B call that raises mid-run is one warning; W&B is off after it, metrics.jsonl and TensorBoard go on."""
    logger = MetricsLogger.from_config(_config(tmp_path))
    run = logger._wandb

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(run, "log", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": 0.5})
        logger.log_trajectories(3, "rollout/trajectories", _trajectory_file(tmp_path / "traj.jsonl"))
    failures = [w for w in caught if "wandb failed" in str(w.message)]
    assert len(failures) == 1 and "disk full" in str(failures[0].message)
    assert logger._wandb is None and logger._tb is not None
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    logger.close()
    run.finish()


@pytest.mark.parametrize("on_missing", ["error", "warn"])
def test_a_missing_wandb_package(wandb_env, tmp_path, monkeypatch, on_missing):
    """Without the wandb package: on_missing=error stops at start-up naming the key and the pip install;
    on_missing=warn warns and logs to metrics.jsonl and TensorBoard only."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = _config(tmp_path, f"run.wandb_on_missing={on_missing}")
    if on_missing == "error":
        with pytest.raises(ConfigError) as err:
            MetricsLogger.from_config(cfg)
        assert "run.wandb=true" in str(err.value) and "pip install 'agent-rl[wandb]'" in str(err.value)
        assert "run.wandb_on_missing=warn" in str(err.value)
        assert not (tmp_path / "run" / "tb").exists()  # nothing was opened
        return
    with pytest.warns(RuntimeWarning, match=r"pip install 'agent-rl\[wandb\]'.*without W&B"):
        logger = MetricsLogger.from_config(cfg)
    with logger:
        _drive(logger, _trajectory_file(tmp_path / "traj.jsonl"), range(1, 3))
    assert logger._wandb is None
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert not (tmp_path / "run" / WANDB_ID_FILE).exists()


@pytest.mark.parametrize("on_missing", ["error", "warn"])
def test_a_wandb_service_that_cannot_be_used(wandb_env, tmp_path, on_missing):
    """run.wandb_mode=online with no credentials (and the service URL a closed local port): on_missing=error is
    a start-up error naming run.wandb_mode and the fixes; warn goes on with TensorBoard only."""
    cfg = _config(tmp_path, "run.wandb_mode=online", f"run.wandb_on_missing={on_missing}")
    if on_missing == "error":
        with pytest.raises(ConfigError, match=r"run\.wandb_mode=online.*wandb login.*run\.wandb_mode=offline"):
            MetricsLogger.from_config(cfg)
        return
    with pytest.warns(RuntimeWarning, match="did not start"):
        logger = MetricsLogger.from_config(cfg)
    with logger:
        logger.log(1, {"reward/mean": 1.0})
    assert logger._wandb is None and list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_resume_continues_the_same_wandb_run(wandb_env, tmp_path):
    """A resumed run logs to the W&B run id stored in the run directory (offline: a second run folder of the
    same id, which `wandb sync` joins); a fresh start in the same directory is a new run."""
    cfg = _config(tmp_path, "run.tensorboard=false")
    traj = _trajectory_file(tmp_path / "traj.jsonl")
    with MetricsLogger.from_config(cfg) as first:
        _drive(first, traj, range(1, 3))
    run_id = (tmp_path / "run" / WANDB_ID_FILE).read_text().strip()
    with MetricsLogger.from_config(cfg, resume=True) as resumed:
        resumed.truncate_after(1)
        resumed.log(2, {"reward/mean": 0.7})
        resumed.log(3, {"reward/mean": 0.8})
    assert (tmp_path / "run" / WANDB_ID_FILE).read_text().strip() == run_id
    with MetricsLogger.from_config(cfg) as fresh:
        fresh.log(1, {"reward/mean": 0.0})
    ids = [_of(_records(d), "run")[0].run_id for d in _runs(wandb_env)]
    assert ids[:2] == [run_id, run_id] and ids[2] != run_id and len(ids) == 3
    resumed_steps = [row["step"] for row in _history(_records(_runs(wandb_env)[1])) if "reward/mean" in row]
    assert resumed_steps == [2, 3]  # the rewritten step 2 kept (W&B's own step counter would have dropped it)


def test_wandb_config_keys_are_checked():
    """A wrong run.wandb_mode or run.wandb_on_missing fails at load, naming the key and the choices."""
    with pytest.raises(ConfigError, match=r"run\.wandb_mode = 'cloud'.*online, offline or disabled"):
        load_config(None, ["run.wandb_mode=cloud"])
    with pytest.raises(ConfigError, match=r"run\.wandb_on_missing = 'ignore' is not one of error, warn"):
        load_config(None, ["run.wandb_on_missing=ignore"])
    assert load_config(None, []).run.wandb is False  # TensorBoard only by default
