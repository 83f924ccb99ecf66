"""Scale-out on PyTorch's own engine: torchrun process groups, FSDP2 sharding, sharded checkpoints.

`torchrun --nproc-per-node N -m agent_rl train CONFIG` starts N ranks; `init_distributed` reads
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and joins the group (gloo on CPU, nccl on
CUDA, one explicit device per rank: `cuda:LOCAL_RANK`). Each rank rolls out its contiguous share
of the step's prompts (`split_groups`), so the n samples of a prompt, its GRPO group, are drawn on
one rank and group statistics stay local. `shard_model` applies FSDP2 (`fully_shard`) to every
decoder layer and then the root; the update normalises its loss by the global token count, so N
ranks take the step one process would take on the same global batch (tested on CPU with gloo).

Checkpoints are DCP (`torch.distributed.checkpoint`): every rank writes its own shards of the
model and optimizer state; DCP reshards on load, so a checkpoint saved by N ranks loads on M
ranks, or into one plain process (tested: 2 ranks -> 1 process; 2 -> 3 ranks checked by hand).
Weight sync to a rollout engine streams one gathered parameter at a time (`iter_full_params`),
never a whole second model. The CUDA-only branches (nccl, bf16 mixed precision, CPU offload of
shards, vLLM sync) are the same calls on another device; the tests run the gloo/CPU path only.

Departures from verl / OpenRLHF: no Ray, no parameter server, no `nn.DataParallel`; the retriever
is a separate HTTP service that all ranks share.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist
from torch import nn

from agent_rl.config import AlgoConfig, RolloutConfig, TrainConfig
from agent_rl.runtime.checkpoint import fsync_tree, prune_checkpoints, publish, rng_state, set_rng_state
from agent_rl.world import LocalWorld, World

T = TypeVar("T")


@dataclass
class DistInfo:
    """This process's place in a torchrun job, and the few collectives the trainer needs.

    Every collective must be called by all ranks in the same order (that is what a collective
    is); the trainer keeps that true by giving every rank the same number of prompts, mini-batches
    and micro-batches (`split_groups`, `even_microbatches`).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    _mesh: Any = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes logs, metrics and checkpoint metadata."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Under torchrun the trained modules are always FSDP-sharded over the ranks."""
        return True

    @property
    def mesh(self):
        """The 1-D device mesh FSDP2 shards over (all ranks), built on first use."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._mesh

    def _reduce(self, values: list[float], op) -> list[float]:
        # float64 so token counts up to 2**53 stay exact; nccl needs the tensor on the GPU.
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(t, op=op)
        return t.tolist()

    def all_reduce_sum(self, x: float) -> float:
        """Sum of `x` over all ranks."""
        return self._reduce([float(x)], torch_dist.ReduceOp.SUM)[0]

    def all_reduce_max(self, x: float) -> float:
        """Largest `x` over all ranks."""
        return self._reduce([float(x)], torch_dist.ReduceOp.MAX)[0]

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics combined over ranks: the mean over the ranks that report a key.

        Keys ending in `max` or containing `peak` take the maximum and keys ending in `min` the
        minimum, since a mean of maxima is not a maximum. Ranks may report different keys (a
        counter that fired on one rank only); a key's mean is over the ranks that have it.
        """
        gathered: list[dict[str, float] | None] = [None] * self.world_size
        torch_dist.all_gather_object(gathered, {k: float(v) for k, v in metrics.items()})
        keys = sorted({k for g in gathered for k in g})  # type: ignore[union-attr]
        out: dict[str, float] = {}
        for k in keys:
            vals = [g[k] for g in gathered if k in g]  # type: ignore[operator,index]
            if k.endswith("max") or "peak" in k:
                out[k] = max(vals)
            elif k.endswith("min"):
                out[k] = min(vals)
            else:
                out[k] = sum(vals) / len(vals)
        return out

    def barrier(self) -> None:
        torch_dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` from rank `src` on every rank (pickled; for small things like a resume path)."""
        box = [obj]
        torch_dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (pickled; an evaluation's share of scores)."""
        out: list[Any] = [None] * self.world_size
        torch_dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_world_size(rollout: RolloutConfig, algo: AlgoConfig, world: int) -> None:
    """Reject configs whose per-step work cannot be split evenly over `world` ranks."""
    if rollout.prompts_per_step % world:
        fix = math.ceil(rollout.prompts_per_step / world) * world
        raise ValueError(
            f"rollout.prompts_per_step ({rollout.prompts_per_step}) must be divisible by the number of ranks "
            f"({world}): "
            f"each rank rolls out the same number of whole GRPO groups. Set rollout.prompts_per_step={fix} "
            f"or launch with --nproc-per-node dividing it"
        )
    if algo.mini_batch_size and algo.mini_batch_size % world:
        raise ValueError(
            f"algo.mini_batch_size ({algo.mini_batch_size}) must be divisible by the number of ranks ({world}): "
            f"each rank takes mini_batch_size / world trajectories per optimizer step"
        )


def init_distributed(cfg) -> DistInfo | LocalWorld:
    """Join the torchrun job this process belongs to; a world of one when not launched by torchrun.

    Backend gloo when `train.device` is cpu, nccl when it is cuda. The rank's device is explicit:
    `cuda:LOCAL_RANK`. This rewrites `cfg.train.device` (and `cfg.rollout.device` when it names a
    GPU) to that device, so the rest of the trainer places tensors per rank without knowing
    about ranks; a `cuda:K` index in the config is replaced, because under torchrun the local
    rank picks the GPU (restrict GPUs with CUDA_VISIBLE_DEVICES).
    """
    if not launched_by_torchrun():
        return LocalWorld()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    check_world_size(cfg.rollout, cfg.algo, world)
    if not cfg.retriever.url and world != int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        raise ValueError(
            "retriever.url is unset on a multi-node run: a retriever started on 127.0.0.1 by rank 0 is not reachable "
            "from the other machines. Start retriever-server --host 0.0.0.0 and set retriever.url=http://HOST:PORT"
        )
    if cfg.train.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"train.device={cfg.train.device} but torch sees no CUDA device (torch {torch.__version__}); set "
                "train.device=cpu to train with gloo on CPUs"
            )
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local} has no GPU: this node shows {torch.cuda.device_count()} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                f"use --nproc-per-node {torch.cuda.device_count()} or fewer"
            )
        device, backend = torch.device("cuda", local), "nccl"
        torch.cuda.set_device(device)
    elif cfg.train.device == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(
            f"train.device={cfg.train.device!r}: under torchrun use cpu (gloo) or cuda (nccl, one GPU per local rank)"
        )
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(
            process_group_backend(device),
            rank=rank,
            world_size=world,
            device_id=device if backend == "nccl" else None,
            timeout=datetime.timedelta(seconds=cfg.run.dist_timeout_s),
        )
    cfg.train.device = str(device)
    if cfg.rollout.device.startswith("cuda"):
        cfg.rollout.device = str(device)
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=device, backend=backend)


def process_group_backend(device: torch.device) -> str:
    """The backend string for `init_process_group`: gloo on CPU ranks; on CUDA ranks nccl for CUDA
    tensors *and* gloo for CPU ones. With `train.offload_params` gradient clipping and the
    optimizer step run on host tensors, which an nccl-only group cannot reduce ("No backend type
    associated with device type cpu")."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def split_groups(items: Sequence[T], rank: int, world: int) -> list[T]:
    """This rank's contiguous share of the step's prompts.

    The split happens before sampling: a rank draws all n samples of each prompt it holds, so
    every GRPO group is whole on one rank and its mean/std need no communication. Equal shares
    are required, not just fair: ranks must run the same number of collectives per step.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world} ranks")
    if len(items) % world:
        fix = math.ceil(len(items) / world) * world
        raise ValueError(
            f"{len(items)} prompts per step cannot be split evenly over {world} ranks; "
            f"set rollout.prompts_per_step to a multiple of {world} (e.g. {fix})"
        )
    share = len(items) // world
    return list(items[rank * share : (rank + 1) * share])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by Hugging Face's `_no_split_modules` (e.g. Qwen2DecoderLayer)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # not a Hugging Face model: the children of a `layers` ModuleList
        for name, m in model.named_modules():
            if isinstance(m, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
                layers.extend(m)
    return layers


def shard_model(model: nn.Module, dist: DistInfo, train: TrainConfig) -> nn.Module:
    """FSDP2: `fully_shard` each decoder layer, then the root (embeddings, final norm, heads).

    Per-layer units bound the memory of one all-gather to one layer's parameters. With
    `train.bf16` (CUDA, or gloo ranks on CPU), compute runs in bf16 over fp32 master weights and
    gradients are reduced in fp32. `train.offload_params` keeps the shards (and the optimizer step) in host RAM.
    Works on
    any module (actor, reference, critic); returns the same module, now holding DTensor shards.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if any(isinstance(m, nn.DataParallel) for m in model.modules()):
        raise RuntimeError("nn.DataParallel found: agent-rl shards with FSDP2 and never uses DataParallel")
    kwargs: dict[str, Any] = {"mesh": dist.mesh}
    on_cuda = dist.device.type == "cuda"
    if train.bf16:  # fp32 master shards, bf16 compute, fp32 gradient reduction (CPU gloo ranks too)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if train.offload_params:
        if on_cuda:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        elif dist.is_main:
            print(
                "[dist] train.offload_params: a CPU run already keeps parameters in host RAM; nothing to offload",
                file=sys.stderr,
            )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def iter_full_params(
    model: nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, full tensor)` for every entry of the model's state dict, one at a time.

    A collective: every rank must iterate to the end in step. FSDP2 DTensor shards are
    all-gathered with `full_tensor()` one parameter at a time, so a consumer (vLLM's
    `load_weights`, a rank-0 export) never holds a second full model. Names are the unsharded
    model's (FSDP2 adds no prefixes). Shards offloaded to host RAM are moved to the mesh's
    device for the gather, since nccl cannot gather CPU tensors.
    """
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if tensor.device.type != mesh.device_type:
                local = tensor.to_local().to(
                    mesh.device_type
                    if mesh.device_type == "cpu"
                    else torch.device(mesh.device_type, torch.cuda.current_device())
                )
                tensor = DTensor.from_local(local, mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride())
            full = tensor.full_tensor()
        else:
            full = tensor
        full = full.detach()
        if dtype is not None or device is not None:
            full = full.to(
                device=device if device is not None else full.device, dtype=dtype if dtype is not None else full.dtype
            )
        yield name, full


def sync_rollout_weights(engine, model: nn.Module) -> float:
    """After an update under FSDP, refresh this rank's rollout engine; returns seconds.

    A collective (all ranks call it): the engine reads the full weights through `iter_full_params`,
    one gathered parameter at a time. The HF engine must hold its own unsharded copy (it refuses
    the sharded policy: ranks that sample different lengths would wait forever in FSDP's
    per-forward all-gathers).
    """
    start = time.perf_counter()
    engine.sync_weights(model, full_params=lambda dtype: iter_full_params(model, dtype=dtype))
    return time.perf_counter() - start


# ---- sharded checkpoints (DCP) ----------------------------------------------------------------


def _state(modules: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]]) -> dict:
    """DCP's state: `{name: model state, name + "_optim": optimizer state}` keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    state: dict = {}
    for name, (model, optimizer) in modules.items():
        if optimizer is None:
            state[name] = get_model_state_dict(model)
        else:
            state[name], state[f"{name}_optim"] = get_state_dict(model, optimizer)
    return state


def _restore(modules: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]], state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    for name, (model, optimizer) in modules.items():
        if optimizer is None:
            set_model_state_dict(model, state[name])
        else:
            set_state_dict(model, optimizer, model_state_dict=state[name], optim_state_dict=state[f"{name}_optim"])


def _modules(model, optimizer, critic, critic_optimizer) -> dict:
    modules = {"model": (model, optimizer)}
    if critic is not None:
        modules["critic"] = (critic, critic_optimizer)
    return modules


def save_sharded(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    dist: World,
    scheduler=None,
    extra_state: dict | None = None,
    config_dict: dict | None = None,
    keep_last: int = 2,
    export_hf: bool = False,
    critic: nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write `root/step_N/` from all ranks: DCP shards of model + optimizer, per-rank state.

    Layout: `dcp/` (each rank's shards of model, optimizer and, for PPO, critic and its optimizer,
    plus metadata), `rank_R.pt` (rank R's RNG states and its
    `extra_state`), `state.pt` (rank 0: step, world size, scheduler; written last, so
    `checkpoint.latest_checkpoint` only sees finished checkpoints), `config.json`, and with
    `export_hf` a full Hugging Face model in `model/` for `agent-rl eval`. The directory appears
    under its final name only when complete (`.tmp_step_N` then a rename by rank 0). On several
    machines `root` must be a shared filesystem: every rank writes into the same directory.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"
    if dist.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_state(_modules(model, optimizer, critic, critic_optimizer)), checkpoint_id=str(tmp / "dcp"))
    torch.save({"rng": rng_state(), "extra": extra_state or {}}, tmp / f"rank_{dist.rank}.pt")
    if export_hf:
        full = {n: t.cpu() for n, t in iter_full_params(model)} if dist.is_main else None
        if not dist.is_main:
            for _ in iter_full_params(model):  # take part in every gather, keep nothing
                pass
        if dist.is_main:
            # a transformers model under FSDP2 (nn.Module's typing does not know save_pretrained)
            model.save_pretrained(tmp / "model", state_dict=full, safe_serialization=True)  # type: ignore[operator]
    dist.barrier()
    if dist.is_main:
        torch.save(
            {
                "step": step,
                "world_size": dist.world_size,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "sharded": True,
            },
            tmp / "state.pt",
        )
        (tmp / "config.json").write_text(json.dumps(config_dict or {}, indent=1, default=str))
        fsync_tree(tmp)
        publish(tmp, final)
        prune_checkpoints(root, keep_last, keep=final)
    dist.barrier()
    return final


def load_sharded(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    dist: World | None,
    scheduler=None,
    critic: nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG and extra state; returns the extra.

    Same world size: every rank gets back exactly its shards and its own RNG streams. Another
    world size (or `dist=None`, one plain process): DCP reshards the model and optimizer state on
    load (each rank reads the slices it now owns, by parameter name); the step, scheduler and
    data cursor carry over, and rank R takes the RNG and extra state saved by rank R mod the old
    world size, so sampling continues reproducibly but not bit-identically to the old layout.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    meta = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    if not meta.get("sharded"):
        raise ValueError(
            f"{path} is a single-process checkpoint; load it with agent_rl.runtime.checkpoint.load_checkpoint before "
            "sharding the model"
        )
    modules = _modules(model, optimizer, critic, critic_optimizer)
    state = _state(modules)
    with warnings.catch_warnings():  # DCP warns that it loads in one process; that is the point of dist=None
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    _restore(modules, state)
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    rank = dist.rank if dist is not None else 0
    own = torch.load(path / f"rank_{rank % meta['world_size']}.pt", map_location="cpu", weights_only=False)
    set_rng_state(own["rng"])
    return {**own["extra"], "step": own["extra"].get("step", meta["step"]), "saved_world_size": meta["world_size"]}
