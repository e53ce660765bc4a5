"""The training run (run.py): the one path of every topology, a single process being the 1:1 case."""
