"""Every reference in the repository can be followed inside the repository.

Comments, docstrings, configs and scripts name files (`coordination/runner.py`,
`configs/demo.yaml`, `README.md`) and cite the design doc (`docs/design.md §5 rule 7`). A
reference to a file the repository does not have (a moved module, a document that lives only on
someone's machine) leaves the next engineer with nothing to read, so these tests scan every
tracked text file and check that:

- every repository path it names exists;
- nothing cites a document kept outside the repository;
- every citation `docs/design.md §N` names a section of docs/design.md; one of the form
  `docs/design.md §5 rule M` names one of its protocol rules, and `docs/design.md §6 phase P`
  a phase of the phase table.

The fixtures of the last test are assembled at run time (and `\\u00a7` stands for the section
sign) so that this file does not trip its own scan.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from coordination.phases import BY_NUMBER

ROOT = Path(__file__).resolve().parent.parent
DESIGN = "docs/design.md"
SECTION = "\u00a7"
SCANNED_SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".md", ".ini", ".txt", ".toml", ".cfg"}
SCANNED_FOLDERS_WITHOUT_SUFFIX = ("scripts/", ".ci/")  # shell scripts without an extension

# Documents of the project's early sessions that were never part of the repository.
OUTSIDE = [re.compile(p) for p in (
    r"\bDESIGN" + r"\s*" + SECTION, r"\bDESIGN" + r"\.md", r"\bSTYLE" + r"\s+item", r"\bSTYLE" + r"\.md",
    r"FIELD" + r"-NOTES", r"\.\./" + r"shared\b", r"/work/" + r"shared\b")]

# A bare document name at the top of the repository: README.md, requirements-gpu.txt.
_TOP_FILE = re.compile(r"(?<![\w./-])([A-Z][A-Z_-]*\.md|requirements[\w-]*\.txt)\b")
_CITATION = re.compile(re.escape(DESIGN) + r"\s*" + SECTION)
_SECTION_REF = re.compile(SECTION + r"\s*(\d+(?:\.\d+)*)(?:\s+(rules?|phases?)\s+(\d+(?:\s*(?:-|,|and)\s*\d+)*))?")
_NUMBER_LIST_ITEM = re.compile(r"(\d+)(?:\s*-\s*(\d+))?")


def repository_files() -> list[str]:
    """Tracked files (`git ls-files`); in a copy without git, every file outside hidden and
    generated folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return sorted(f for f in out.decode().split("\0") if f)
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("__pycache__", "demo-run", "runs")]
            files += [str((Path(dirpath) / n).relative_to(ROOT)) for n in filenames]
        return sorted(files)


def scanned_texts() -> dict[str, str]:
    texts = {}
    for rel in repository_files():
        if Path(rel).suffix not in SCANNED_SUFFIXES and not rel.startswith(SCANNED_FOLDERS_WITHOUT_SUFFIX):
            continue
        try:
            texts[rel] = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # binary, or deleted in the working tree but still tracked
    return texts


def top_level_folders(files: list[str]) -> list[str]:
    return sorted({f.split("/", 1)[0] for f in files if "/" in f})


def path_pattern(folders: list[str]) -> re.Pattern:
    """`coordination/runner.py`, `configs/`, `.ci/run`: a path that starts at a top-level folder of
    the repository (not inside a longer path such as `<log-path>/rollouts/train/...`)."""
    return re.compile(r"(?<![\w./<>{}$-])((?:%s)/[\w./*-]*)" % "|".join(re.escape(f) for f in folders))


def dangling_paths(text: str, pattern: re.Pattern, root: Path = ROOT) -> list[str]:
    """Repository paths named in `text` that do not exist under `root`.

    Only names that look like files (the last part has an extension), folders (trailing `/`) or
    globs count: `rollout/update` in "a rollout/update pair" is prose, not a path."""
    missing = []
    for m in pattern.finditer(text):
        ref = m.group(1).rstrip(".,;:")
        last = ref.rstrip("/").rsplit("/", 1)[-1]
        if not (ref.endswith("/") or "." in last or "*" in ref):
            continue
        found = any(root.glob(ref)) if "*" in ref else (root / ref).exists()
        if not found:
            missing.append(ref)
    for m in _TOP_FILE.finditer(text):
        if not (root / m.group(1)).exists():
            missing.append(m.group(1))
    return missing


def outside_citations(text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for p in OUTSIDE for m in p.finditer(text)]


def design_outline(design: str) -> tuple[set[str], set[int]]:
    """(section numbers such as "5" and "10.3", rule numbers of section 5) of the design doc."""
    sections = set(re.findall(r"^## (\d+)\. ", design, flags=re.M))
    sections |= set(re.findall(r"^### (\d+\.\d+) ", design, flags=re.M))
    body = re.search(r"^## 5\. .*?(?=^## \d+\. |\Z)", design, flags=re.M | re.S)
    rules = {int(n) for n in re.findall(r"^(\d+)\. \*\*", body.group(0), flags=re.M)} if body else set()
    return sections, rules


def _numbers(listed: str) -> list[int]:
    out = []
    for m in _NUMBER_LIST_ITEM.finditer(listed):
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        out += list(range(lo, hi + 1))
    return out


def bad_design_citations(text: str, sections: set[str], rules: set[int]) -> list[str]:
    """Section signs that do not follow a docs/design.md citation, and cited sections, rules of
    section 5 or phases of section 6 that do not exist."""
    problems = []
    starts = [m.start() for m in _CITATION.finditer(text)]
    for m in _SECTION_REF.finditer(text):
        where = f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        # The sign must belong to a citation of the design doc that began shortly before
        # ("docs/design.md §4, §5 rule 10"), not to some other document's numbering.
        if not any(0 <= m.start() - s <= 80 for s in starts):
            problems.append(f"{where} does not cite {DESIGN}")
            continue
        section, kind, listed = m.group(1), m.group(2), m.group(3)
        if section not in sections:
            problems.append(f"{where}: {DESIGN} has no section {section}")
        elif kind and kind.startswith("rule"):
            if section != "5":
                problems.append(f"{where}: protocol rules are in section 5")
            problems += [f"{where}: section 5 has no rule {n}" for n in _numbers(listed) if n not in rules]
        elif kind and kind.startswith("phase"):
            if section != "6":
                problems.append(f"{where}: the phase table is section 6")
            problems += [f"{where}: there is no phase {n}" for n in _numbers(listed) if n not in BY_NUMBER]
    return problems


def _design() -> str:
    return (ROOT / DESIGN).read_text(encoding="utf-8")


def test_every_repository_path_named_in_comments_configs_and_scripts_exists():
    files = repository_files()
    pattern = path_pattern(top_level_folders(files))
    missing = {rel: refs for rel, text in scanned_texts().items() if (refs := dangling_paths(text, pattern))}
    assert missing == {}, f"references to files the repository does not have: {missing}"


def test_nothing_cites_a_document_outside_the_repository():
    found = {rel: hits for rel, text in scanned_texts().items() if (hits := outside_citations(text))}
    assert found == {}, (f"citations of documents outside the repository (cite {DESIGN} or README.md, "
                         f"or state the reason in the comment): {found}")


def test_every_design_citation_names_a_section_rule_and_phase_that_exist():
    sections, rules = design_outline(_design())
    # The numbering that code comments have cited from the start stays stable.
    assert {str(n) for n in range(1, 9)} <= sections and rules == set(range(1, 12)), (sections, rules)
    texts = {rel: text for rel, text in scanned_texts().items() if rel != DESIGN}
    cited = sum(len(_CITATION.findall(text)) for text in texts.values())
    bad = {rel: p for rel, text in texts.items() if (p := bad_design_citations(text, sections, rules))}
    assert bad == {}, f"citations of {DESIGN} that lead nowhere: {bad}"
    assert cited >= 30, f"only {cited} citations of {DESIGN} found: is the scan still reading the code?"


def test_the_scan_reports_planted_dangling_references(tmp_path):
    (tmp_path / "coordination").mkdir()
    (tmp_path / "coordination" / "runner.py").write_text("")
    (tmp_path / "README.md").write_text("")
    pattern = path_pattern(["coordination", "configs"])
    good = "see coordination/runner.py and README.md; a rollout/update pair; <log>/configs/x.yaml"
    assert dangling_paths(good, pattern, tmp_path) == []
    gone, other, doc = "coordination/" + "gone.py", "configs/" + "x.yaml", "CONTRIBUTING" + ".md"
    assert dangling_paths(f"see {gone}, {other} and {doc}", pattern, tmp_path) == [gone, other, doc]

    assert outside_citations("# rule (DESIGN " + SECTION + "5 rule 7), see FIELD" + "-NOTES") != []
    assert len(outside_citations("# STYLE" + " item 3; ../" + "shared/x")) == 2

    sections, rules = design_outline(_design())
    cite = DESIGN + " " + SECTION
    assert bad_design_citations(f"({cite}5 rules 1-3, {cite}6 phases 7, 12 and {cite}10.3)", sections, rules) == []
    planted = [f"({cite}42)", f"({cite}5 rule 12)", f"({cite}6 phase 14)", f"({cite}7 rule 1)", f"(see {SECTION}5)"]
    for text in planted:
        assert bad_design_citations(text, sections, rules) != [], text
