"""Checkpoints survive a kill at any point of a save or a delete: a step saved again (a rollback re-saves the
step it returned to), a pruned step and a step a rollback abandons."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from agent_rl.runtime import checkpoint as ckpt


class Killed(BaseException):
    """The process dies here (raised from inside a file operation, caught by the test only)."""


def _save(root: Path, step: int, value: float, keep_last: int = 0) -> Path:
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    return ckpt.save_checkpoint(root, step, model, None, None, {"value": value}, {}, keep_last=keep_last)


def _load(path: Path) -> float:
    """The value the checkpoint at `path` was saved with, read back through `load_checkpoint` (which fails on a
    checkpoint missing a file)."""
    model = torch.nn.Linear(2, 2)
    extra = ckpt.load_checkpoint(path, model, None, None)
    assert torch.all(model.weight == extra["value"])
    return extra["value"]


def _kill_mid_rmtree(monkeypatch) -> None:
    """shutil.rmtree of an existing checkpoint directory deletes its model file, then the process dies (the
    files go in directory order, so `state.pt` may be left)."""
    real = shutil.rmtree

    def rmtree(path, ignore_errors=False, **kw):
        path = Path(path)
        if not path.exists():
            return real(path, ignore_errors=True)
        if path.name.startswith(".tmp_"):  # clearing a stale temporary folder is not what is killed here
            return real(path, ignore_errors=ignore_errors, **kw)
        (path / "model.pt").unlink(missing_ok=True)
        raise Killed(str(path))

    monkeypatch.setattr(shutil, "rmtree", rmtree)


def test_a_kill_while_a_step_is_saved_again_leaves_a_whole_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _save(root, 2, 1.0)
    _kill_mid_rmtree(monkeypatch)
    try:
        _save(root, 2, 2.0)
    except Killed:
        pass
    monkeypatch.undo()
    found = ckpt.checkpoints(root)
    assert [p.name for p in found] == ["step_2"]
    assert _load(found[0]) in (1.0, 2.0)  # old or new, but whole


def test_a_kill_between_the_two_renames_of_a_resave_puts_the_old_copy_back(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _save(root, 2, 1.0)
    real = ckpt.os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp_"):  # the new copy's publishing rename: the process dies before it
            raise Killed(str(src))
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    try:
        _save(root, 2, 2.0)
    except Killed:
        pass
    monkeypatch.undo()
    assert not (root / "step_2").exists()  # the kill fell between moving the old copy aside and publishing
    latest = ckpt.latest_checkpoint(root)
    assert latest == root / "step_2" and _load(latest) == 1.0
    _save(root, 2, 3.0)  # the next save of the step goes through and leaves no leftovers
    assert _load(ckpt.latest_checkpoint(root)) == 3.0
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]


@pytest.mark.parametrize("how", ["prune", "rollback"])
def test_a_kill_while_a_checkpoint_is_deleted_never_leaves_it_looking_finished(tmp_path, monkeypatch, how):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save(root, step, float(step))
    _kill_mid_rmtree(monkeypatch)
    try:
        if how == "prune":
            ckpt.prune_checkpoints(root, keep_last=1, keep=root / "step_3")
        else:
            ckpt.drop_checkpoints_after(root, 1)
    except Killed:
        pass
    monkeypatch.undo()
    # the kill came while the first of them went: it is out of sight, the rest untouched and whole
    left = [p.name for p in ckpt.checkpoints(root)]
    assert left == (["step_2", "step_3"] if how == "prune" else ["step_1", "step_3"])
    assert [_load(root / name) for name in left] == [float(name[-1]) for name in left]
    _save(root, 4, 4.0)  # the next save clears what the killed delete left
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_a_lora_checkpoint_loads_only_into_the_adapters_it_was_saved_from(tmp_path, tiny_model_dir):
    """A LoRA policy's checkpoint restores its adapters exactly; loaded into a policy with adapters on other
    modules (another model.lora.target_modules) it is refused, naming what is missing, instead of leaving
    those adapters at their fresh initialisation."""
    from agent_rl.config import load_config
    from agent_rl.learn.policy import load_policy

    def policy(targets: str):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", "model.lora.enabled=true", targets])
        return load_policy(cfg.model, str(tiny_model_dir), "cpu")

    saved = policy("model.lora.target_modules=[q_proj,v_proj]")
    with torch.no_grad():
        for name, p in saved.named_parameters():
            if p.requires_grad:
                p.fill_(0.25)
    path = ckpt.save_checkpoint(tmp_path, 1, saved, None, None, {}, {}, keep_last=0)
    same = policy("model.lora.target_modules=[q_proj,v_proj]")
    ckpt.load_checkpoint(path, same, None, None)
    trained = {n: p for n, p in same.named_parameters() if p.requires_grad}
    assert trained and all(torch.all(p == 0.25) for p in trained.values())
    with pytest.raises(RuntimeError, match=r"does not match the model's adapters.*k_proj"):
        ckpt.load_checkpoint(path, policy("model.lora.target_modules=[q_proj,k_proj,v_proj]"), None, None)


def test_a_fresh_run_over_an_earlier_runs_checkpoints_refuses_or_with_overwrite_deletes_them(tmp_path):
    """Without --resume, a folder holding an earlier run's step_10 and step_20: the new run would save step_5 beside
    them and a later --resume would pick the earlier run's step_20. It refuses, naming --resume, run.overwrite and
    run.output_dir, and leaves them; run.overwrite=true deletes them; an empty or missing folder starts as before."""
    from agent_rl.train import fresh_start

    root = tmp_path / "checkpoints"
    fresh_start(root, overwrite=False, main=True)  # no folder yet
    for step in (10, 20):
        _save(root, step, float(step))
    with pytest.raises(FileExistsError, match=r"step_10, step_20.*--resume.*run\.overwrite=true.*run\.output_dir"):
        fresh_start(root, overwrite=False, main=True)
    assert [p.name for p in ckpt.checkpoints(root)] == ["step_10", "step_20"]
    fresh_start(root, overwrite=True, main=False)  # another rank: rank 0 deletes
    assert len(ckpt.checkpoints(root)) == 2
    fresh_start(root, overwrite=True, main=True)
    assert ckpt.checkpoints(root) == [] and ckpt.latest_checkpoint(root) is None
    fresh_start(root, overwrite=False, main=True)
