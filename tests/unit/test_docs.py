"""The configuration reference and the table of TRL's names are generated and must be current."""
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_current():
    render = runpy.run_path(str(ROOT / "scripts" / "gen_config_docs.py"))["render"]
    assert (ROOT / "docs" / "configuration.md").read_text() == render(), \
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def test_the_table_of_trl_names_is_current():
    script = runpy.run_path(str(ROOT / "scripts" / "gen_config_docs.py"))
    text = (ROOT / "docs" / "from-trl.md").read_text()
    assert script["update_from_trl"](text) == text, \
        "docs/from-trl.md's table is stale: run python scripts/gen_config_docs.py"
    assert "| `learning_rate` | `1e-6` | `train.lr` |" in text
