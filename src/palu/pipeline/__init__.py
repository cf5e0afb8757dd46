"""The pipeline layer on top of the library: Hydra entry points (`cli/`), the experiment grid
(`grid.py`), artifact names (`naming.py`), scheduler resources (`jobs.py`), W&B tracking
(`tracking/`), tables and figures (`reporting/`), the config schema (`config.py`).

The library (every other subpackage of `palu`) never imports this one
(tests/unit/test_layering.py); `import palu` loads neither Hydra nor W&B.
"""
