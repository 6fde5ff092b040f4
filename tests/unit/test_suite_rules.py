"""The suite's own rules (tests/conftest.py): with GRPO_REQUIRE_EXTRAS, as `make test` sets it, a missing extra
fails its tests instead of skipping them; without it they are skipped."""
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

TESTS = '''
import pytest

def test_a_listed_extra():
    pytest.importorskip("grpo_absent_extra.sub", reason="the absent extra is not installed")

def test_another_package():
    pytest.importorskip("grpo_absent_other")

def test_a_listed_extra_that_imports():
    assert pytest.importorskip("json").dumps(1) == "1"
'''

MODULE_LEVEL = '''
import pytest

pytest.importorskip("grpo_absent_extra", reason="the absent extra is not installed")

def test_never_reached():
    pass
'''


@pytest.fixture
def suite(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_fixtures=TESTS, test_module_level=MODULE_LEVEL)
    monkeypatch.delenv("GRPO_REQUIRE_EXTRAS", raising=False)  # this run's own setting aside
    return pytester


def test_without_the_variable_a_missing_extra_is_skipped(suite):
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(["*the absent extra is not installed*"])


def test_with_the_variable_a_missing_extra_fails(suite, monkeypatch):
    monkeypatch.setenv("GRPO_REQUIRE_EXTRAS", "grpo_absent_extra json")
    wrapped = pytest.importorskip
    # a test that needs it fails; a file that needs it at its top is a collection error (which alone fails a run:
    # this one goes on to run the other file); what is not listed still skips; a listed extra that imports is
    # imported
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "--continue-on-collection-errors")
    result.assert_outcomes(passed=1, failed=1, skipped=1, errors=1)
    result.stdout.fnmatch_lines([
        "*GRPO_REQUIRE_EXTRAS names grpo_absent_extra, but import grpo_absent_extra failed: ModuleNotFoundError*",
        "*GRPO_REQUIRE_EXTRAS names grpo_absent_extra, but import grpo_absent_extra.sub failed: "
        "ModuleNotFoundError: No module named 'grpo_absent_extra'*"])
    assert pytest.importorskip is wrapped  # the run put back the importorskip it found
