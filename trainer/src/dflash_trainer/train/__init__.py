"""The training run, one job a module: schedule, setup, target side, drafter side and the one-process loop."""
