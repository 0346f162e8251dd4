"""The repository a newcomer clones: nothing binary or vendored in git, CI running exactly the README's
test command, and the dependency bounds pyproject.toml states being the ones CI tests (issues 31, 32.4)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 2 * 1024 * 1024


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (the check needs the list of tracked files)")
    return [name for name in out.stdout.decode().split("\0") if name]


def test_no_tracked_file_is_over_2_mb_outside_docs_images():
    big = [
        f"{name} ({(ROOT / name).stat().st_size} bytes)"
        for name in _tracked_files()
        if (ROOT / name).is_file() and not name.startswith("docs/img/")
        and (ROOT / name).stat().st_size > LIMIT_BYTES
    ]
    assert not big, f"tracked files over 2 MB (build them, keep them git-ignored): {big}"


def test_the_fa4_archive_is_built_not_tracked():
    tracked = _tracked_files()
    assert not [name for name in tracked if name.startswith((".fa4one/", ".fa4extra/", ".fa4/", ".whl/"))]
    ignored = subprocess.run(["git", "check-ignore", "-q", ".fa4one/site.tar.xz"], cwd=ROOT).returncode
    assert ignored == 0, ".fa4one/ (the FA4 pack output for the GPU carry) must be git-ignored"


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md starts with a ```bash block of set-up commands"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_starts_with_two_setup_commands_cpu_torch_first():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    for command in commands:
        # torch's CPU wheel first: letting the project pull torch can fetch a multi-GB CUDA build.
        assert command.startswith("pip install torch==2.13.0 && pip install -e "), command
    assert "launch/train.py" in commands[0] and "pytest" in commands[1]


def test_ci_runs_exactly_the_readmes_test_command():
    out = subprocess.run([str(ROOT / ".ci" / "run"), "--print-command"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == _readme_commands()[1]
    script = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in script, ".ci/run must install into a fresh virtual environment"


def _lower_bounds() -> dict[str, str]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for name, extra in project["optional-dependencies"].items():
        if name != "cute":  # pinned exactly: the FA4 beta the block-sparsity lists are written for
            requirements += extra
    bounds = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][^;,\s]*)(;.*)?", requirement.strip())
        assert match, f"pyproject requirement {requirement!r}: expected 'name>=tested-version'"
        name, version = match.group(1).lower(), match.group(2)
        assert bounds.get(name, version) == version, f"{name}: two lower bounds in pyproject.toml"
        bounds[name] = version
    return bounds


def test_every_lower_bound_is_the_one_ci_tests():
    pinned = {}
    for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pinned[name.strip().lower()] = version.strip()
    bounds = _lower_bounds()
    bounds.pop("tomli", None)  # Python < 3.11 only; CI runs 3.11
    bounds.pop("torch", None)  # the README installs torch==2.13.0 first; 2.11 is the GPU image's
    assert bounds == pinned, "pyproject.toml's lower bounds and .ci/lowest.txt differ"


def test_every_file_under_docs_benchmarks_is_cited_or_retired():
    """BENCHMARKING.md's retirement rule: docs/benchmarks holds what a document cites (a file by its
    name without extension, a folder by its name; ``a_{b,c}`` cites both), nothing else."""
    files = subprocess.run(["git", "ls-files", "docs/benchmarks"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    docs = [ROOT / "README.md", ROOT / "BENCHMARKING.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs/benchmarks/README.md"]
    text = "".join(p.read_text() for p in docs)

    def expand(token):
        m = re.search(r"\{([^{}]*)\}", token)
        return [token] if not m else [x for alt in m.group(1).split(",")
                                      for x in expand(token[:m.start()] + alt + token[m.end():])]

    text += "\n".join(e for token in re.findall(r"[\w./-]*\{[^{}\s]*\}[\w./{},-]*", text) for e in expand(token))
    uncited = []
    for f in files:
        rel = Path(f).relative_to("docs/benchmarks")
        name = rel.parts[0] if len(rel.parts) > 1 else rel.name.split(".")[0]
        if str(rel) != "README.md" and name not in text:
            uncited.append(f)
    assert not uncited, "cited by no document (retire them: docs/benchmarks/README.md, 'Retired runs'):\n" + "\n".join(uncited)
