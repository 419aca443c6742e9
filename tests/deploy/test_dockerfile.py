"""The Dockerfile builds from a clean clone as from a developer's tree: every source it copies is
tracked by git and sent in the build context (not excluded by .dockerignore), what `pip install .`
reads is among them, and what .gitignore keeps out of a clone .dockerignore keeps out of the
context. Its `.dockerignore` rules are read as Docker reads them (moby's patternmatcher): Go
path globs where `**` spans directories, matched from the context's root, a path being excluded
when it or one of its parent directories matches, the last matching rule winning, `!` negating.
"""

import re
import shlex
import shutil
import subprocess
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 1)) > i:
            body = pattern[i + 1 : end]
            body = "^" + body[1:] if body.startswith("!") else body
            out, i = out + f"[{body}]", end + 1
        elif pattern[i] == "\\" and i + 1 < len(pattern):
            out, i = out + re.escape(pattern[i + 1]), i + 2
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


@cache
def dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.removeprefix("!").strip().lstrip("/").rstrip("/")
        rules.append((negate, glob_regex(pattern)))
    return rules


def excluded(path: str) -> bool:
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    verdict = False
    for negate, regex in dockerignore():
        if any(regex.fullmatch(c) for c in candidates):
            verdict = not negate
    return verdict


def copy_sources() -> list[str]:
    """The local sources of the Dockerfile's COPY and ADD instructions."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    sources = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue  # from another stage or image, not from the context
        sources += [s.removeprefix("./").rstrip("/") or "." for s in args[:-1]]
    return sources


@cache
def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the files of a clean clone are unknown here")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [p for p in out.split("\0") if p]


def under(path: str, source: str) -> bool:
    return source == "." or path == source or path.startswith(source + "/")


def test_dockerignore_rules_read_as_docker_reads_them() -> None:
    assert glob_regex("**/__pycache__").fullmatch("__pycache__")
    assert glob_regex("**/__pycache__").fullmatch("platform/jobplane/__pycache__")
    assert glob_regex("**/*.pyc").fullmatch("a/b/c.pyc")
    assert not glob_regex("*.pyc").fullmatch("a/c.pyc")
    assert not glob_regex(".venv").fullmatch("bench/.venv")
    assert excluded(".git/HEAD")
    assert excluded("platform/jobplane/__pycache__/cli.cpython-311.pyc")


def test_copied_sources_are_tracked_and_sent() -> None:
    files = tracked()
    sources = copy_sources()
    assert sources, "the Dockerfile copies nothing from the context?"
    for source in sources:
        inside = [p for p in files if under(p, source)]
        assert inside, f"COPY {source}: not in a clean clone (git ls-files)"
        left_out = [p for p in inside if excluded(p)]
        assert not left_out, f"COPY {source}: .dockerignore keeps out {left_out[:5]}"


def test_what_pip_install_reads_is_copied() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = [
        "pyproject.toml",
        project["project"]["readme"],
        *project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"],
    ]
    sources = copy_sources()
    for path in needed:
        assert any(under(path, s) for s in sources), f"{path} is not copied into the image"


def gitignore_samples() -> list[tuple[str, str]]:
    """A path that each .gitignore rule ignores, at the root and deeper when the rule says so."""
    samples = []
    for raw in (ROOT / ".gitignore").read_text().splitlines():
        rule = raw.strip()
        if not rule or rule.startswith(("#", "!")):
            continue
        name = rule.rstrip("/").replace("*", "x")
        paths = [name.lstrip("/")]
        if "/" not in rule.rstrip("/"):  # no inner slash: git matches it at any depth
            paths.append(f"platform/jobplane/{name}")
        if rule.endswith("/"):
            paths = [f"{p}/x" for p in paths]
        samples += [(rule, p) for p in paths]
    return samples


def test_what_a_clone_lacks_stays_out_of_the_context() -> None:
    samples = gitignore_samples()
    assert samples
    for rule, path in samples:
        assert excluded(path), f".gitignore's {rule!r} ignores {path}; .dockerignore sends it"
    for path in (".git/config", ".venv/bin/python", ".jobplane/mongo/x", ".bench-venvs/celery/x"):
        assert excluded(path), path


def test_the_tree_sends_what_a_clean_clone_has() -> None:
    """Here and now: what the work tree would send under the copied sources that git does not
    track (caches this very test run writes, a developer's leftovers) is nothing."""
    tracked_files = set(tracked())
    extra = []
    for source in copy_sources():
        root = ROOT / source
        walk = [root] if root.is_file() else (p for p in root.rglob("*") if p.is_file())
        for path in walk:
            relative = path.relative_to(ROOT).as_posix()
            if relative not in tracked_files and not excluded(relative):
                extra.append(relative)
    untracked_by_git = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "-z", "--", *copy_sources()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    # Files a developer has not committed yet are theirs to commit; anything else is a leak.
    leaks = sorted(set(extra) - set(untracked_by_git))
    assert not leaks, f"sent in the build context but ignored by git: {leaks[:10]}"
