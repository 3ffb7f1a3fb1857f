"""Integrations of kvblend into other serving engines (vLLM: :mod:`blend.integrations.vllm`)."""
