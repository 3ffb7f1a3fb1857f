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
    """A reuse policy refused.

    Args:
        message: what is wrong, naming the settings (the policy's field names).
        fields: the one-word fields (``ratio``, ``selector``, ``candidates``...) the message names: each
            whole word of it that spells one is that field, so a command line writes its flag there
            (:mod:`blend.cli_messages`; a multi-word name such as ``max_ratio`` is found by its shape).
    """

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields
