"""DFlash drafter trainer."""

import glob as _glob
import warnings as _warnings

__version__ = "0.1.0"

# FLA warns at import, on every command and rank, that Triton has no GPU to run on. On a machine without an
# NVIDIA device that is the expected CPU path (the torch fallbacks run), so the warning is silenced there;
# where a GPU exists it stays, because there it means the kernels will not run.
if not _glob.glob("/dev/nvidia[0-9]*"):
    _warnings.filterwarnings(
        "ignore", message="Triton is not supported on current platform", category=UserWarning
    )
