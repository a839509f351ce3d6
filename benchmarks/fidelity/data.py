"""The text of the fidelity benchmark: installed Python packages' sources plus documentation, split by file into
train and a held-out validation set with no near-copy of a validation file in training, one sentencepiece
tokenizer trained on the train side only, and one `.bin/.idx` shard.

    python -m benchmarks.fidelity.data --out .cache/fidelity_data            # every package in site-packages
    python -m benchmarks.fidelity.data --out DIR --packages torch numpy --doc-dir /usr/share/doc

Nobody here wrote the text: it is every `.py` file of the packages installed in this Python's site-packages
(or the ones named) and the README/NEWS/changelog/.txt/.md/.rst files under the documentation folders.

Deduplication and the split, so that validation measures generalisation and not recall:
  1. exact copies (same content after collapsing whitespace) are kept once;
  2. files are grouped (union-find), and a group goes to one side whole: the files of one directory (a model's
     `modular_*.py` and its generated `modeling_*.py`, a module's sibling files); near-copies (MinHash over word
     5-grams, estimated Jaccard >= --near-dup); files whose last two path components agree across sources
     (vendored copies, `packaging/version.py`); and a file with a `Copied from a.b.c` marker with the module
     it names;
  3. groups are taken in the order of a hash of their first path, into validation until --valid-bytes
     (groups larger than --max-group-fraction of that stay in training, so no single package dominates validation).

The shard holds the training documents, then the validation documents; the manifest's `split` (document
counts, for `--split`) makes the trainer's validation range exactly the validation files. Everything is
deterministic for a given set of installed files: the manifest records a `data_id` (hash of the shard and the
tokenizer) that every fidelity run carries, and `fidelity.py report` refuses to mix runs of different data.
A finished folder is reused when its settings match; a build happens in a temporary folder renamed when
complete.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import site
import sys
import sysconfig
import time
import zlib

import numpy as np

from megacoat.data.builders import split_ranges  # noqa: E402
from megacoat.data.indexed_dataset import IndexedDataset  # noqa: E402
from megacoat.data.preprocessing import preprocess  # noqa: E402
from megacoat.data.tokenizer import train_sentencepiece  # noqa: E402

FORMAT = 1
NUM_HASHES, BANDS = 64, 16  # MinHash signature length; LSH bands of 4 rows catch pairs above ~0.5 Jaccard
SHINGLE = 5
DOC_NAMES = re.compile(r"^(readme|news|changelog|changes|history)", re.I)
DOC_SUFFIXES = (".txt", ".md", ".rst")
COPIED_FROM = re.compile(rb"Copied from ([A-Za-z_][\w.]*)")
SKIP_DIRS = {"__pycache__"}


# --- collecting files ---------------------------------------------------------------------------------------
def site_package_dirs() -> list[str]:
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    return sorted({os.path.realpath(d) for d in dirs if os.path.isdir(d)})


def package_sources(names: list[str] | None) -> list[tuple[str, str]]:
    """(name, folder) of each package: those named, or every top-level package folder in site-packages."""
    found: dict[str, str] = {}
    for sp in site_package_dirs():
        for entry in sorted(os.listdir(sp)):
            path = os.path.join(sp, entry)
            if (os.path.isdir(path) and entry.isidentifier() and entry not in found
                    and (names is None or entry in names)):
                found[entry] = path
    if names is not None and set(names) - set(found):
        raise FileNotFoundError(f"--packages: not installed in {site_package_dirs()}: "
                                f"{sorted(set(names) - set(found))}")
    return sorted(found.items())


def walk(root: str, keep) -> list[str]:
    out = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        out += [os.path.join(dirpath, n) for n in sorted(names) if keep(n)]
    return out


def is_doc(name: str) -> bool:
    base = name[:-3] if name.endswith(".gz") else name
    return base.endswith(DOC_SUFFIXES) or bool(DOC_NAMES.match(base))


def read_text(path: str, max_bytes: int) -> str | None:
    """The file's text, or None for what is not prose or code: too small or large, not UTF-8, minified."""
    try:
        raw = gzip.open(path).read(max_bytes + 1) if path.endswith(".gz") else open(path, "rb").read(max_bytes + 1)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None
    lines = text.count("\n") + 1
    if not 64 <= len(raw) <= max_bytes or not text.strip() or len(text) / lines > 200:
        return None
    return text


# --- near-duplicates ------------------------------------------------------------------------------------------
_MIX = np.array([0x9E3779B97F4A7C15 * (i + 1) % 2**64 for i in range(NUM_HASHES)], dtype=np.uint64)


def minhash(text: str) -> np.ndarray | None:
    """NUM_HASHES minima of seeded 64-bit mixes of the word 5-gram hashes; None below one 5-gram."""
    words = re.findall(rb"\w+", text.encode())
    if len(words) < SHINGLE:
        return None
    h = np.fromiter((zlib.crc32(w) for w in words), dtype=np.uint64, count=len(words))
    sh = np.zeros(len(words) - SHINGLE + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(SHINGLE):
            sh = sh * np.uint64(1_000_003) + h[i:len(h) - SHINGLE + 1 + i]
        x = np.unique(sh)[None, :] ^ _MIX[:, None]  # splitmix64 finaliser per seed
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x.min(axis=1)


def _file_features(args: tuple[str, int]):
    path, max_bytes = args
    text = read_text(path, max_bytes)
    if text is None:
        return None
    normal = hashlib.sha256(" ".join(text.split()).encode()).hexdigest()
    copied = sorted({m.decode() for m in COPIED_FROM.findall(text.encode())})
    return len(text.encode()), normal, minhash(text), copied


class UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def group_files(rel: list[str], sigs: list, copied: list[list[str]], near_dup: float) -> tuple[list[int], dict]:
    """A group id per file (see the module docstring, step 2) and how many links each rule made."""
    uf, stats = UnionFind(len(rel)), {"same_directory": 0, "near_duplicate": 0, "same_module_path": 0,
                                      "copied_from": 0}
    first: dict[tuple, int] = {}

    def link(key, i, rule):
        j = first.setdefault(key, i)
        if j != i and uf.find(i) != uf.find(j):
            uf.union(i, j)
            stats[rule] += 1

    module_of = {}
    for i, r in enumerate(rel):
        parts = r.split("/")
        link(("dir", "/".join(parts[:-1])), i, "same_directory")
        if len(parts) >= 2 and parts[-1] != "__init__.py":  # .../pkg/mod.py: pkg/mod.py across sources
            link(("tail", "/".join(parts[-2:])), i, "same_module_path")
        if r.endswith(".py"):  # every dotted suffix: 'transformers.models.bert.modeling_bert', 'bert.modeling_bert'
            dotted = r[:-3].split("/")
            for k in range(len(dotted) - 1):
                module_of.setdefault(".".join(dotted[k:]), i)
    for i, names in enumerate(copied):
        for name in names:
            parts = name.split(".")
            for n in range(len(parts), 1, -1):  # the longest prefix that is a module we have
                j = module_of.get(".".join(parts[:n]))
                if j is not None:
                    link(("copied", j), j, "copied_from")
                    link(("copied", j), i, "copied_from")
                    break
    buckets: dict[tuple, int] = {}
    rows = NUM_HASHES // BANDS
    for i, sig in enumerate(sigs):
        if sig is None:
            continue
        for b in range(BANDS):
            key = (b, sig[b * rows:(b + 1) * rows].tobytes())
            j = buckets.setdefault(key, i)
            if j != i and uf.find(i) != uf.find(j) and float(np.mean(sigs[j] == sig)) >= near_dup:
                uf.union(i, j)
                stats["near_duplicate"] += 1
    return [uf.find(i) for i in range(len(rel))], stats


def choose_validation(rel: list[str], sizes: list[int], groups: list[int], valid_bytes: int,
                      max_group_fraction: float) -> set[int]:
    """Group roots whose files form the validation side (step 3 of the module docstring)."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    order = sorted(members, key=lambda g: hashlib.sha256(rel[min(members[g])].encode()).hexdigest())
    chosen, total = set(), 0
    for g in order:
        size = sum(sizes[i] for i in members[g])
        if size <= valid_bytes * max_group_fraction and total + size <= valid_bytes:
            chosen.add(g)
            total += size
        if total >= 0.99 * valid_bytes:
            break
    return chosen


# --- building ---------------------------------------------------------------------------------------------------
def collect(args) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(sources, absolute paths, paths relative to the folder holding each source: 'torch/nn/linear.py')."""
    sources = []
    if args.packages != ["none"]:
        sources += package_sources(None if args.packages == ["all"] else args.packages)
    sources += [(os.path.basename(os.path.normpath(d)), d) for d in args.source_dir]
    sources += [(f"doc:{d}", d) for d in args.doc_dir if os.path.isdir(d)]
    if not sources:
        raise FileNotFoundError("no sources: name --packages, --source-dir or an existing --doc-dir")
    paths, rel = [], []
    for name, root in sources:
        doc = name.startswith("doc:")
        for p in walk(root, is_doc if doc else (lambda n: n.endswith(".py"))):
            paths.append(p)
            rel.append(os.path.relpath(p, os.path.dirname(os.path.normpath(root))))
    return sources, paths, rel


def build(args, final: str, settings: dict) -> dict:
    t0 = time.perf_counter()
    sources, paths, rel = collect(args)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(args.workers) as pool:
        feats = pool.map(_file_features, [(p, args.max_file_bytes) for p in paths], chunksize=16)
    files_seen, unreadable = len(feats), sum(f is None for f in feats)
    keep, seen, exact = [], set(), 0
    for i, f in enumerate(feats):
        if f is None:
            continue
        if f[1] in seen:
            exact += 1
            continue
        seen.add(f[1])
        keep.append(i)
    paths, rel, feats = [paths[i] for i in keep], [rel[i] for i in keep], [feats[i] for i in keep]
    sizes = [f[0] for f in feats]
    groups, links = group_files(rel, [f[2] for f in feats], [f[3] for f in feats], args.near_dup)
    valid_groups = choose_validation(rel, sizes, groups, int(args.valid_bytes), args.max_group_fraction)
    valid = [i for i, g in enumerate(groups) if g in valid_groups]
    train = [i for i, g in enumerate(groups) if g not in valid_groups]
    if not valid or not train:
        raise ValueError(f"{len(paths)} files in {len(set(groups))} groups give an empty "
                         f"{'validation' if not valid else 'training'} side: adjust --valid-bytes or the sources")
    t1 = time.perf_counter()

    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        manifest = _write(args, tmp, final, settings, sources, paths, rel, sizes, groups, links, train, valid,
                          valid_groups, files_seen, unreadable, exact)
        manifest["seconds"]["dedup_split"] = round(t1 - t0, 1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return manifest


def _write(args, tmp, final, settings, sources, paths, rel, sizes, groups, links, train, valid, valid_groups,
           files_seen, unreadable, exact) -> dict:
    """Tokenizer, shard and file list into `tmp`; returns the manifest (written by the caller)."""
    t1 = time.perf_counter()
    docs = os.path.join(tmp, "documents.jsonl")
    with open(docs, "w") as f:  # training documents first, then validation: the shard's order
        for i in train + valid:
            f.write(json.dumps({"text": read_text(paths[i], args.max_file_bytes)}) + "\n")
    tokenizer = train_sentencepiece((read_text(paths[i], args.max_file_bytes) for i in train),
                                    os.path.join(tmp, "tokenizer.model"), args.vocab_size,
                                    max_sentences=args.tokenizer_sentences, num_threads=args.workers)
    t2 = time.perf_counter()
    result = preprocess([docs], os.path.join(tmp, "text"), tokenizer, workers=args.workers, progress=False)
    os.remove(docs)
    if result.num_documents != len(train) + len(valid):
        raise ValueError(f"the shard holds {result.num_documents} documents, expected {len(train) + len(valid)}")
    split = f"{len(train)},{len(valid)},0"
    ranges = split_ranges(result.num_documents, split)
    assert ranges[0] == (0, len(train)) and ranges[1] == (len(train), result.num_documents), ranges
    lengths = IndexedDataset(os.path.join(tmp, "text")).sequence_lengths
    tokens = [int(lengths[:len(train)].sum()), int(lengths[len(train):].sum())]
    if tokens[1] < args.min_valid_tokens:
        raise ValueError(f"the validation side holds {tokens[1]:,} tokens, fewer than --min-valid-tokens "
                         f"{int(args.min_valid_tokens):,}: raise --valid-bytes")
    with open(os.path.join(tmp, "files.tsv"), "w") as f:
        f.write("side\tgroup\tbytes\tpath\n")
        for side, idx in (("train", train), ("valid", valid)):
            f.writelines(f"{side}\t{groups[i]}\t{sizes[i]}\t{rel[i]}\n" for i in idx)
    digest = hashlib.sha256()
    for name in ("text.bin", "text.idx", "tokenizer.model"):
        with open(os.path.join(tmp, name), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    manifest = {
        "format": FORMAT, "settings": settings, "data_id": digest.hexdigest()[:16],
        "data_prefix": os.path.join(final, "text"), "tokenizer_model": os.path.join(final, "tokenizer.model"),
        "vocab_size": args.vocab_size, "split": split,
        "train": {"documents": len(train), "bytes": sum(sizes[i] for i in train), "tokens": tokens[0]},
        "valid": {"documents": len(valid), "bytes": sum(sizes[i] for i in valid), "tokens": tokens[1],
                  "groups": len(valid_groups)},
        "files_seen": files_seen, "files_skipped": unreadable, "exact_duplicates_dropped": exact,
        "groups": len(set(groups)), "group_links": links,
        "sources": [{"name": n, "path": p} for n, p in sources],
        "python": sys.version.split()[0], "seconds": {"tokenizer": round(t2 - t1, 1),
                                                       "preprocess": round(result.seconds, 1)},
    }
    return manifest


def prepare(args) -> dict:
    """The manifest of a matching finished folder, or of a fresh build."""
    settings = {k: getattr(args, k) for k in ("packages", "source_dir", "doc_dir", "vocab_size", "valid_bytes",
                                              "near_dup", "max_file_bytes", "tokenizer_sentences",
                                              "max_group_fraction")}
    final = os.path.abspath(args.out)
    path = os.path.join(final, "manifest.json")
    if os.path.isfile(path):
        with open(path) as f:
            manifest = json.load(f)
        if manifest.get("format") == FORMAT and manifest.get("settings") == settings:
            print(f"reusing {final} (data_id {manifest['data_id']})")
            return manifest
    os.makedirs(os.path.dirname(final), exist_ok=True)
    return build(args, final, settings)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the shard, the tokenizer and manifest.json")
    p.add_argument("--packages", nargs="+", default=["all"],
                   help="site-packages folders to read ('all': every one; 'none': only --source-dir)")
    p.add_argument("--source-dir", nargs="*", default=[], help="more folders of .py files")
    p.add_argument("--doc-dir", nargs="*", default=["/usr/share/doc"], help="documentation folders (if present)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--valid-bytes", type=float, default=1e7, help="size of the validation side (text bytes)")
    p.add_argument("--min-valid-tokens", type=float, default=2e6)
    p.add_argument("--max-group-fraction", type=float, default=0.05,
                   help="a group larger than this fraction of --valid-bytes stays in training")
    p.add_argument("--near-dup", type=float, default=0.5, help="estimated Jaccard that makes two files one group")
    p.add_argument("--max-file-bytes", type=int, default=1_000_000, help="larger files are skipped")
    p.add_argument("--tokenizer-sentences", type=int, default=150_000)
    p.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 14))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("vocab_size", "valid_bytes", "workers", "max_file_bytes", "tokenizer_sentences"):
        if getattr(args, flag) <= 0:
            print(f"error: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    for flag in ("near_dup", "max_group_fraction"):
        if not 0 < getattr(args, flag) <= 1:
            print(f"error: --{flag.replace('_', '-')} must be in (0, 1]", file=sys.stderr)
            return 2
    try:
        m = prepare(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"data_id {m['data_id']}: train {m['train']['documents']:,} files, {m['train']['tokens']:,} tokens; "
          f"valid {m['valid']['documents']:,} files ({m['valid']['groups']} groups), {m['valid']['tokens']:,} "
          f"tokens; {m['exact_duplicates_dropped']} exact duplicates dropped; links {m['group_links']}")
    print(f"--data-path {m['data_prefix']} --split {m['split']} --tokenizer-model {m['tokenizer_model']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
