"""The shared fixtures of `agent_fixtures`, registered once for the whole suite.

A fixture imported into a test module is a new fixture of that module, so a session-scoped one
imported into six modules runs six times (the SmolLM2 conversion took ~15 s, the HotpotQA index
~10 s, each time). Registered here they run once per session; test modules use them by name. Under
pytest-xdist (`make test` runs two workers) the expensive ones are built once for all workers
(`agent_fixtures.built_once`).
"""

from agent_fixtures import (  # noqa: F401
    hotpot_index_dir,
    server,
    smollm2_dir,
    tiny_model_dir,
    tokenizer,
    toy_warm_start,
)
