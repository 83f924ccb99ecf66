"""The multi-turn agent loop: generate, parse the action, call the tool (search), insert the observation.

`AgentLoop` is the entry point of a rollout: the turn logic (`turns.Turns`) run by the driver
`rollout.mode` names, Search-R1's turn-synchronous loop (`sync_loop`) or each trajectory on its
own (`async_loop`). Both drivers give the same trajectories' contract.
"""

from __future__ import annotations

from agent_rl.config import Config
from agent_rl.rollout.async_loop import run_async
from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.chat_tools import ChatFormat, build_format
from agent_rl.rollout.engines import Engine
from agent_rl.rollout.protocol import TagFormat
from agent_rl.rollout.sync_loop import run_sync
from agent_rl.rollout.tools import Tool, build_tools, search_depth
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.rollout.turns import ObservationBuilder, PromptItem, Turns, rollout_metrics
from retriever_server.client import RetrieverClient

__all__ = ["AgentLoop", "ObservationBuilder", "PromptItem", "rollout_metrics"]


class AgentLoop(Turns):
    """Runs batched multi-turn rollouts for a list of prompts. `tools`: what `rollout.tools` names
    (`tools.build_tools`); None is search alone on `client`."""

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        client: RetrieverClient | None,
        budget: TokenBudget,
        topk: int = 3,
        mode: str = "sync",
        max_inflight: int = 0,
        tools: list[Tool] | None = None,
        fmt: TagFormat | ChatFormat | None = None,
    ):
        if mode not in ("sync", "async"):
            raise ValueError(f"rollout mode {mode!r}: use sync or async")
        super().__init__(engine, tokenizer, client, budget, topk, tools, fmt)
        self.mode = mode
        self.max_inflight = max_inflight  # async: most trajectories in flight (0: all of the call's)

    @classmethod
    def from_config(cls, cfg: Config, engine: Engine, tokenizer, client: RetrieverClient | None, budget: TokenBudget):
        """The loop a config describes: `rollout.mode`, `rollout.max_inflight`, `rollout.tools`, `rollout.protocol`."""
        tools = build_tools(cfg.rollout.tools, client, cfg.retriever.topk, search_depth(cfg))
        fmt = build_format(cfg.rollout, tokenizer, tools)
        return cls(
            engine,
            tokenizer,
            client,
            budget,
            cfg.retriever.topk,
            cfg.rollout.mode,
            cfg.rollout.max_inflight,
            tools,
            fmt,
        )

    def run(
        self, items: list[PromptItem], group_size: int = 1, temperature: float = 1.0, top_p: float = 1.0
    ) -> list[Trajectory]:
        """`group_size` trajectories per prompt, by `self.mode`: turn-synchronous or per-trajectory async."""
        if self.mode == "async":
            return run_async(self, items, group_size, temperature, top_p, self.max_inflight)
        return run_sync(self, items, group_size, temperature, top_p)

    def run_sync(
        self, items: list[PromptItem], group_size: int = 1, temperature: float = 1.0, top_p: float = 1.0
    ) -> list[Trajectory]:
        """Search-R1's loop whatever `self.mode` says."""
        return run_sync(self, items, group_size, temperature, top_p)
