"""The configuration reference is generated from the dataclasses and must be current."""
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_current():
    render = runpy.run_path(str(ROOT / "scripts" / "gen_config_docs.py"))["render"]
    assert (ROOT / "docs" / "configuration.md").read_text() == render(), \
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
