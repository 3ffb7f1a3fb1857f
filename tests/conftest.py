"""Test setup shared by every test module.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
so it is set here, before anything imports the kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVBLEND_HOME", os.path.join(os.path.dirname(__file__), "..", ".kvblend"))
