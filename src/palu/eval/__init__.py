from . import suites  # noqa: F401  (the registry)
from . import needles, qasper, longbench, ruler, ruler_style  # noqa: F401,E402  (each registers its suite: all before any is looked up)
