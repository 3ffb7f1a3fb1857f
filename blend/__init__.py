"""kvblend: reuse the KV cache of retrieved document chunks wherever they land in a prompt.

Importing the package turns on PyTorch's huge-page allocation for large CPU buffers
(``THP_MEM_ALLOC_ENABLE=1``, see :data:`blend.defaults.TORCH_THP_ENV`) unless the environment already
sets it; set ``THP_MEM_ALLOC_ENABLE=0`` to keep PyTorch's default. It only takes effect when torch has
not allocated anything yet (import kvblend first, as the ``kvblend`` command does). Numbers are
unchanged either way: only where the allocator places buffers.
"""

import os as _os

from blend.defaults import TORCH_THP_ENV as _THP

_os.environ.setdefault(*_THP)
