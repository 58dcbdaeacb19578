"""Errors that mean "bad input": the CLI turns them into one line and exit code 2."""


class TraceError(Exception):
    """A trace, path or argument that tensordiff cannot use. The message is one line for a person."""

    def __init__(self, message: str, path: str | None = None):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)
