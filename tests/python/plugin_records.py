"""The plugin registry over one hand-made record: for tests of what discovery makes of a record."""

from __future__ import annotations

from tree_recurrence import plugins


def discover_only(monkeypatch, record: dict) -> dict:
    """plugins.discover over ``record`` alone (no other plugin, no runtime check): its result."""
    monkeypatch.setattr(plugins._core, "discover_plugins", lambda folders: [])
    monkeypatch.setattr(plugins._core, "plugin_records", lambda: [record])
    monkeypatch.setattr(plugins, "runtime_mismatch", lambda: None)
    monkeypatch.setattr(plugins.REGISTRY, "scan", None)
    monkeypatch.setattr(plugins.REGISTRY, "python_families", {})
    monkeypatch.setattr(plugins.REGISTRY, "python_packages", {})
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)
    (result,) = plugins.discover(rescan=True)
    return result
