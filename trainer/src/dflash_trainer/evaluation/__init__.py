"""Evaluation of the drafter during training: held-out figures, the decode walk and their hooks."""
