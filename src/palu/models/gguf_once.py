"""One parse of a GGUF file per load. Loading the embedded SmolLM2 took ~28 s on two cores, ~25 s of
it parsing the same file's metadata seven times (transformers reads it for the config twice, the
tokenizer, the weights; palu's tokenizer rebuild and BOS / EOS checks once more each; ~4 s a
parse, the tokenizer's 49,152 strings read field by field) and building a tensor-name map per
module (397 maps, ~6 s). Inside `parsed_once()` every `gguf.GGUFReader(path)` of the same file
returns the first reader and the name map of an (architecture, layers) pair is built once.

Both are read-only after they are built (transformers and palu read fields and dequantise
tensors into new arrays), so sharing them changes no value loaded: checked by hand on SmolLM2 and
Gemma-3-270M (weights torch.equal, config, vocabulary and ids equal to the seven-parse load);
tests/unit/test_gguf_once.py checks the sharing and its undoing. The patch is
process-wide while the context is open (loading is not meant to run in threads beside it) and
the readers are dropped when it closes (they map the file)."""
from __future__ import annotations

import contextlib
import functools
import os
import threading

_LOCK = threading.Lock()
_depth = 0


@contextlib.contextmanager
def parsed_once():
    global _depth
    import gguf
    with _LOCK:
        _depth += 1
        nested = _depth > 1     # an outer context already shares them
        if not nested:
            original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
            readers: dict = {}

            def reader(path, mode="r"):
                stat = os.stat(path)
                key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, mode)
                if key not in readers:
                    readers[key] = original_reader(path, mode)
                return readers[key]

            gguf.GGUFReader = reader
            gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_map)
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if not nested:
                gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map
                readers.clear()
