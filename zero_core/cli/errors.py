"""The one error type subcommands raise for input they cannot use."""


class UsageError(Exception):
    """Input the command cannot use; `main` shows the message as one line and exits with code 2."""
