"""`kimi-vision`: one module per command (`main.py` holds the table of commands and their help)."""

from service.cli.main import main

__all__ = ["main"]
