"""Command line: ``python -m tree_recurrence doctor`` (plugins, fingerprints, kernels, coverage, the settings
(``settings.py``) with their values, and
the route ``auto`` takes per family on this machine and why: a ``tune`` record's numbers, or the default
order; ``doctor --gpu NAME`` reads the records of the GPU of that name).

``tune``: times every route of each family's scan seam on the shapes given and records the medians in
the user's cache folder, where the router reads them (tree_recurrence/tune.py; ``tune --help``).

``bench``: whole-model training-step benchmark of tree rows against chains and a flat row
(tree_recurrence/bench.py; ``bench --help``).

``doctor --json`` prints the same as JSON. ``sdk --cmake-dir`` / ``sdk --include-dir`` print where the
installed SDK is, to build a family plugin out of tree (docs/plugins.md).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import re
import sys
from pathlib import Path

import torch

from . import __version__, _core, _routes, bench, plugins, settings, tune


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _major_minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"not a CUDA version (MAJOR.MINOR...): {version!r}")
    return int(match[1]), int(match[2])


def built_cuda(fingerprint: str) -> tuple[str | None, str | None]:
    """(CUDA toolkit version, CUDA archs) the core was built with, read from its fingerprint text
    ("torch 2.11.0, cxx11_abi 1, cuda 13.0.88 (sm 90)"); (None, None) for a build without CUDA kernels."""
    match = re.search(r"cuda ([^\s,]+)(?: \(sm ([^)]*)\))?", fingerprint)
    if not match or match[1] == "none":
        return None, None
    return match[1], match[2]


def driver_cuda() -> str | None:
    """The newest CUDA version the installed NVIDIA driver supports ("13.0"; cuDriverGetVersion, which
    needs no GPU context), None where no driver library loads."""
    try:
        value = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(value)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{value.value // 1000}.{value.value % 1000 // 10}"


def cuda_compatibility(built: str | None, torch_cuda: str | None, driver: str | None,
                       archs: str | None = None, gpu_arch: str | None = None) -> tuple[bool, str]:
    """Whether the CUDA the kernels were built with (``built``, nvcc's version; ``archs`` their sm list)
    works with the running torch's CUDA (``torch_cuda``) and the driver (``driver``: the CUDA version it
    supports; ``gpu_arch`` the GPU's sm, "90"), as (fine, one line saying so or what breaks).

    The plugins call torch's CUDA runtime (they link libcudart.so.MAJOR, the library torch loaded), so
    what must match is the major version: within one, CUDA's minor version compatibility holds (a
    toolkit 13.0 build runs beside torch on 13.2). Another major needs another libcudart, which the
    process lacks or would hold twice. The driver must support the major; one older than the toolkit's
    minor still runs the built archs' machine code, but cannot JIT the toolkit's PTX for another GPU."""
    if built is None:
        return True, "fine: this build has no CUDA kernels, so torch's CUDA version does not matter to it"
    major, minor = _major_minor(built)
    if torch_cuda is None:
        return False, (f"WARNING: the kernels were built with CUDA {built} and link a CUDA torch (libtorch_cuda, "
                       f"libcudart.so.{major}), but this torch has no CUDA: the plugins do not load; reinstall "
                       "tree-recurrence against this torch")
    torch_major = _major_minor(torch_cuda)[0]
    if torch_major != major:
        return False, (f"WARNING: the kernels were built with CUDA {built} and need libcudart.so.{major}, but torch runs "
                       f"CUDA {torch_cuda} (libcudart.so.{torch_major}): the plugins fail to load or bring a second CUDA "
                       f"runtime into the process; rebuild with a CUDA {torch_major} toolkit (nvcc) against this torch")
    same = f"built with CUDA {built}, torch on CUDA {torch_cuda}: " + (
        "the same version" if _major_minor(torch_cuda) == (major, minor) else
        "the same major version, and CUDA's minor version compatibility covers the minor") + \
        f" (the kernels call torch's libcudart.so.{major})"
    if driver is None:
        return True, f"fine: {same}; no NVIDIA driver here, so no CUDA kernel runs on this machine"
    if _major_minor(driver)[0] < major:
        return False, (f"WARNING: the NVIDIA driver supports CUDA up to {driver}, but the kernels ({built}) and torch "
                       f"({torch_cuda}) need a driver for CUDA {major}: update the driver")
    if _major_minor(driver) >= (major, minor):
        return True, f"fine: {same}; the driver supports CUDA {driver}"
    built_archs = [re.match(r"\d*", a.strip())[0] for a in (archs or "").split(",") if not a.strip().endswith("-virtual")]
    if gpu_arch is not None and gpu_arch not in built_archs:
        return False, (f"WARNING: this GPU (sm {gpu_arch}) has no machine code in the build (sm {archs}), and the "
                       f"driver (CUDA {driver}) cannot JIT PTX from the newer CUDA {built}: update the driver or "
                       f"rebuild with -Ccmake.define.CMAKE_CUDA_ARCHITECTURES={gpu_arch}")
    return True, (f"fine: {same}; the driver (CUDA {driver}) is older than the toolkit but of its major, which runs "
                  f"the machine code built for sm {archs}")


def cuda_report(fingerprint: str | None = None) -> dict:
    """doctor's CUDA line with what it compared (the JSON report's ``cuda_check``), for the build
    ``fingerprint`` (default: the core's; a plugin built out of tree carries its own)."""
    built, archs = built_cuda(_core.core_fingerprint() if fingerprint is None else fingerprint)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    gpu_arch = f"{capability[0]}{capability[1]}" if capability else None
    driver = driver_cuda()
    fine, line = cuda_compatibility(built, torch.version.cuda, driver, archs, gpu_arch)
    return {"fine": fine, "line": line, "built": built, "archs": archs, "torch": torch.version.cuda,
            "driver": driver, "gpu_arch": gpu_arch}


def doctor_report(gpu: str | None = None) -> dict:
    """``gpu``: the device name whose tune records to show (default: this machine's)."""
    records = plugins.discover(rescan=True)
    seen = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report = {
        "version": __version__,
        "abi_version": _core.ABI_VERSION,
        "core_fingerprint": _core.core_fingerprint(),
        "torch": {"version": torch.__version__, "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
                  "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "plugin_folders": plugins.plugin_folders(),
        "plugins": [],
        "refused": [],
        "routes_gpu": gpu or _routes.device_name(torch.device("cuda" if seen else "cpu")),
        "routes_file": str(_routes.record_path()),
        "routes_problem": _routes.record_problem(),
        "cuda_check": cuda_report(),
        "settings": settings.all_settings(),
    }
    for r in records:
        if not r["loaded"]:
            report["refused"].append({"family": r["family"], "manifest": r["manifest_path"], "reason": r["error"]})
            continue
        f = plugins.loaded_family(r)
        models = [{"model_type": m["model_type"], "module": m["module"], "mixers": m["mixers"],
                   "layer_types": m["layer_types"], "installed": _module_present(m["module"])} for m in f.models]
        report["plugins"].append({
            "family": f.name, "version": f.version, "library_version": f.library_version,
            "library": f.library_path, "fingerprint": f.fingerprint,
            "kernels": [{"name": k, "device": d, "available": ok} for k, d, ok in f.kernels],
            "seams": sorted(f.seams), "models": models,
            "routes": tune.route_report(f, gpu) if _has_native_scan(f) else [],
            "cuda_check": cuda_report(f.fingerprint),
        })
    return report


def _has_native_scan(family: plugins.Family) -> bool:
    return any(spec.native is not None for spec in family.seams.values())


def shown(text: str) -> str:
    """``text`` printable on a strict UTF-8 stream: bytes of a name that is not UTF-8, which paths carry as
    surrogates (``os.fsdecode``), become ``\\xNN`` escapes, as the registry's messages show them."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def print_doctor(report: dict) -> None:
    def out(line: str = "") -> None:
        print(shown(line))

    out(f"tree-recurrence {report['version']} (plugin ABI {report['abi_version']})")
    out(f"  core built for: {report['core_fingerprint']}")
    t = report["torch"]
    out(f"  running torch {t['version']} (cxx11_abi {int(t['cxx11_abi'])}, cuda {t['cuda']}, gpu {t['gpu'] or 'none'})")
    if "cuda_check" in report:
        out(f"  cuda: {report['cuda_check']['line']}")
    out("  plugin folders: " + ", ".join(report["plugin_folders"]))
    out(f"\nplugins loaded: {len(report['plugins'])}")
    for p in report["plugins"]:
        out(f"  {p['family']} {p['version']} (manifest; library {p['library_version'] or '?'})  [{p['fingerprint']}]")
        out(f"    library: {p['library']}")
        if not p.get("cuda_check", {"fine": True})["fine"]:  # the core's line covers a plugin that fits
            out(f"    cuda: {p['cuda_check']['line']}")
        kernels = ", ".join(f"{k['name']}:{k['device']}" + ("" if k["available"] else " (not built)") for k in p["kernels"])
        out(f"    kernels: {kernels}")
        out(f"    seams: {', '.join(p['seams'])}")
        for m in p["models"]:
            state = "covered" if m["installed"] else "not in this transformers"
            out(f"    {m['model_type']:<20} {'/'.join(m['mixers']):<28} layer_types {m['layer_types']}  ({state})")
        if p.get("routes"):
            out(f"    auto's route on {report.get('routes_gpu')}:")
            for row in p["routes"]:
                call = f"{row['shape']:<6} {row['tokens']:>7} tokens {row['phase']:<7} {row['dtype']}" \
                    if "shape" in row else "typical call"
                out(f"      {call} -> {row['route'] or 'rule'}: {row['reason']}")
    if report.get("routes_problem"):
        out(f"\nroute records: {report['routes_problem']}")
    out(f"\nplugins refused: {len(report['refused'])}")
    for r in report["refused"]:
        out(f"  {r['family']}: {r['reason']}")
    out(f"\nsettings (environment variables): {len(report['settings'])}")
    for s in report["settings"]:
        value = s["text"] if s["set"] else f"(default {s['default'] or 'empty'})"
        out(f"  {s['name']:<38} {value:<14} {'INVALID: ' + s['error'] if s['error'] else s['doc']}")


def sdk_dir(kind: str) -> Path:
    """The installed SDK's ``cmake`` or ``include`` folder (inside the package: tree_recurrence/sdk/)."""
    return Path(__file__).resolve().parent / "sdk" / kind


def print_sdk_dir(kind: str) -> int:
    folder = sdk_dir(kind)
    marker = folder / ("TreeRecurrenceSDKConfig.cmake" if kind == "cmake" else "tree_recurrence/sdk/family.h")
    if not marker.is_file():
        print(f"tree-recurrence: no SDK at {folder} ({marker.name} missing): this copy of the package was not "
              "installed with its SDK; reinstall it (pip install --no-build-isolation .)", file=sys.stderr)
        return 1
    print(folder)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tree_recurrence")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="plugins found, ABI and build fingerprints, kernels, model coverage")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--gpu", default=None, help="show auto's routes by the tune records of the GPU of this name "
                        "(default: this machine's device)")
    tune.add_arguments(sub.add_parser("tune", help="time each route of the families' scan seams on the shapes given "
                                      "and record the fastest for auto (in the user's cache folder)"))
    sdk = sub.add_parser("sdk", help="where the installed SDK is, to build a family plugin out of tree (docs/plugins.md)")
    where = sdk.add_mutually_exclusive_group(required=True)
    where.add_argument("--cmake-dir", action="store_true", help="the folder holding TreeRecurrenceSDKConfig.cmake "
                       "(pass it as -DTreeRecurrenceSDK_DIR=... or append it to CMAKE_PREFIX_PATH)")
    where.add_argument("--include-dir", action="store_true", help="the folder holding tree_recurrence/sdk/*.h")
    bench.add_arguments(sub.add_parser("bench", help="whole-model fwd+bwd: tree row vs chains vs flat row "
                                       "(tokens/s, speed-up, memory; JSON + PNG)"))
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench.run(args)
    if args.command == "tune":
        return tune.run(args)
    if args.command == "sdk":
        return print_sdk_dir("cmake" if args.cmake_dir else "include")
    if args.command == "doctor":
        report = doctor_report(args.gpu)
        if args.json:
            json.dump(report, sys.stdout, indent=2)
            print()
        else:
            print_doctor(report)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
