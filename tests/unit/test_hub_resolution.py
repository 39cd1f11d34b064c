"""Hub ids resolved from a local Hugging Face cache laid out as huggingface_hub lays it out; never downloaded."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from lookahead_serve.engine.loader import gguf_source, hub_id, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Put the files of folder ``source`` in ``cache`` as ``hf download`` does: blobs/<sha256>,
    snapshots/<commit>/<name> -> ../../blobs/<sha256>, refs/<ref> = commit. Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache that huggingface_hub uses (its constants are read at import, so patched)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def folder(tmp_path):
    """A stand-in Hugging Face model folder (resolution reads only file names)."""
    path = tmp_path / "src"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"weights")
    return path


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("org/name", ("org/name", None)),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct", None)),
        ("org/name@v1.0", ("org/name", "v1.0")),
        ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
        ("name", None),  # a bare name is a (missing) local path
        ("./org/name", None),
        ("/abs/org/name", None),
        ("~/org/name", None),
        ("a/b/c", None),
        ("org/name.gguf/", None),
    ],
)
def test_what_reads_as_a_hub_id(model, expected):
    assert hub_id(model) == expected


def test_an_existing_local_path_wins_over_a_hub_id(tmp_path, monkeypatch, folder):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    shutil.copytree(folder, tmp_path / "org" / "name")
    assert hub_id("org/name") is None
    assert resolve_model("org/name") == Path("org/name")


def test_a_cached_hub_id_resolves_to_its_snapshot(hub_cache, folder):
    snapshot = cache_model(hub_cache, "org/name", folder)
    assert resolve_model("org/name") == snapshot
    assert gguf_source("org/name") is None


def test_a_revision_resolves_through_its_ref(hub_cache, folder):
    other = "f" * 40
    cache_model(hub_cache, "org/name", folder)
    tagged = cache_model(hub_cache, "org/name", folder, commit=other, ref="v1")
    assert resolve_model("org/name@v1") == tagged
    assert resolve_model(f"org/name@{other}") == tagged


def test_a_cached_gguf_repo_is_found_as_gguf(hub_cache, tmp_path):
    src = tmp_path / "gguf"
    src.mkdir()
    (src / "model.Q4_0.gguf").write_bytes(b"GGUF")
    snapshot = cache_model(hub_cache, "org/name-GGUF", src)
    assert gguf_source("org/name-GGUF") == snapshot / "model.Q4_0.gguf"


@pytest.mark.parametrize("model", ["org/absent", "org/name@v9"])
def test_an_absent_hub_id_is_a_clear_error_naming_it(hub_cache, folder, model):
    cache_model(hub_cache, "org/name", folder)
    with pytest.raises(ValueError) as e:
        resolve_model(model)
    text = str(e.value)
    assert repr(model) in text and "not a local path" in text and str(hub_cache) in text
    assert f"hf download {model.split('@')[0]}" in text and "never downloaded" in text
