from . import suites  # noqa: F401  (registers every long-context suite before any is looked up)
