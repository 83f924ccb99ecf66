"""`python tests/kill_after_chunks.py N agent-rl-args...`: `agent-rl` whose evaluation SIGKILLs its own
process right after writing its N-th chunk of scores (a kill at a known point, for the resume tests)."""

import os
import signal
import sys

import agent_rl.evaluation as evaluation
from agent_rl.cli import main

_limit, _written = int(sys.argv[1]), 0
_write_all = evaluation._write_all


def _write_then_kill(fd: int, data: bytes) -> None:
    global _written
    _write_all(fd, data)
    _written += 1
    if _written >= _limit:
        os.kill(os.getpid(), signal.SIGKILL)


evaluation._write_all = _write_then_kill
sys.argv = ["agent-rl", *sys.argv[2:]]
sys.exit(main())
