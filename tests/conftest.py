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

# The files that take longest first (measured with `pytest --durations`), in that order, then the others as
# collected: with `make test`'s `--dist loadfile --no-loadscope-reorder` the two workers take the long files
# first and the short ones fill in at the end, instead of one worker finishing a long file alone.
LONGEST_FIRST = [
    "test_train.py",
    "test_memory_safety.py",
    "test_eval.py",
    "test_real_model_learns.py",
    "test_vllm_engine.py",
    "test_view.py",
    "test_encoders.py",
    "test_gpu_path.py",
    "test_distributed.py",
    "test_paged_engine.py",
    "test_gpu_session.py",
]


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
