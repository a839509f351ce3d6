"""docs/results.md and benchmarks/results/ agree: every linked file exists, every kept file backs a row (a PNG
through its JSON), no file is named by a commit hash, and every suite name a row gives as its command is a run of the suite."""
import os
import re

from benchmarks.suite import BY_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _doc():
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        return f.read()


def test_every_link_exists_and_every_result_is_cited():
    links = set(re.findall(r"\(\.\./benchmarks/results/([^)]+)\)", _doc()))
    assert links and all(os.path.exists(os.path.join(RESULTS, link)) for link in links), links
    for folder, _, files in os.walk(RESULTS):
        rel = os.path.relpath(folder, RESULTS)
        for name in files:
            plot_of = name.removesuffix(".png") + ".json"  # a plot goes with its JSON
            cited = name in links or plot_of in links or (rel != "." and f"{rel}/" in links)
            assert cited, f"benchmarks/results/{os.path.join(rel, name)} backs no row of docs/results.md"
            assert not re.search(r"(^|_)[0-9a-f]{7,40}(_|\.)", name), name


def test_suite_names_in_the_table_are_runs():
    named = set(re.findall(r"\| `([a-z0-9-]+)` \|", _doc())) | set(re.findall(r"`([a-z0-9-]+)`, `kernels`", _doc()))
    assert named and named <= set(BY_NAME) | {"kernels"}, named - set(BY_NAME)
