"""The `turboquant-hf` command line: `commands` (what each command does), `parser` (its arguments),
`hub_errors` (a failure of the Hub told from other errors). `main` is the console script's entry point."""

from .commands import main

__all__ = ["main"]
