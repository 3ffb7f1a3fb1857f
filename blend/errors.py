"""Errors a user can cause. The CLI prints their message on one line and exits non-zero."""


class KVBlendError(Exception):
    """Base class: a clear, user-facing failure (never a bug)."""


class UnknownModelError(KVBlendError):
    pass


class InvalidRequestError(KVBlendError):
    pass


class PromptTooLongError(InvalidRequestError):
    pass


class InvalidPolicyError(KVBlendError):
    pass
