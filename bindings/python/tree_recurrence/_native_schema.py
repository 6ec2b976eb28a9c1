"""The load check of a scan seam's ``native.op``: the op must be registered in the
family's op namespace with the schema the driver calls it by (``_scan_strategies.scan_native``).

The native-op convention (docs/plugins.md), positional, then keywords:

* chunked ops (the manifest's ``native: {chunk: C}``):
  ``op(*sequence, gather, scatter, seg_chunk_offsets, parents, root_index, level_segments,
  level_offsets, child_offsets, children, initial_state, **kwargs)``;
* token-walking ops: ``op(*sequence, seg_offsets, parents, initial_state, **kwargs)``;

each sequence argument a ``Tensor``, the tables ``Tensor`` (``level_offsets`` an ``int[]``), the initial
state a ``Tensor?``; every ``kwargs`` name a parameter after those; every other parameter has a
default; one ``Tensor`` returned. The table parameters must carry those names (the driver passes
them by position: a swapped pair would read one table as another). ``check(...)`` answers the
problem, naming the manifest file, the seam and the op, or None.
"""

from __future__ import annotations

import torch

from ._specs import Family, SeamSpec

CHUNKED_TABLES = ("gather", "scatter", "seg_chunk_offsets", "parents", "root_index", "level_segments",
                  "level_offsets", "child_offsets", "children")
TOKEN_TABLES = ("seg_offsets", "parents")
_TABLE_TYPES = {"level_offsets": ("List[int]", "int[]")}
_TENSOR = ("Tensor",)
_OPTIONAL_TENSOR = ("Optional[Tensor]", "Tensor?")


def schema_of(namespace: str, op: str):
    """The op's default-overload schema as torch.ops holds it, or None when it is not registered."""
    schemas = [s for s in torch._C._jit_get_schemas_for_operator(f"{namespace}::{op}") if s.overload_name == ""]
    return schemas[0] if schemas else None


def expected_positionals(spec: SeamSpec) -> list[tuple[str | None, tuple[str, ...], str]]:
    """(name or None for any, accepted types, role) of each positional argument the driver passes."""
    out: list[tuple[str | None, tuple[str, ...], str]] = [(None, _TENSOR, f"sequence '{s}'") for s in spec.sequence]
    tables = CHUNKED_TABLES if spec.native.chunk is not None else TOKEN_TABLES
    out += [(t, _TABLE_TYPES.get(t, _TENSOR), "plan table") for t in tables]
    out.append((None, _OPTIONAL_TENSOR, "initial state"))
    return out


def check(source: str, seam: str, spec: SeamSpec, namespace: str) -> str | None:
    """Why ``spec``'s native op does not take what the driver passes, or None."""
    native = spec.native
    if spec.adapter != "scan" or native is None:
        return None
    op = native.op
    where = f"{source}: seam '{seam}': native op '{namespace}::{op}'"
    schema = schema_of(namespace, op)
    if schema is None:
        return f"{where} is not registered (the plugin's library defines no such op in its namespace)"
    args = list(schema.arguments)
    shown = f"its schema: {schema}"[:1500]
    expected = expected_positionals(spec)
    convention = "chunked (native.chunk given)" if native.chunk is not None else "token-walking (no native.chunk)"
    if len(args) < len(expected):
        return (f"{where} takes {len(args)} arguments, the driver passes {len(expected)} positionally for a "
                f"{convention} op ({len(spec.sequence)} sequence tensors, the plan tables, the initial state); {shown}")
    for i, (name, types, role) in enumerate(expected):
        arg = args[i]
        if arg.kwarg_only:
            return f"{where}: argument {i} '{arg.name}' is keyword-only, the driver passes the {role} there; {shown}"
        if name is not None and arg.name != name:
            return (f"{where}: argument {i} is '{arg.name}', the driver passes the {role} '{name}' there "
                    f"({convention}: {', '.join(expected_names(spec))}); {shown}")
        if str(arg.type) not in types:
            return f"{where}: argument {i} '{arg.name}' is {arg.type}, the driver passes the {role} ({types[-1]}); {shown}"
    rest = {a.name: a for a in args[len(expected):]}
    kwargs = native.kwargs
    unknown = [k for k in kwargs if k not in rest]
    if unknown:
        return (f"{where}: native.kwargs names '{unknown[0]}', which is not a parameter after the driver's "
                f"{len(expected)} positional arguments (those: {sorted(rest) or 'none'}); {shown}")
    lacking = [a.name for name, a in rest.items() if name not in kwargs and not a.has_default_value()]
    if lacking:
        return (f"{where}: parameter '{lacking[0]}' has no default and native.kwargs does not give it "
                f"(the driver passes only native.kwargs after the initial state); {shown}")
    returns = [str(r.type) for r in schema.returns]
    if returns != ["Tensor"]:
        return f"{where} returns ({', '.join(returns)}), the driver expects one Tensor (the output); {shown}"
    return None


def expected_names(spec: SeamSpec) -> list[str]:
    names = [f"<{s}>" for s in spec.sequence]
    names += list(CHUNKED_TABLES if spec.native.chunk is not None else TOKEN_TABLES)
    return names + ["<initial_state>"]


def check_record(record: Family) -> str | None:
    """The first native-op problem of a loaded family's seams (its op namespace, its seams parsed at load), or None."""
    source = record.manifest_path or record.name
    for seam, spec in record.seams.items():
        problem = check(source, seam, spec, record.op_namespace)
        if problem:
            return problem
    return None
