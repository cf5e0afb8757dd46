from . import ranks  # noqa: F401  (the registry and the allocators it defines)
from . import probe, bit_alloc, search  # noqa: F401,E402  (register theirs: every one before any is looked up)
