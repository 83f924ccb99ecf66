"""Per-trajectory asynchronous rollout: each trajectory runs its own turn loop as an asyncio task.

The turn-synchronous loop (Search-R1's, `sync_loop.run_sync`) generates a turn for every active
trajectory, waits for the slowest row, then runs one batched search while the engine idles. Here
every trajectory advances on its own (generate -> parse -> search -> observe), so one
trajectory's search overlaps other trajectories' generation, and a straggler holds up nobody.

- Generation: `GenerationBatcher` gives the engine, one call at a time, every request that is
  waiting (up to the engine's `batch_size`; vLLM's `LLM.generate` takes them all); requests that
  arrive during a call form the next one. A row that arrives mid-call waits for it to end, and a
  finished row waits for the call's longest: that wait is the cost of driving the engine through
  its public batch API (turn batching inside the engine, trajectories async around it).
- Tools: a `ToolBatcher` per tool sends every call that is waiting as one batch call (search: one
  `/retrieve` request, the client splitting over-limit batches), at most four in flight, so
  concurrent trajectories still reach the server as few HTTP requests. Retries, timeouts and the
  error observation are the client's and the loop's, as in the synchronous loop.
- Budgets, the forced final turn, the loss mask and the corrective message are the same code as
  the synchronous loop (`turns.Turns.take_turn`, `turns.Turns.observe`).
- Determinism: each trajectory's turns draw with their own seeds, derived from one draw of the
  engine's generator per `run` (which checkpoints save), so the result does not depend on
  completion order or on what else shared a batch; `--resume` stays exact.
- `rollout.max_inflight` bounds the trajectories in flight (0: all of the call's); nothing else
  queues without bound (at most one pending request per in-flight trajectory).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from agent_rl.rollout.engines import Generation
from agent_rl.rollout.tools import SearchTool, Tool, ToolOutput, call_batch_async
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.rollout.turns import PromptItem, Turns

_SEED_MOD = 2**31 - 1


def turn_seed(base: int, index: int, turn: int) -> int:
    """The sampling seed of one trajectory's turn: a fixed function of the run's base seed."""
    return (base * 1_000_003 + index * 10_007 + turn * 101 + 1) % _SEED_MOD


class _Batcher:
    """Single requests gathered for one worker task: the first request starts `_drain`, which
    runs while any wait; each request is answered through its own future."""

    def __init__(self) -> None:
        self.pending: list[tuple] = []  # (*request, future)
        self.busy = False
        self._task: asyncio.Task | None = None  # held: the event loop keeps only a weak reference to tasks

    async def _submit(self, *request):
        future = asyncio.get_running_loop().create_future()
        self.pending.append((*request, future))
        if not self.busy:
            self.busy = True
            self._task = asyncio.get_running_loop().create_task(self._run())
        return await future

    async def _run(self) -> None:
        try:
            await self._drain()
        finally:
            self.busy = False

    async def _drain(self) -> None:
        raise NotImplementedError


class GenerationBatcher(_Batcher):
    """Turns single generation requests into engine calls over everything that is waiting."""

    def __init__(self, engine, temperature: float, top_p: float, max_batch: int, thread: ThreadPoolExecutor):
        super().__init__()
        self.engine, self.temperature, self.top_p, self.max_batch = engine, temperature, top_p, max(1, max_batch)
        self.thread = thread  # the rollout's engine thread (see `_run_all`)
        self.calls = 0

    async def generate(self, prompt: list[int], max_new: int, seed: int) -> Generation:
        return await self._submit(prompt, max_new, seed)

    async def _drain(self) -> None:
        while self.pending:
            await asyncio.sleep(0)  # let every task that is ready queue its request first
            batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch :]
            try:
                gens = await asyncio.get_running_loop().run_in_executor(
                    self.thread,
                    self.engine.generate,
                    [b[0] for b in batch],
                    [b[1] for b in batch],
                    self.temperature,
                    self.top_p,
                    [b[2] for b in batch],
                )
            except BaseException as err:  # the engine failed: every waiting trajectory sees it
                for *_, future in batch + self.pending:
                    if not future.done():
                        future.set_exception(err)
                self.pending = []
                raise
            self.calls += 1
            for (*_, future), g in zip(batch, gens):
                future.set_result(g)


class ToolBatcher(_Batcher):
    """Turns single calls of one tool into batch calls over every call that is waiting (search:
    one `/retrieve` request for all the waiting queries).

    Up to `max_requests` batches are in flight at once (the retriever client's pool holds 8
    connections, and the server batches across requests); calls that arrive while all are out wait
    and go together in the next one. One batch at a time would make a call that just missed a batch
    wait for that whole answer before its own is sent: up to twice the tool's latency.
    """

    def __init__(self, tool: Tool, max_requests: int = 4):
        super().__init__()
        self.tool = tool
        self.slots = asyncio.Semaphore(max(1, max_requests))
        self.sending: set[asyncio.Task] = set()
        self.requests = 0

    async def call(self, text: str) -> tuple[ToolOutput | None, str | None, float]:
        """(output or None, error or None, milliseconds of the batch that carried it)."""
        return await self._submit(text)

    async def _drain(self) -> None:
        while self.pending:
            await asyncio.sleep(0)  # let every task that is ready queue its call first
            await self.slots.acquire()
            batch, self.pending = self.pending, []
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)

    async def _send(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        try:
            try:
                outputs, error, ms = await call_batch_async(self.tool, [x for x, _ in batch])
            except Exception as err:  # any other fault: every call of the batch raises it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(err)
                return
            self.requests += 1
            for i, (_, future) in enumerate(batch):
                if not future.done():
                    future.set_result((None if outputs is None else outputs[i], error, ms))
        finally:
            self.slots.release()


class SearchBatcher(ToolBatcher):
    """`ToolBatcher` over Search-R1's search on `client`."""

    def __init__(self, client, topk: int, max_requests: int = 4):
        super().__init__(SearchTool(client, topk), max_requests)

    async def search(self, query: str) -> tuple[ToolOutput | None, str | None, float]:
        return await self.call(query)


async def _run_one(
    loop: Turns,
    t: Trajectory,
    index: int,
    base: int,
    gen: GenerationBatcher,
    tools: dict[str, ToolBatcher],
    slots: asyncio.Semaphore,
) -> None:
    async with slots:
        turn = 0
        while not t.done:
            allowance = loop.budget.turn_allowance(t.total_tokens)
            if allowance <= 0:
                loop.end(t, "budget_total")
                break
            final = loop.must_answer(t, turn)
            g = await gen.generate(t.prompt_ids + t.response_ids, allowance, turn_seed(base, index, turn))
            call = loop.take_turn(t, g, final)
            if call is not None:
                output, error, ms = await tools[call[0].name].call(call[1])
                loop.count_calls(call[0], 1, error is not None)
                loop.observe(t, output, error, ms)
            turn += 1


async def _run_all(
    loop: Turns, trajs: list[Trajectory], base: int, temperature: float, top_p: float, max_inflight: int
) -> tuple[int, dict[str, int]]:
    # All engine work in one thread of the rollout's own: spread over asyncio's default pool, each
    # pool thread took its own glibc malloc arena (a higher peak RSS than sync on vLLM).
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-rl-engine")
    gen = GenerationBatcher(loop.engine, temperature, top_p, loop.engine.batch_size or max(1, len(trajs)), thread)
    tools = {name: ToolBatcher(tool) for name, tool in loop.tools.items()}
    slots = asyncio.Semaphore(max_inflight or max(1, len(trajs)))
    tasks = [asyncio.create_task(_run_one(loop, t, i, base, gen, tools, slots)) for i, t in enumerate(trajs)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        thread.shutdown(wait=False)
    return gen.calls, {name: b.requests for name, b in tools.items()}


def run_async(
    loop: Turns, items: list[PromptItem], group_size: int, temperature: float, top_p: float, max_inflight: int = 0
) -> list[Trajectory]:
    """`AgentLoop.run` in `rollout.mode=async`: the same trajectories' contract, each trajectory
    advancing on its own; at most `max_inflight` of them at once (0: all)."""
    trajs = loop.new_trajectories(items, group_size)
    base = int(torch.randint(0, _SEED_MOD, (1,), generator=loop.engine.generator).item())
    calls, requests = asyncio.run(_run_all(loop, trajs, base, temperature, top_p, max_inflight))
    loop.counters["rollout/engine_calls"] += calls
    for name, n in requests.items():
        loop.counters[f"rollout/{name}_requests"] += n  # batch calls (search: /retrieve requests)
    loop.finish(trajs)
    return trajs
