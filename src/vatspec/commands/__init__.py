"""Subcommands whose logic lives elsewhere (each is a thin argparse front)."""
