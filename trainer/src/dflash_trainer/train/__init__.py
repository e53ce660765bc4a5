"""The training loop: the drafter step (trainer.py) and the single-process driver (loop.py)."""
