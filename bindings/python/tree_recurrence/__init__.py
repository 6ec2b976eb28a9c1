"""tree-recurrence: recurrent and linear-attention layers of transformers models on tree-packed rows.

    support = tree_recurrence.install(model)          # hooks the model's recurrent seams
    model(input_ids, position_ids=..., **tree_kwargs) # forward a tree-packed row
"""

import torch  # noqa: F401  -- libtorch must be loaded before any plugin library

from . import _core
from ._plan import TreePlan
from ._tree_kwargs import TREE_FIELDS, has_tree, tree_plan
from .install import Support, install, set_backend, uninstall
from . import components
from .components import mark_tree_forward, tree_conv, tree_scan
from ._registered import register_family, unregister_family
from .plugins import add_plugin_path
from .integrations import trl as _trl_integration  # noqa: F401  -- registers backend "trl" (imports no TRL)
from .policy import Policy

__version__ = "0.1.0"

__all__ = ["TREE_FIELDS", "TreePlan", "Policy", "Support", "add_plugin_path", "components", "has_tree", "install",
           "mark_tree_forward", "register_family", "set_backend", "tree_conv", "tree_plan", "tree_scan", "uninstall",
           "unregister_family", "__version__"]
