"""DFlash drafter trainer."""

__version__ = "0.1.0"
