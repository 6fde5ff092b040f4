"""The configuration reference and the table of TRL's names are generated and must be current."""
import re
import runpy
from pathlib import Path

import pytest

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


def test_no_doc_and_no_help_cites_a_file_users_lack():
    """SPEC.md is not shipped: the docs, the README, --help and the load warnings point to docs/objective.md."""
    from grpo.config import help_of, options
    from grpo.validate import registry_names

    spec = re.compile(r"\bSPEC\b")
    cited = [f"{p.relative_to(ROOT)}:{i}" for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for i, line in enumerate(p.read_text().splitlines(), 1) if spec.search(line)]
    assert cited == []
    names = registry_names()
    assert [key for key, _, f in options() if spec.search(help_of(f, names))] == []
    from grpo.config import load_config
    with pytest.warns(UserWarning) as caught:  # the load warning of truncated sampling names the page, not SPEC
        load_config(None, ["rollout.top_p=0.9", "algo.num_iterations=2"])
    messages = [str(w.message) for w in caught]
    assert any("docs/objective.md, Top-p / top-k sampling and the ratio" in m for m in messages)
    assert not any(spec.search(m) for m in messages)


def test_the_objective_page_has_the_sections_help_strings_name():
    from grpo.config import help_of, options

    headings = {line.lstrip("#").strip() for line in (ROOT / "docs" / "objective.md").read_text().splitlines()
                if line.startswith("## ")}
    named = {m for _, _, f in options() for m in re.findall(r"docs/objective\.md, ([^);]+)", help_of(f))}
    assert named and all(any(h.startswith(n) for h in headings) for n in named), (named, headings)
