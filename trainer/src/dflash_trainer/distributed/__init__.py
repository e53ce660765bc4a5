"""The multi-process pipeline: N target ranks feed M drafter ranks under torchrun (see docs/pipeline.md)."""
