"""A fast subset of Celery's own integration tests (``compat/celery_suite.py``), run with
Celery as the client against a workhorse worker: the workflows whose behaviour workhorse
had to learn (chains inside groups and chords, nested headers, chord failures and their
errbacks, retry arguments). The whole suite against both workers is run by hand
(docs/celery.md, "Celery's own integration tests"); this keeps the subset from
regressing. Tier 3: Redis, and the celery sdist from the package index (downloaded once
into compat/.suite)."""
from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .conftest import require_service

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parent.parent
SUBSET = [
    "test_class_based_task_retried",
    "test_retry_switches_from_kwargs_to_args",
    "test_mutable_errback_with_stored_arguments",
    "test_chain_inside_group_receives_arguments",
    "test_header_failure_fails_the_chords_after_it",
    "test_header_failure_fails_the_chords_after_a_group_body",
    "test_chain_of_two_groups_as_tuple_holds_each_task_once",
    "test_nested_chord_group_chain_group_tail",
    "test_chain_chord_chain_chord",
    "test_nested_group_chain",
    "test_errbacks_of_chord_in_group_body_run_on_header_failure",
    "test_link_error_option_with_link_error_of_group_body",
    "test_mutable_errback_called_by_chord_from_chain",
]


def test_a_subset_of_celerys_integration_suite_passes_against_workhorse():
    require_service("Redis", 6379)
    pytest.importorskip("celery")
    workdir = ROOT / "compat" / ".suite"
    run = subprocess.run(
        [sys.executable, str(ROOT / "compat" / "celery_suite.py"), "--only", "workhorse",
         "--workdir", str(workdir), "--databases", "5", "6", "5", "6", "--timeout", "60",
         "--report-name", "subset", "-k", " or ".join(SUBSET)],
        capture_output=True, text=True, timeout=840)
    report = workdir / "workhorse-subset.xml"
    assert report.exists(), run.stdout + run.stderr
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        kinds = {child.tag for child in case}
        outcomes[case.get("name")] = ("failed" if kinds & {"failure", "error"} else
                                      "skipped" if "skipped" in kinds else "passed")
    selected = {name.split("[")[0] for name in outcomes}
    # -k matches substrings, so a few more may run; none of these may be missing.
    assert set(SUBSET) <= selected, f"the suite's names changed: {set(SUBSET) - selected}"
    failed = sorted(name for name, outcome in outcomes.items() if outcome != "passed")
    assert not failed, f"{failed}\n{(workdir / 'workhorse-subset-pytest.log').read_text()[-4000:]}"
