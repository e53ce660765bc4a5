"""Pure functions of the DFlash method (arXiv 2602.06036): no I/O, no globals."""
