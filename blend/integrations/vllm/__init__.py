"""kvblend inside vLLM: a v1 KV connector (issue 17).

    kv_transfer_config={"kv_connector": "KVBlendConnector",
                        "kv_connector_module_path": "blend.integrations.vllm", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"store": "redis://host:6379/0"}}

``KVBlendConnector`` needs vLLM and is imported on first access, so the pure
parts (:mod:`~blend.integrations.vllm.plan`, :mod:`~blend.integrations.vllm.layout`)
load and test without it. :func:`~blend.integrations.vllm.plan.blend_request`
builds the ``kv_transfer_params`` that opt a request into blending.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVBlendConnector", "blend_request", "prompt_spans"]


def __getattr__(name: str) -> Any:
    if name == "KVBlendConnector":
        from blend.integrations.vllm.connector import KVBlendConnector

        return KVBlendConnector
    if name == "blend_request":
        from blend.integrations.vllm.plan import blend_request

        return blend_request
    if name == "prompt_spans":
        from blend.integrations.vllm.plan import prompt_spans

        return prompt_spans
    raise AttributeError(name)
