"""The SDK for family Python: everything a family's ``python/`` modules (library stand-ins, component
fronts, seam adapters) use of the engine, in one public module. Family Python imports
``tree_recurrence.sdk`` (and torch, and its own sibling modules), never an underscore module or another
engine module, so the engine's modules may change while this surface stays.

In the installed package this folder also holds the C++ SDK a family plugin is built against
(``include/``, ``lib/``, ``cmake/``: ``python -m tree_recurrence sdk --cmake-dir``).

Components (models that follow trees in their own code, and families' friendlier fronts):

* ``scan(family, seam, *args, plan=None, kernel=None, ...)`` -- a loaded family's scan seam over a
  tree-packed row (its native op, else fork / rescan over ``kernel``);
* ``delta_rule_scan(family, seam, q, k, v, g, beta, plan=None, ...)`` -- ``scan`` with FLA's delta-rule
  keywords;
* ``tree_scan(kernel, *args, plan=None, spec=None, ...)`` -- any recurrence with a library's API over
  the trie;
* ``tree_conv`` / ``short_convolution`` -- the causal depthwise conv over the trie;
* ``mark_tree_forward`` -- the plan context of a mixer's forward;
* ``register_family`` / ``unregister_family`` -- families registered from Python.

Stand-in helpers (library stand-ins are exact PyTorch functions with the libraries' APIs):

* ``causal_conv1d_fn`` -- causal-conv1d's causal depthwise conv;
* ``l2norm``, ``delta_rule_layout``, ``delta_rule`` -- what FLA's delta-rule kernels share around their
  token recurrence.

Seam adapters (a manifest's ``adapter: family`` seam: a function ``(call, backend, policy)``):

* ``SeamCall`` -- the bound call (``named``, ``rest``, ``plan``, ``spec``, ``bound``; ``check_row``,
  ``path_rows``, ``call_original``, ``record``, ``finish``);
* ``Route`` -- what a call does (strategy, reason, native op);
* ``run`` -- one seam call over the trie as the seam wrappers make it;
* ``decide_route`` -- the call's route, cached on the plan, from the adapter's own decision function;
* ``route_decision`` -- the router's choice under backend and policy ``auto`` (a ``tune`` record, else
  the default given);
* ``check_activation`` -- the one check of a conv's activation;
* ``native_tree_conv`` -- a family's native tree conv op on a ``(1, C, N)`` row;
* ``bound_implementation`` / ``instance_forward`` -- what a transformers seam is bound to.

Registry: ``families``, ``has_kernel``, ``ops``, ``shared_ops``. Types: ``TreePlan``, ``Policy``,
``SeamSpec``, ``Family``.

Every name here keeps its own docstring (``help(tree_recurrence.sdk.<name>)``).
"""

from __future__ import annotations

from .._bound_kernels import bound_implementation, instance_forward
from .._plan import TreePlan
from .._registered import register_family, unregister_family
from .._specs import Family, SeamSpec
from ..components import delta_rule_scan, mark_tree_forward, scan, short_convolution, tree_conv, tree_scan
from ..driver import Route, SeamCall, check_activation, decide_route, route_decision, run
from ..driver import tree_conv as native_tree_conv
from ..plugins import families, has_kernel, ops, shared_ops
from ..policy import Policy
from ..stand_ins import causal_conv1d_fn, delta_rule, delta_rule_layout, l2norm

__all__ = [
    # components
    "delta_rule_scan", "mark_tree_forward", "register_family", "scan", "short_convolution", "tree_conv", "tree_scan",
    "unregister_family",
    # stand-in helpers
    "causal_conv1d_fn", "delta_rule", "delta_rule_layout", "l2norm",
    # seam adapters
    "Route", "SeamCall", "bound_implementation", "check_activation", "decide_route", "instance_forward",
    "native_tree_conv", "route_decision", "run",
    # registry
    "families", "has_kernel", "ops", "shared_ops",
    # types
    "Family", "Policy", "SeamSpec", "TreePlan",
]
