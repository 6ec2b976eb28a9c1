"""Fuzzing ``tree_plan``: a fixed-seed random and mutation run of a few thousand
valid and malformed inputs, in a subprocess (a crash is a failed test, not a dead test runner).

Every input must either build a plan that passes the invariants below, or raise ValueError or
TypeError with a message. A crash, a hang (a single call over 2 s), MemoryError or any other
exception fails. Invariants of a built plan, checked against the input itself (not the plan's
own arrays): every sample (leaf) is reconstructed from its path: the path equals the leaf's key
path (TRL format) or the concatenation of its ancestors' segments (parents format); every token is
found at its source in its path; conv ancestors are the previous tokens on the token's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

FUZZ = r'''
import json, random, sys, time
import torch
from tree_recurrence._tree_kwargs import tree_plan

rng = random.Random(20261201)
CASES = int(sys.argv[1])
failures, counts = [], {"built": 0, "refused": 0, "checked": 0}

sys.path.insert(0, sys.argv[2])  # tests/python: the generator is tries.random_forest
from tries import random_forest as _random_forest

def random_forest():
    """(segment lengths, parents) in DFS pre-order."""
    return _random_forest(rng)

def pack(lengths, parents):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    paths = []
    for s, p in enumerate(parents):
        own = list(range(cu[s], cu[s + 1]))
        paths.append((paths[p] if p >= 0 else []) + own)
    cu_k = [0]
    for path in paths:
        cu_k.append(cu_k[-1] + len(path))
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return {"tree_cu_seqlens_q": cu, "tree_kv_index": [t for path in paths for t in path], "tree_cu_seqlens_k": cu_k,
            "tree_segment_parents": parents, "tree_segment_depths": depth}

WEIRD = [0, 1, -1, -2, 2, 7, 2**31 - 1, 2**31, 2**40, 2**62, 2**63 - 1, -2**63]

def mutate(fields):
    fields = {k: list(v) if isinstance(v, list) else v for k, v in fields.items()}
    for _ in range(rng.randint(1, 3)):
        if not fields:
            break
        name = rng.choice(list(fields))
        value = fields[name]
        kind = rng.randrange(8)
        if not isinstance(value, list):
            continue
        if kind == 0 and value:
            value[rng.randrange(len(value))] = rng.choice(WEIRD)
        elif kind == 1 and value:
            value[rng.randrange(len(value))] += rng.choice([-1, 1])
        elif kind == 2 and value:
            del value[rng.randrange(len(value))]
        elif kind == 3:
            value.insert(rng.randint(0, len(value)), rng.choice(WEIRD + [rng.randint(-3, 40)]))
        elif kind == 4:
            rng.shuffle(value)
        elif kind == 5:
            fields[name] = value[: rng.randint(0, len(value))]
        elif kind == 6:
            del fields[name]
        else:
            fields[name] = [rng.choice(WEIRD)] * rng.randint(0, 3)
    return fields

def to_tensors(fields):
    kwargs = {}
    for name, value in fields.items():
        value = [max(-2**63, min(2**63 - 1, v)) for v in value]
        roll = rng.random()
        if roll < 0.02:
            kwargs[name] = value  # a list, not a tensor
        elif roll < 0.04:
            kwargs[name] = torch.tensor(value, dtype=torch.int64).to(rng.choice([torch.float32, torch.int16, torch.uint8, torch.bool]))
        elif roll < 0.06:
            kwargs[name] = torch.tensor(value, dtype=torch.int64).reshape(1, -1).expand(rng.randint(2, 3), -1)
        elif roll < 0.07:
            kwargs[name] = torch.tensor(value[:1], dtype=torch.int64).reshape(()) if value else torch.tensor(0)
        else:
            t = torch.tensor(value, dtype=torch.int64)
            if rng.random() < 0.2 and all(-2**31 <= v < 2**31 for v in value):
                t = t.to(torch.int32)
            if rng.random() < 0.1:
                t = t.reshape(1, -1)
            if rng.random() < 0.05 and t.numel() > 1 and t.dim() == 1:
                t = torch.stack([t, t], 1)[:, 0]  # non-contiguous
            kwargs[name] = t
    return kwargs

def check(plan, fields):
    cu = fields["tree_cu_seqlens_q"]
    if plan.path_token_total > 200_000:
        return  # planned lazily for a row nobody holds; the reconstruction would be that large
    counts["checked"] += 1
    S = len(cu) - 1
    assert plan.num_segments == S and plan.num_tokens == cu[-1]
    parents = plan.array("parents").tolist()
    if "tree_kv_index" in fields:
        kv, cu_k = fields["tree_kv_index"], fields["tree_cu_seqlens_k"]
        expected = {s: kv[cu_k[s]:cu_k[s + 1]] for s in range(S)}
    else:
        given = fields["tree_segment_parents"]
        expected = {}
        for s in range(S):
            chain, node = [], s
            while node >= 0:
                chain.append(node)
                node = given[node]
            expected[s] = [t for seg in reversed(chain) for t in range(cu[seg], cu[seg + 1])]
    leaves = plan.array("leaves").tolist()
    assert leaves == [s for s in range(S) if s not in parents], "leaves"
    offsets, tokens = plan.array("path_offsets").tolist(), plan.array("path_tokens").tolist()
    for i, leaf in enumerate(leaves):
        assert tokens[offsets[i]:offsets[i + 1]] == expected[leaf], f"sample {i} (segment {leaf}) not reconstructed"
    source, position = plan.array("token_source").tolist(), plan.array("token_position").tolist()
    for t in range(plan.num_tokens):
        assert tokens[source[t]] == t, f"token {t}: source"
    ancestors = plan.conv_tables(3)[0].tolist()
    segment = plan.array("token_segment").tolist()
    for t in range(plan.num_tokens):
        path = expected[segment[t]]
        p = position[t]
        assert path[p] == t
        assert ancestors[t] == [path[p - j] if p - j >= 0 else -1 for j in (1, 2)], f"token {t}: conv ancestors"

for case in range(CASES):
    lengths, parents = random_forest()
    full = pack(lengths, parents)
    form = rng.randrange(3)
    if form == 0:
        fields = {k: full[k] for k in ("tree_cu_seqlens_q", "tree_kv_index", "tree_cu_seqlens_k")}
    elif form == 1:
        fields = dict(full)
    else:
        fields = {k: full[k] for k in ("tree_cu_seqlens_q", "tree_segment_parents")}
    if rng.random() < 0.75:
        fields = mutate(fields)
    kwargs = to_tensors(fields)
    num_tokens = None
    if rng.random() < 0.3:
        num_tokens = full["tree_cu_seqlens_q"][-1] + rng.choice([0, 0, 0, 1, -1])
    start = time.perf_counter()
    try:
        plan = tree_plan(kwargs, num_tokens)
    except (ValueError, TypeError) as e:
        counts["refused"] += 1
        if not str(e).strip():
            failures.append({"case": case, "fields": repr(fields)[:500], "error": f"{type(e).__name__} without a message"})
    except BaseException as e:
        failures.append({"case": case, "fields": repr(fields)[:500], "error": f"{type(e).__name__}: {str(e)[:300]}"})
    else:
        if plan is None:
            if "tree_cu_seqlens_q" in kwargs:
                failures.append({"case": case, "fields": repr(fields)[:500], "error": "no plan for present tree kwargs"})
        else:
            counts["built"] += 1
            try:
                check(plan, fields)
            except BaseException as e:
                failures.append({"case": case, "fields": repr(fields)[:500], "error": f"invariant: {type(e).__name__}: {str(e)[:300]}"})
    elapsed = time.perf_counter() - start
    if elapsed > 2.0:
        failures.append({"case": case, "fields": repr(fields)[:500], "error": f"took {elapsed:.1f} s"})
print(json.dumps({"counts": counts, "failures": failures[:20], "num_failures": len(failures)}))
'''


def test_tree_plan_fuzz_builds_or_refuses_every_input():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FUZZ), "3000", os.path.dirname(os.path.abspath(__file__))], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"fuzz process died (rc {done.returncode}): {done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["num_failures"] == 0, json.dumps(result["failures"], indent=1)
    counts = result["counts"]
    # The run must exercise both outcomes substantially, and check real plans.
    assert counts["built"] > 300 and counts["refused"] > 300 and counts["checked"] > 300, counts
