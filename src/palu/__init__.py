"""palu — KV-cache compression with low-rank projection (Palu, ICLR 2025), re-implemented.

Importing palu changes nothing in transformers; `compress` / `load_compressed` install Palu
attention into the model you pass.
"""
from . import calib, recover   # subpackages the README uses as palu.calib.*, palu.recover.*
from .attention.install import install_palu
from .cache.graph_cache import GraphLatentCache
from .cache.latent_cache import LatentCache
from .compress import CompressionResult, calibration_data, compress, fisher_data
from .data.corpora import load_corpus
from .decompose.checkpoint import load_compressed
from .decompose.ranks import allocate
from .eval.perplexity import perplexity
from .eval.runner import evaluate_corpus, evaluate_text
from .graph_decoding import GraphDecoder
from .methods import CacheMethod, build_method
from .models.adapters import geometry_of
from .models.loading import load_model

__all__ = ["CacheMethod", "CompressionResult", "GraphDecoder", "GraphLatentCache", "LatentCache",
           "allocate", "build_method", "calibration_data", "compress", "evaluate_corpus",
           "evaluate_text", "fisher_data", "geometry_of", "install_palu", "load_compressed", "load_corpus", "load_model", "perplexity"]
__version__ = "0.1.0"
