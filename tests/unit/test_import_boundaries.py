"""The boxes' import rules, read from the source with ``ast`` (no import runs):

* the library (``easyckpt``) and the agent (``easyckpt_agent``) share only the versioned wire layer (``easyckpt_wire``):
  neither imports the other, and the wire layer imports neither;
* the agent and the wire layer never import torch (an agent must start in well under a second, and the wire
  layer is what ``easyckpt ls/verify`` run on without torch);
* no module imports a private name (``_x``) from another module;
* no module is longer than 600 lines (issue 25: a module that outgrows that holds more than one box).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("easyckpt", "easyckpt_agent", "easyckpt_wire")
FORBIDDEN = {
    "easyckpt": {"easyckpt_agent"},
    "easyckpt_agent": {"easyckpt", "torch"},
    "easyckpt_wire": {"easyckpt", "easyckpt_agent", "torch"},
}


def modules(package: str) -> list[Path]:
    found = sorted(p for p in (ROOT / package).rglob("*.py") if ".venv" not in p.parts)
    assert found, f"no modules under {ROOT / package}: a package renamed without this test?"
    return found


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in ``path``, relative imports resolved against its package."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


@pytest.mark.parametrize("package", PACKAGES)
def test_each_box_imports_only_what_it_may(package: str) -> None:
    wrong = [f"{where(path, line)} imports {module}"
             for path in modules(package) for line, module, _ in imports(path)
             if module.split(".")[0] in FORBIDDEN[package]]
    assert not wrong, "imports across the boxes' boundary (the library and the agent share only easyckpt_wire):\n" \
        + "\n".join(wrong)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_name_is_imported_from_another_module(package: str) -> None:
    wrong = [f"{where(path, line)} imports {name} from {module}"
             for path in modules(package) for line, module, names in imports(path)
             if module.split(".")[0] in PACKAGES
             for name in names if name.startswith("_") and not name.startswith("__")]
    assert not wrong, "private names imported across modules (make them public or move the code):\n" + "\n".join(wrong)


MAX_LINES = 600


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_longer_than_600_lines(package: str) -> None:
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path in modules(package)
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them by role):\n" + "\n".join(long)


def test_the_rule_sees_a_violation(tmp_path: Path) -> None:
    """The reader itself: a relative import of a private name is found and resolved."""
    probe = tmp_path / "easyckpt_wire" / "probe.py"
    probe.parent.mkdir()
    probe.write_text("from .slots import _hidden\nimport torch\nfrom easyckpt_wire import layout\n")
    found = imports(probe, root=tmp_path)
    assert (1, "easyckpt_wire.slots", ["_hidden"]) in found and (2, "torch", []) in found


def test_no_test_module_imports_a_test_module_of_another_tier() -> None:
    """The tiers are folders (``tests/unit``, ``agent``, ``jobs``, ``integrations``) that run alone: a test module
    that imported another tier's test module would find it only when both tiers were collected in one run. Shared
    helpers live in ``tests/`` itself."""
    tests = ROOT / "tests"
    tiers = {path.stem: path.parent.name for path in tests.glob("*/test_*.py")}
    assert {"unit", "agent", "jobs", "integrations"} <= set(tiers.values()), sorted(set(tiers.values()))
    wrong = [f"{where(path, line)} imports {module} of tests/{tiers[module]}/"
             for path in sorted(tests.glob("*/test_*.py")) for line, module, _ in imports(path, tests)
             if module in tiers and tiers[module] != path.parent.name]
    assert not wrong, "move what is shared into a helper module in tests/:\n" + "\n".join(wrong)
