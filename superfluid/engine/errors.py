"""The error a request's parameter raises: a leaf, so that every module that checks a
parameter (params.py, cache_keys.py, ...) can raise it without importing the others."""


class ParamError(ValueError):
    """A parameter outside its range; ``param`` names it as OpenAI's error body does."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
