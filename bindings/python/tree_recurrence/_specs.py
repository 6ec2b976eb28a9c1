"""Seam specs, parsed once at load: a manifest's (or ``register_family``'s) seam specs as frozen
``SeamSpec`` / ``NativeSpec`` dataclasses, every key of the known adapters checked, with an error
naming the manifest file, the seam and the key (docs/plugins.md, section 3, lists the keys).

``plugins`` parses every loaded manifest's seams when it discovers the plugin and refuses the plugin
with that error; the parsed specs are the family's ``Family.seams``,
and they are what the engine reads: ``install`` / ``seams`` wrap the seams with them, the driver,
its strategies, ``components`` and the families' adapters read a call's ``SeamSpec``, and the
native-op load check (``_native_schema``) reads its ``NativeSpec``. The manifest's mappings stay in
the family (``Family.manifest["seams"]``) only as what the manifest said (``doctor``, tests).

A loaded family is a frozen ``Family`` (``plugins.families()``): built once when its manifest is
loaded (or by ``register_family``), its seams parsed, its record's keys checked (an error names the
manifest file and the key); the engine reads its fields.

A seam of an adapter this version does not know is kept as it is (``install`` answers ``"none"`` for
a model that needs it, naming the adapter): a manifest written for a newer version still loads.
A ``family`` seam's keys other than ``adapter``, ``args``, ``function`` and ``library`` are the
family function's own (``extra``)."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ._engine import ENGINE

KNOWN_ADAPTERS = ("conv", "scan", "decline", "family")
_COMMON = ("adapter", "args", "library")
_KEYS = {
    "conv": _COMMON,
    "scan": _COMMON + ("sequence", "returns", "native", "state_args", "neutral", "varlen"),
    "decline": _COMMON + ("declined",),
    "family": _COMMON + ("function",),
}
_NATIVE_KEYS = ("op", "chunk", "kwargs")
_LIBRARY_KEYS = ("package", "kernel", "stand_in")
_STATE_KEYS = ("initial_state", "output_final_state")


class SpecError(ValueError):
    """A seam spec that does not parse: the message names the source, the seam and the key."""


@dataclass(frozen=True)
class NativeSpec:
    """A scan seam's native op: ``op(*sequence, <plan tables>, initial_state, **kwargs)``."""

    op: str
    chunk: int | None = None  # chunked ops: the plan's chunk tables of this chunk size
    kwargs: Mapping[str, tuple[str, Any]] = field(default_factory=dict)  # op parameter -> (source, default)


@dataclass(frozen=True)
class SeamSpec:
    """One seam's spec, checked."""

    name: str
    adapter: str
    args: tuple[str, ...] = ()
    library: Mapping[str, str] | None = None
    sequence: tuple[str, ...] = ()
    returns: int = 1
    native: NativeSpec | None = None
    state_args: Mapping[str, str] | None = None
    neutral: Mapping[str, float] | None = None  # None: the manifest gives no neutral values (no fork without varlen)
    varlen: Mapping[str, str] | None = None
    declined: Any = None
    function: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # an unknown adapter's or a family function's keys


def parse_seams(source: str, seams: Any) -> dict[str, SeamSpec]:
    """Every seam of a manifest (``source`` names it in errors) parsed, or SpecError."""
    if seams is None:
        return {}
    if not isinstance(seams, Mapping):
        raise SpecError(f"{source}: 'seams' must be a mapping of seam name -> spec, got {type(seams).__name__}")
    return {name: parse_seam(source, name, spec) for name, spec in seams.items()}


_mapping_specs: dict[int, tuple[Any, Any, SeamSpec]] = ENGINE.mapping_specs  # id(mapping) -> (mapping, a deep copy, its spec)


def seam_spec_of(source: str, seam: str, spec: Any) -> SeamSpec:
    """``spec`` as a SeamSpec: a manifest-style mapping is parsed once per mapping object while it is
    unchanged (the mapping is kept alive here, so its id stays its own), so repeated calls given the
    same mapping get the same SeamSpec (the driver's route cache is keyed on it)."""
    if isinstance(spec, SeamSpec):
        return spec
    hit = _mapping_specs.get(id(spec))
    if hit is not None and hit[0] is spec and hit[1] == spec:
        return hit[2]
    parsed = parse_seam(source, seam, spec)
    _mapping_specs[id(spec)] = (spec, copy.deepcopy(spec), parsed)
    return parsed


def parse_seam(source: str, seam: str, spec: Any) -> SeamSpec:
    """One seam spec parsed, or SpecError naming ``source``, ``seam`` and the key."""

    def fail(key: str, problem: str):
        raise SpecError(f"{source}: seam '{seam}': key '{key}': {problem}")

    if not isinstance(spec, Mapping):
        raise SpecError(f"{source}: seam '{seam}': the spec must be a mapping, got {type(spec).__name__}")
    adapter = spec.get("adapter")
    if not isinstance(adapter, str) or not adapter:
        fail("adapter", f"missing or not a name (one of {list(KNOWN_ADAPTERS)}), got {adapter!r}")
    if adapter not in KNOWN_ADAPTERS:
        return SeamSpec(seam, adapter, extra=dict(spec))
    if adapter != "family":
        unknown = sorted(k for k in spec if k not in _KEYS[adapter])
        if unknown:
            fail(unknown[0], f"not a key of adapter '{adapter}' (its keys: {list(_KEYS[adapter])})")
    names = lambda key, value: _names(fail, key, value)  # noqa: E731
    if "args" not in spec:
        fail("args", "missing (the names of the seam's leading parameters, in order)")
    args = names("args", spec["args"])
    if adapter == "conv" and len(args) < 4:
        fail("args", f"a conv seam names x, weight, bias and activation first, got {list(args)}")
    library = spec.get("library")
    if isinstance(library, Mapping) and "reference" in library and "stand_in" not in library:
        warnings.warn(f"{source}: seam '{seam}': library key 'reference' is deprecated, name it 'stand_in'",
                      DeprecationWarning, stacklevel=2)
        library = {("stand_in" if k == "reference" else k): v for k, v in library.items()}
    if library is not None:
        if not isinstance(library, Mapping) or any(k not in _LIBRARY_KEYS for k in library) or \
                not all(isinstance(v, str) for v in library.values()):
            fail("library", f"expected {{package, kernel, stand_in}} of names, got {library!r}")
    parsed: dict[str, Any] = {"args": args, "library": dict(library) if library is not None else None}
    if adapter == "scan":
        if "sequence" not in spec:
            fail("sequence", "missing (the args that are per-token tensors)")
        sequence = names("sequence", spec["sequence"])
        missing = [s for s in sequence if s not in args]
        if missing or not sequence:
            fail("sequence", f"must be some of the args {list(args)}, got {list(sequence)}")
        returns = spec.get("returns", 1)
        if isinstance(returns, bool) or not isinstance(returns, int) or returns < 1:
            fail("returns", f"expected a positive int (the seam's return arity), got {returns!r}")
        parsed.update(sequence=sequence, returns=returns, native=_native(fail, spec.get("native")),
                      state_args=_mapping(fail, "state_args", spec.get("state_args"), _STATE_KEYS, str, required=True),
                      neutral=_mapping(fail, "neutral", spec.get("neutral"), None, (int, float)),
                      varlen=_mapping(fail, "varlen", spec.get("varlen"), ("cu_seqlens",), str, required=True))
        bad = [n for n in parsed["neutral"] or () if n not in sequence]
        if bad:
            fail("neutral", f"names {bad}, which are not sequence args {list(sequence)}")
    elif adapter == "decline":
        parsed["declined"] = spec.get("declined")
    elif adapter == "family":
        function = spec.get("function")
        if not isinstance(function, str) or not function:
            fail("function", f"missing or not a name (a function of the family's 'adapters' module), got {function!r}")
        parsed["function"] = function
        parsed["extra"] = {k: v for k, v in spec.items() if k not in _KEYS["family"]}
    return SeamSpec(seam, adapter, **parsed)


def _names(fail, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        fail(key, f"expected a list of names, got {value!r}")
    if len(set(value)) != len(value):
        fail(key, f"names repeat: {list(value)}")
    return tuple(value)


def _mapping(fail, key: str, value: Any, keys: tuple | None, kind, required: bool = False) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        fail(key, f"expected a mapping, got {value!r}")
    if keys is not None:
        unknown = [k for k in value if k not in keys]
        lacking = [k for k in keys if k not in value] if required else []
        if unknown or lacking:
            fail(key, f"expected the keys {list(keys)}, got {sorted(value)}")
    bad = [k for k, v in value.items() if isinstance(v, bool) or not isinstance(v, kind)]
    if bad:
        fail(key, f"entry '{bad[0]}' has {value[bad[0]]!r}, expected a {getattr(kind, '__name__', 'number')}")
    return dict(value)


def _native(fail, value: Any) -> NativeSpec | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or any(k not in _NATIVE_KEYS for k in value):
        fail("native", f"expected {{op, chunk, kwargs}}, got {value!r}")
    op = value.get("op")
    if not isinstance(op, str) or not op:
        fail("native", f"'op' must name the family's tree op, got {op!r}")
    chunk = value.get("chunk")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        fail("native", f"'chunk' must be a positive int, got {chunk!r}")
    kwargs = value.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        fail("native", f"'kwargs' must map op parameters to [source, default], got {kwargs!r}")
    for name, entry in kwargs.items():
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], str):
            fail("native", f"kwargs '{name}' must be [source, default], got {entry!r}")
    return NativeSpec(op, chunk, {name: (entry[0], entry[1]) for name, entry in kwargs.items()})


@dataclass(frozen=True, eq=False)
class Family:
    """A loaded family: a plugin's registry record (``plugins.discover``) or a ``register_family`` one, checked."""

    name: str
    version: str
    manifest_path: str  # "<registered from Python>" for register_family
    library_path: str
    fingerprint: str
    manifest: Mapping[str, Any]  # what the manifest says, raw (models, routes, python, integrations)
    seams: Mapping[str, SeamSpec]  # parsed at load
    kernels: tuple[tuple[str, str, bool], ...]  # (kernel, device type, available)
    op_namespace: str  # torch.ops.<op_namespace>
    python: bool = False  # registered from Python
    detect: Callable[[dict], tuple[bool, str, str]] | None = None  # register_family's detector (else the C++ one)
    library_version: str = ""

    @property
    def models(self) -> list[dict]:
        """The manifest's model entries (model_type, module, mixers, layer_types, ...)."""
        return self.manifest.get("models") or []

    @property
    def python_modules(self) -> Mapping[str, str]:
        """The manifest's ``python:`` (role -> module of the family's Python folder)."""
        python = self.manifest.get("python") or {}
        return python if isinstance(python, Mapping) else {}

    def has_kernel(self, name: str, device_type: str | None = None) -> bool:
        return any(k == name and ok and (device_type is None or d == device_type) for k, d, ok in self.kernels)

    @classmethod
    def from_record(cls, record: Mapping[str, Any], seams: Mapping[str, SeamSpec] | None = None) -> "Family":
        """A registry record (``_core.plugin_records``) as a Family: its seams parsed unless given, every key
        checked, or SpecError naming the manifest file and the key."""
        source = str(record.get("manifest_path") or record.get("family") or "<record>")

        def text(key: str, default: str | None = None) -> str:
            value = record.get(key, default)
            if not isinstance(value, str) or (key == "family" and not value):
                raise SpecError(f"{source}: key '{key}': expected a string, got {value!r}")
            return value

        name = text("family")
        manifest = record.get("manifest")
        if not isinstance(manifest, Mapping):
            raise SpecError(f"{source}: the manifest must be a mapping, got {type(manifest).__name__}")
        models = manifest.get("models") or []
        if not isinstance(models, list) or not all(isinstance(m, Mapping) for m in models):
            raise SpecError(f"{source}: key 'models': expected a list of model entries, got {models!r}"[:2000])
        for i, entry in enumerate(models):
            for key in ("model_type", "module", "mixers", "layer_types"):
                if key not in entry:
                    raise SpecError(f"{source}: key 'models[{i}].{key}': missing")
        kernels = record.get("kernels") or []
        try:
            kernels = tuple((str(k), str(d), bool(ok)) for k, d, ok in kernels)
        except (TypeError, ValueError):
            raise SpecError(f"{source}: key 'kernels': expected (kernel, device, available) triples, got {kernels!r}"[:2000])
        if seams is None:
            seams = parse_seams(source, manifest.get("seams"))
        return cls(name=name, version=text("version", ""), manifest_path=text("manifest_path", ""),
                   library_path=text("library_path", ""), fingerprint=text("fingerprint", ""), manifest=manifest,
                   seams=seams, kernels=kernels, op_namespace=record.get("op_namespace") or f"tree_recurrence_{name}",
                   python=bool(record.get("python")), detect=record.get("detect"),
                   library_version=str(record.get("library_version", "") or ""))

    # The record's keys, read as before (scripts outside the package that index records); the engine reads fields.
    _LEGACY = {"family": "name", "seam_specs": "seams"}

    def get(self, key: str, default: Any = None) -> Any:
        if key == "loaded":
            return True
        if key == "error":
            return ""
        return getattr(self, self._LEGACY.get(key, key), default) if not key.startswith("_") else default

    def __getitem__(self, key: str) -> Any:
        missing = object()
        value = self.get(key, missing)
        if value is missing:
            raise KeyError(key)
        return value

