"""House rules for the otel package, checked mechanically."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OTEL = Path(__file__).resolve().parents[2] / "otel"
MODULES = sorted(OTEL.glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_module_rules(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 320, "split the module (aim < 300 lines, never > 500)"
    assert "from __future__ import annotations" in text or path.name == "__init__.py"
    tree = ast.parse(text)
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
    }
    assert "set_tracer_provider" not in names and "set_meter_provider" not in names  # no global providers
    assert "environ" not in names  # configuration comes in as a mapping
    assert not [
        n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.type is None
    ]  # no bare except
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)]


@pytest.mark.parametrize("path", [p for p in MODULES if not p.name.startswith("_")], ids=lambda p: p.name)
def test_public_modules_declare_all(path: Path) -> None:
    tree = ast.parse(path.read_text())
    exported = [
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
    ]
    assert exported or path.name == "__init__.py"
