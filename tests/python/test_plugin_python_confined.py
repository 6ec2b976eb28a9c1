"""A plugin's Python is held to its library's rule: the family's Python folder
``<family>/`` next to the manifest, and each module its ``python:`` names, must resolve (after
symlinks) inside the folder that holds the manifest. One that does not is a refused plugin whose
reason names the plugin and the path, and nothing of it is imported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from plugin_records import discover_only
from tree_recurrence import plugins


def plugin(root: Path, family: str, python: dict) -> dict:
    """A loaded plugin's record (as the registry gives it) for a manifest in root/plugins."""
    folder = root / "plugins"
    folder.mkdir(exist_ok=True)
    (folder / f"{family}.yaml").write_text(f"family: {family}\n")
    return {"family": family, "version": "1.0.0", "manifest_path": str(folder / f"{family}.yaml"),
            "library_path": "", "loaded": True, "error": "", "fingerprint": "",
            "manifest": {"python": python, "seams": {}}, "kernels": []}


def outside_module(root: Path) -> Path:
    """root/outside/evil.py, whose import would create root/imported (proof that it ran)."""
    outside = root / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "evil.py").write_text(f"open({str(root / 'imported')!r}, 'w').close()\n")
    return outside


def refused_through_discover(monkeypatch, record: dict) -> dict:
    result = discover_only(monkeypatch, record)
    assert record["family"] not in plugins.families()
    assert plugins.family_python(record["family"], "stand_ins") is None  # an absent family has no Python
    return result


def test_symlinked_python_folder_pointing_outside_is_refused(tmp_path, monkeypatch):
    record = plugin(tmp_path, "linked", {"stand_ins": "evil"})
    (tmp_path / "plugins" / "linked").symlink_to(outside_module(tmp_path), target_is_directory=True)
    result = refused_through_discover(monkeypatch, record)
    assert result["loaded"] is False
    assert "plugin 'linked'" in result["error"] and "outside the plugin folder" in result["error"]
    assert str(tmp_path / "outside") in result["error"]
    with pytest.raises(PermissionError, match="outside the plugin folder"):
        plugins.family_python_folder(record)
    assert not (tmp_path / "imported").exists()
    assert "tree_recurrence_family_linked" not in sys.modules


@pytest.mark.parametrize("module", ["..outside.evil", "../outside/evil", "/abs/evil", "evil/../../x"])
def test_python_entry_with_dots_or_a_path_is_refused(tmp_path, monkeypatch, module):
    outside_module(tmp_path)
    record = plugin(tmp_path, "dotted", {"stand_ins": module})
    (tmp_path / "plugins" / "dotted").mkdir()
    result = refused_through_discover(monkeypatch, record)
    assert result["loaded"] is False
    assert "plugin 'dotted'" in result["error"] and "python: stand_ins" in result["error"]
    assert module in result["error"]
    assert not (tmp_path / "imported").exists()


def test_symlinked_module_file_pointing_outside_is_refused(tmp_path, monkeypatch):
    outside = outside_module(tmp_path)
    record = plugin(tmp_path, "modlink", {"stand_ins": "stand_ins"})
    (tmp_path / "plugins" / "modlink").mkdir()
    (tmp_path / "plugins" / "modlink" / "stand_ins.py").symlink_to(outside / "evil.py")
    result = refused_through_discover(monkeypatch, record)
    assert "plugin 'modlink'" in result["error"] and "stand_ins.py" in result["error"]
    assert str(outside / "evil.py") in result["error"]
    assert not (tmp_path / "imported").exists()


def test_python_inside_the_plugin_folder_still_loads(tmp_path, monkeypatch):
    record = plugin(tmp_path, "fine_family", {"stand_ins": "stand_ins"})
    (tmp_path / "plugins" / "real").mkdir()
    (tmp_path / "plugins" / "real" / "stand_ins.py").write_text("VALUE = 7\n")
    (tmp_path / "plugins" / "fine_family").symlink_to(tmp_path / "plugins" / "real", target_is_directory=True)
    result = discover_only(monkeypatch, record)
    assert result["loaded"] is True and plugins.python_escape(record) is None
    try:
        assert plugins.family_python("fine_family", "stand_ins").VALUE == 7
    finally:
        sys.modules.pop("tree_recurrence_family_fine_family.stand_ins", None)
        sys.modules.pop("tree_recurrence_family_fine_family", None)
