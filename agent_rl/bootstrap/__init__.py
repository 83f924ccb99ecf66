"""What a run builds on first use: the toy world, the model, the QA splits, the index."""
