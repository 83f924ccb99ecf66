"""`python -m agent_rl SUBCOMMAND ...`: the `agent-rl` console script as a module, for launchers
that take a module (`torchrun --nproc-per-node N -m agent_rl train CONFIG`)."""

import sys

from agent_rl.cli import main

sys.exit(main())
