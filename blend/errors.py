"""Errors a user can cause. The CLI prints their message on one line and exits non-zero."""


class KVBlendError(Exception):
    """Base class: a clear, user-facing failure (never a bug)."""


class UnknownModelError(KVBlendError):
    pass


class CheckpointError(UnknownModelError):
    """A checkpoint folder whose files cannot be read, or do not hold what its config describes
    (a truncated or zeroed weight file, a tensor missing, a tokenizer file that is not JSON...)."""


class InvalidRequestError(KVBlendError):
    pass


class PromptTooLongError(InvalidRequestError):
    pass


class InvalidPolicyError(KVBlendError):
    pass
