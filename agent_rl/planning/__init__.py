"""Memory planning before launch (`agent-rl plan`) and the preflight step that checks it."""
