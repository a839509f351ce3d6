"""benchmarks/fidelity/data.py: near-duplicate detection, the grouping rules, and a split by file whose groups
never straddle train and validation."""
import importlib
import json
import os

import numpy as np


fd = importlib.import_module("benchmarks.fidelity.data")
WORDS = [f"word{i}" for i in range(400)]


def test_minhash_estimates_jaccard():
    base = " ".join(WORDS)
    one_change = " ".join(WORDS[:200] + ["changed"] + WORDS[201:])  # 5 of 396 5-grams differ
    other = " ".join(reversed(WORDS))
    a, b, c = fd.minhash(base), fd.minhash(one_change), fd.minhash(other)
    assert np.mean(a == b) > 0.8 and np.mean(a == c) < 0.1
    assert fd.minhash("too short") is None
    assert np.array_equal(a, fd.minhash(base))  # deterministic (no per-process hash seed)


def test_grouping_rules():
    rel = ["pkg/models/bert/modeling_bert.py", "pkg/models/roberta/modeling_roberta.py",
           "pkg/models/roberta/configuration_roberta.py", "a/_vendor/packaging/version.py",
           "packaging/version.py", "other/alone.py", "other2/near.py", "other3/near_copy.py"]
    text = " ".join(WORDS)
    sigs = [None] * 6 + [fd.minhash(text), fd.minhash(text + " extra")]
    copied = [[], ["transformers.models.bert.modeling_bert.BertSelfOutput"], [], [], [], [], [], []]
    rel[0] = "transformers/models/bert/modeling_bert.py"
    groups, links = fd.group_files(rel, sigs, copied, near_dup=0.5)
    assert groups[1] == groups[2]                     # same directory
    assert groups[0] == groups[1]                     # "Copied from" the bert module
    assert groups[3] == groups[4]                     # the same module path in two sources (a vendored copy)
    assert groups[6] == groups[7]                     # near-copies
    assert len({groups[0], groups[3], groups[5], groups[6]}) == 4
    assert links == {"same_directory": 1, "near_duplicate": 1, "same_module_path": 1, "copied_from": 1}


def test_data_split_is_by_file_and_fixed(tiny_data):
    with open(os.path.join(tiny_data, "manifest.json")) as f:
        m = json.load(f)
    n_train, n_valid, n_test = map(int, m["split"].split(","))
    assert (n_train, n_valid, n_test) == (m["train"]["documents"], m["valid"]["documents"], 0)
    assert n_valid >= 1 and m["valid"]["tokens"] >= 300
    with open(os.path.join(tiny_data, "files.tsv")) as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    assert [side for side, *_ in rows].count("valid") == n_valid
    groups = {}
    for side, group, _, _ in rows:  # a group lies on one side only
        groups.setdefault(group, set()).add(side)
    assert all(len(s) == 1 for s in groups.values())
