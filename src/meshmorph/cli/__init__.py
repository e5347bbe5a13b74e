"""The console script ``meshmorph``: one module per subcommand (or pair of close subcommands),
each with a ``register(subparsers)`` function that ``app.py`` wires together."""

from meshmorph.cli.app import main

__all__ = ["main"]
