"""benchmarks/results is a record, one page and one JSON per claim, indexed by its README; nothing links past it."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MAX_FILES = 80
# A name that carries a commit: "_" then 7 to 40 hex digits, ending the name or followed by "_", "." or "/".
HASH_IN_NAME = re.compile(r"_[0-9a-f]{7,40}(?=[_./]|$)")
# A mention of a results file in any text: benchmarks/results/<path>, the path ending at a space or punctuation.
MENTION = re.compile(r"benchmarks/results/([A-Za-z0-9_./-]*[A-Za-z0-9_/-])")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _files():
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def _index_names():
    return set(MARKDOWN_LINK.findall((RESULTS / "README.md").read_text()))


def test_results_hold_at_most_80_files_in_one_folder():
    files = _files()
    assert len(files) <= MAX_FILES, len(files)
    assert [p for p in files if p.parent != RESULTS] == []


def test_no_results_file_is_named_by_a_commit():
    assert [p.name for p in _files() if HASH_IN_NAME.search(p.name)] == []


def test_every_page_and_json_is_in_the_index_and_every_indexed_file_exists():
    names = _index_names()
    on_disk = {p.name for p in _files() if p.suffix in (".md", ".json") and p.name != "README.md"}
    assert sorted(on_disk - names) == [], "not in benchmarks/results/README.md"
    assert sorted(n for n in names if not (RESULTS / n).is_file()) == [], "named in the index, missing"


def test_links_from_readme_docs_and_results_pages_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.glob("*.md"))]
    missing = []
    for page in pages:
        if page == RESULTS / "README.md":
            continue  # checked above, with the records still to come
        for target in MARKDOWN_LINK.findall(page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).resolve().exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert missing == []


def test_every_mention_of_a_results_file_in_the_tree_exists():
    """README, docs, code comments, benchmarks and tests name results files by their path from the root."""
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "benchmarks").glob("*.sh"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "examples").glob("*.py")]
    texts += [p for p in (ROOT / "tokenyard").rglob("*") if p.suffix in (".py", ".cpp", ".cuh", ".h")]
    missing = []
    for path in texts:
        for name in MENTION.findall(path.read_text()):
            if name.rstrip("/") and not (RESULTS / name).exists():
                missing.append(f"{path.relative_to(ROOT)}: benchmarks/results/{name}")
    assert missing == []
