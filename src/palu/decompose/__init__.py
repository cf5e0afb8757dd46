from . import ranks  # noqa: F401  (registers every rank allocator before any is looked up)
