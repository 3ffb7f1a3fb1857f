"""``kvblend serve``: an OpenAI-compatible HTTP server over the engine.

Nothing is imported here, so ``kvblend ask --help`` never loads FastAPI.
"""
