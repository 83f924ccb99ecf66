"""Atomic checkpoints: write `root/.tmp_step_N`, then rename to `root/step_N`; keep the last K.

A checkpoint holds the model (`model/`, safetensors through `save_pretrained`, so a checkpoint
is also a loadable Hugging Face model dir), the optimizer and scheduler states, every RNG state
(python, numpy, torch CPU and CUDA), the caller's extra state (step, data cursor, ...), the
config, and, when the caller has one that no other file can rebuild (the frozen reference a
rollback anchors its KL to), the reference's weights (`reference.safetensors`). A run killed
mid-save leaves only a `.tmp_*` directory, which `latest_checkpoint` ignores, so the previous
checkpoint stays usable. A step saved again (a rollback re-saves the step it returned to) moves the old
copy aside to `.prev_step_N` before the new one takes its name, and deletes it only after; a run killed
between the two renames finds the old copy put back. A checkpoint deleted (pruned, or abandoned by a
rollback) is first renamed out of sight (`.del_*`), so a kill mid-delete never leaves a half-deleted
`step_N` that looks finished. Tensors are written file by file (model shards by safetensors, optimizer
state with torch.save) so saving does not build a second full copy of the model in host memory.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP = re.compile(r"^step_(\d+)$")


def rng_state() -> dict:
    """Every RNG stream a run draws from: python, numpy, torch CPU and (when present) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the streams saved by `rng_state`; a CUDA state is skipped on a machine without CUDA."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under root, oldest first (a step whose re-save was killed between its two renames
    gets its previous copy back first)."""
    if not root.exists():
        return []
    for prev in root.glob(".prev_step_*"):
        final = root / prev.name[len(".prev_") :]
        if _STEP.match(final.name) and not final.exists() and (prev / "state.pt").exists():
            try:
                os.replace(prev, final)
            except FileNotFoundError:  # another rank on the same filesystem put it back first
                pass
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := _STEP.match(p.name)) and (p / "state.pt").exists()
    ]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    m = _STEP.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a step_N checkpoint directory")
    return int(m.group(1))


def discard(path: Path) -> None:
    """Delete a checkpoint directory: renamed out of `checkpoints`' sight first (one atomic rename), then
    removed, so a kill mid-delete leaves a `.del_*` leftover (removed by the next save), never a `step_N`
    missing some of its files."""
    path = Path(path)
    if not path.exists():
        return
    gone = path.with_name(f".del_{path.name}")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Give the finished (synced) checkpoint `tmp` its name `final`: an earlier copy of that step is moved
    aside first and deleted only once the new one is in place (`checkpoints` puts it back if a kill falls
    between the two renames); the directory's entries are synced after. Leftovers of killed deletes go."""
    root = final.parent
    prev = root / f".prev_{final.name}"
    discard(prev)
    if final.exists():
        os.replace(final, prev)
    os.replace(tmp, final)
    _fsync_dir(root)
    discard(prev)  # out of sight first: a half-deleted copy must never be put back
    for gone in root.glob(".del_*"):
        shutil.rmtree(gone, ignore_errors=True)


def drop_checkpoints_after(root: Path, step: int) -> None:
    """Delete the finished checkpoints of steps after `step` (a rollback abandons them: a later
    --resume must not pick them up)."""
    for path in checkpoints(Path(root)):
        if checkpoint_step(path) > step:
            discard(path)


def latest_checkpoint(root: Path) -> Path | None:
    found = checkpoints(Path(root))
    return found[-1] if found else None


def prune_checkpoints(root: Path, keep_last: int, keep: Path) -> None:
    """Delete all but the newest `keep_last` finished checkpoints under root, never `keep`.

    `keep_last <= 0` keeps everything.
    """
    for old in checkpoints(Path(root))[:-keep_last] if keep_last > 0 else []:
        if old != keep:
            discard(old)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Make a written checkpoint durable before a rename publishes it: every file, and every directory's
    entries (subdirectories such as `model/` included)."""
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        _fsync_dir(d)
    _fsync_dir(path)


REFERENCE = "reference.safetensors"


def save_checkpoint(
    root: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    extra_state: dict,
    config_dict: dict,
    keep_last: int,
    reference: torch.nn.Module | None = None,
) -> Path:
    """Write `root/step_N` atomically and prune to `keep_last`; `reference`, when given, is saved whole
    with it (`load_reference` reads it back), so the checkpoint does not depend on another one that
    pruning may delete."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp_step_{step}"
    final = root / f"step_{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(tmp / "model", safe_serialization=True)
    else:
        torch.save(model.state_dict(), tmp / "model.pt")
    torch.save(
        {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        },
        tmp / "optim.pt",
    )
    if reference is not None:
        from safetensors.torch import save_model

        save_model(reference, str(tmp / REFERENCE))  # tied weights written once
    torch.save({"rng": rng_state(), "extra": extra_state, "step": step}, tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(config_dict, indent=1, default=str))
    fsync_tree(tmp)  # make the bytes durable before the rename publishes them
    publish(tmp, final)
    prune_checkpoints(root, keep_last, keep=final)
    return final


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG states; returns the extra state."""
    path = Path(path)
    if (path / "model").exists():
        from safetensors import safe_open
        from safetensors.torch import load_file

        files = sorted((path / "model").glob("*.safetensors"))
        if hasattr(model, "peft_config"):  # peft saves adapters only, with its own key names
            from peft import set_peft_model_state_dict

            state = {}
            for f in files:
                state.update(load_file(f))
            # strict=False inside: the frozen base is not in the state (peft annotates the result as a bare namedtuple)
            result: Any = set_peft_model_state_dict(model, state)
            trained = {name for name, p in model.named_parameters() if p.requires_grad}
            missing = sorted(k for k in result.missing_keys if k in trained)
            if missing or result.unexpected_keys:
                raise RuntimeError(
                    f"checkpoint {path} does not match the model's adapters (another model.lora.target_modules or "
                    f"base model?): missing {missing[:5]} ({len(missing)}), unexpected "
                    f"{sorted(result.unexpected_keys)[:5]} ({len(result.unexpected_keys)})"
                )
        else:
            # Tensor by tensor into the live parameters: the host never holds a second full copy.
            target = model.state_dict()
            seen: set[str] = set()
            unexpected = []
            with torch.no_grad():
                for f in files:
                    with safe_open(f, framework="pt", device="cpu") as fh:
                        for key in fh.keys():
                            if key not in target:
                                unexpected.append(key)
                                continue
                            target[key].copy_(fh.get_tensor(key))
                            seen.add(key)
            real_missing = [k for k in target if k not in seen and not k.endswith("lm_head.weight")]  # tied embeddings
            if real_missing or unexpected:
                raise RuntimeError(
                    f"checkpoint {path} does not match the model: missing {real_missing[:5]}, unexpected "
                    f"{unexpected[:5]}"
                )
    else:
        model.load_state_dict(torch.load(path / "model.pt", map_location="cpu"))
    optim = torch.load(
        path / "optim.pt", map_location="cpu", weights_only=False, mmap=True
    )  # mmap: no second in-RAM copy of the Adam moments
    if optimizer is not None and optim["optimizer"] is not None:
        optimizer.load_state_dict(optim["optimizer"])
    if scheduler is not None and optim["scheduler"] is not None:
        scheduler.load_state_dict(optim["scheduler"])
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    set_rng_state(state["rng"])
    return state["extra"]


def load_reference(path: Path, module: torch.nn.Module) -> bool:
    """The reference saved with checkpoint `path` into `module` (same architecture and dtype); False when the
    checkpoint holds none."""
    file = Path(path) / REFERENCE
    if not file.exists():
        return False
    from safetensors.torch import load_model

    load_model(module, str(file))
    return True


class StopFlag:
    """Set by SIGTERM / SIGINT; the training loop checks it, saves and exits cleanly."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal: int | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, signum: int | None = None) -> None:
        self.signal = signum
        self._event.set()


def install_signal_handlers() -> StopFlag:
    """First SIGTERM/SIGINT: finish the step, save, exit. A second SIGINT interrupts at once."""
    flag = StopFlag()

    def handler(signum, frame):
        if flag.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.set(signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    return flag
