"""The job runner's usage error (bad program path, bad option, output file in the way)."""

from deepinfer.errors import InvalidRequestError


class JobUsageError(InvalidRequestError):
    """The job cannot start as asked; the CLI exits with status 2 and prints the message."""
