"""Target loading, the DFlash drafter and tiny test targets."""
