"""Trainer integrations. Each submodule imports its trainer library on import; this package imports none.

* :mod:`tree_recurrence.integrations.trl` -- TRL's AsyncGRPOTrainer (trl 1.16): ``tree_recurrent_models()``,
  ``ChainRow`` and the chain batchers, ``tree_kwargs_from_batch``, ``guarded_flops`` (docs/trl.md).
"""

__all__ = ["trl"]
