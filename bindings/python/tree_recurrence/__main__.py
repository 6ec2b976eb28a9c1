"""Command line: ``python -m tree_recurrence doctor`` (plugins, fingerprints, kernels, coverage).

``doctor --json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch

from . import __version__, _core, plugins


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def doctor_report() -> dict:
    records = plugins.discover()
    report = {
        "version": __version__,
        "abi_version": _core.ABI_VERSION,
        "core_fingerprint": _core.core_fingerprint(),
        "torch": {"version": torch.__version__, "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
                  "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "plugin_folders": plugins.plugin_folders(),
        "plugins": [],
        "refused": [],
    }
    for r in records:
        if not r["loaded"]:
            report["refused"].append({"family": r["family"], "manifest": r["manifest_path"], "reason": r["error"]})
            continue
        models = [{"model_type": m["model_type"], "module": m["module"], "mixers": m["mixers"],
                   "layer_types": m["layer_types"], "installed": _module_present(m["module"])}
                  for m in r["manifest"]["models"]]
        report["plugins"].append({
            "family": r["family"], "version": r["version"], "library": r["library_path"], "fingerprint": r["fingerprint"],
            "kernels": [{"name": k, "device": d, "available": ok} for k, d, ok in r["kernels"]],
            "seams": sorted(r["manifest"]["seams"]), "models": models,
        })
    return report


def print_doctor(report: dict) -> None:
    print(f"tree-recurrence {report['version']} (plugin ABI {report['abi_version']})")
    print(f"  core built for: {report['core_fingerprint']}")
    t = report["torch"]
    print(f"  running torch {t['version']} (cxx11_abi {int(t['cxx11_abi'])}, cuda {t['cuda']}, gpu {t['gpu'] or 'none'})")
    print("  plugin folders: " + ", ".join(report["plugin_folders"]))
    print(f"\nplugins loaded: {len(report['plugins'])}")
    for p in report["plugins"]:
        print(f"  {p['family']} {p['version']}  [{p['fingerprint']}]")
        print(f"    library: {p['library']}")
        kernels = ", ".join(f"{k['name']}:{k['device']}" + ("" if k["available"] else " (not built)") for k in p["kernels"])
        print(f"    kernels: {kernels}")
        print(f"    seams: {', '.join(p['seams'])}")
        for m in p["models"]:
            state = "covered" if m["installed"] else "not in this transformers"
            print(f"    {m['model_type']:<20} {'/'.join(m['mixers']):<28} layer_types {m['layer_types']}  ({state})")
    print(f"\nplugins refused: {len(report['refused'])}")
    for r in report["refused"]:
        print(f"  {r['family']}: {r['reason']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tree_recurrence")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="plugins found, ABI and build fingerprints, kernels, model coverage")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        report = doctor_report()
        if args.json:
            json.dump(report, sys.stdout, indent=2)
            print()
        else:
            print_doctor(report)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
