"""Reports: the trajectory viewer, the evaluation table, the plots."""
