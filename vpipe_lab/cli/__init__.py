"""The `vpipe-lab` command line: planning commands in ``main``, commands that start processes in ``jobs``."""

from vpipe_lab.cli.main import main

__all__ = ["main"]
