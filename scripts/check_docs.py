#!/usr/bin/env python3
"""Checks that the docs cite what exists: run by `scripts/test.sh` (a gate) and by hand.

For every Markdown file of the project (README, CHANGELOG, docs/, faults/) and the comments of
the protocol model (model/src/, tests/protocol_model.rs):

- a relative link `[text](path#anchor)` names a file that exists, and a heading of it with that
  anchor (GitHub's rule: lower case, punctuation dropped, spaces to `-`);
- a path in backticks under one of the project's folders (`src/store/redis/commit.rs`,
  `tests/fenced.rs`, `examples/`) exists;
- a symbol in backticks of the form `Type::member`, where `Type` is a type the crate defines,
  names a `fn`, variant, constant or field of the crate that exists;
- nothing cites a line number (`commit.rs:120`) or an issue number (`issue 28`): both go stale.

Exits 1 with one line per broken reference; prints the count checked otherwise.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("src", "tests", "examples", "scripts", "benches", "docs", "faults", "ops", "testkit", "suite", ".ci")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
TICKED = re.compile(r"`([^`\n]+)`")
LINE_CITE = re.compile(r"\b[\w/.-]+\.(?:rs|lua|py|toml|sh):\d+\b")
ISSUE_CITE = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)
SYMBOL = re.compile(r"^(?:[a-z_]+::)*([A-Z][A-Za-z0-9]*)::([a-z_][a-z0-9_]*|[A-Z][A-Za-z0-9]*)(?:\(.*\))?$")


def slug(heading: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set:
    found, counts, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(2))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def crate_symbols():
    """Types the crate defines, and every member name (fn, variant, const, field) in src/."""
    types, members = set(), set()
    for path in (ROOT / "src").rglob("*.rs"):
        text = path.read_text(encoding="utf-8")
        types.update(re.findall(r"\b(?:struct|enum|trait|type|union)\s+([A-Z][A-Za-z0-9]*)", text))
        members.update(re.findall(r"\bfn\s+([a-z_][a-z0-9_]*)", text))
        members.update(re.findall(r"\bconst\s+([A-Z_][A-Z0-9_]*)", text))
        members.update(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?([a-z_][a-z0-9_]*)\s*:", text, re.M))
        members.update(re.findall(r"^\s*([A-Z][A-Za-z0-9]*)\s*[,({]", text, re.M))
        members.update(re.findall(r"^\s*([A-Z][A-Za-z0-9]*)\s*$", text, re.M))
        # Setters and getters made by macros: `name: Type => ...` in a settings table.
        members.update(re.findall(r"^\s*([a-z_][a-z0-9_]*)\s*:\s*[^=\n]+=>", text, re.M))
    return types, members


def documents():
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "faults" / "README.md"]
    docs += sorted((ROOT / "docs").glob("*.md"))
    return [d for d in docs if d.exists()]


def model_sources():
    sources = sorted((ROOT / "model" / "src").glob("*.rs"))
    sources.append(ROOT / "tests" / "protocol_model.rs")
    return [s for s in sources if s.exists()]


def check_path(text: str) -> bool:
    """Whether a ticked path under a project folder exists (a glob may match)."""
    path = text.rstrip("/").split("#")[0]
    if any(ch in path for ch in "*?["):
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def main() -> int:
    problems = []
    checked = 0
    cache = {}
    types, members = crate_symbols()
    for doc in documents():
        rel = doc.relative_to(ROOT)
        text = doc.read_text(encoding="utf-8")
        fenced = False
        for number, line in enumerate(text.splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
            where = f"{rel}:{number}"
            for cite in LINE_CITE.findall(line):
                problems.append(f"{where}: cites a line number ({cite}): cite the symbol")
            for cite in ISSUE_CITE.findall(line):
                problems.append(f"{where}: cites an issue ({cite}): say what, not which ticket")
            if fenced:
                continue
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target) or target.startswith("//"):
                    continue
                checked += 1
                file_part, _, anchor = target.partition("#")
                dest = doc if not file_part else (doc.parent / file_part).resolve()
                if not dest.exists():
                    problems.append(f"{where}: link to a missing file: {target}")
                    continue
                if anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        problems.append(f"{where}: link to a missing heading: {target}")
            for ticked in TICKED.findall(line):
                head = ticked.split("/")[0]
                if "/" in ticked and head in FOLDERS and " " not in ticked:
                    checked += 1
                    if not check_path(ticked):
                        problems.append(f"{where}: names a path that does not exist: {ticked}")
                    continue
                symbol = SYMBOL.match(ticked)
                # The changelog names what was removed, by design.
                if symbol and symbol.group(1) in types and rel.name != "CHANGELOG.md":
                    checked += 1
                    if symbol.group(2) not in members and symbol.group(2) not in types:
                        problems.append(f"{where}: names a symbol the crate does not have: {ticked}")
    for source in model_sources():
        rel = source.relative_to(ROOT)
        for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
            if "//" not in line:
                continue
            comment = line[line.index("//"):]
            for cite in LINE_CITE.findall(comment):
                problems.append(f"{rel}:{number}: cites a line number ({cite}): cite the symbol")
            for ticked in TICKED.findall(comment):
                if "/" in ticked and ticked.split("/")[0] in FOLDERS and " " not in ticked:
                    checked += 1
                    if not check_path(ticked):
                        problems.append(f"{rel}:{number}: names a path that does not exist: {ticked}")
    for problem in problems:
        print(problem)
    if problems:
        print(f"error: {len(problems)} broken references in the docs", file=sys.stderr)
        return 1
    print(f"docs: {checked} references checked, all found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
