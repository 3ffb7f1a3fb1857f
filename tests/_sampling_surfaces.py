"""Each surface's :class:`GenerationConfig` where a request asks for nothing: the Python API's, ``kvblend ask``'s
and ``kvblend chat``'s, and the server's (kept apart so that a test can change ``blend.defaults`` in a fresh
process before anything here reads it)."""

from blend.cli import build_parser
from blend.generation_cli import generation_config_from_args
from blend.sampling import GenerationConfig
from blend.serve.config import ServeConfig
from blend.serve.intake import prepare
from blend.serve.protocol import Endpoint
from blend.serve.schemas import ChatCompletionRequest


def surfaces(engine) -> dict[str, GenerationConfig]:
    """``{"api", "ask", "chat", "server"}`` -> the settings each would decode with (``engine``: the server's)."""
    ask = generation_config_from_args(build_parser("ask").parse_args(["ask", "q", "--doc", "d.txt"]))
    chat = generation_config_from_args(build_parser("chat").parse_args(["chat", "--doc", "d.txt"]))
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    server = prepare(engine, ServeConfig(model=engine.model_name), body, Endpoint.CHAT).config
    return {"api": GenerationConfig(), "ask": ask, "chat": chat, "server": server}
