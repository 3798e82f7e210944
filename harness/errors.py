"""Errors the CLI turns into one line on stderr and exit code 2 (bad input or a harness failure)."""


class UsageError(Exception):
    """Bad input: the message names what is wrong and where (file, key, variant, character position)."""
