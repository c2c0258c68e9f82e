"""Decoding methods beside the core verifier, one module per method, and the registry that the eval
config and the harness read (:mod:`~drafttrain.verify.methods.registry`).

=========================  =====================================================================
module                     method (``python -m scripts.evaluate methods=[...]``)
=========================  =====================================================================
``drafter``                ``drafter`` / ``parallelspec``: the checkpoint's own drafter and proposer
                           (section ``tree.*``); lossless
``replay``                 ``replay``: verifier benchmark, drafts replay the plain output; lossless
``sssd`` (+ ``sssd_datastore``)  ``sssd``: SSSD (Marzollo et al.), input trie + suffix-array datastore,
                           membership rule, speculation-length planner; lossless
``mcsd`` (+ ``mcsd_decision``)   ``mcsd``: improved MCSD (Lu et al.), W_t target roots + k-trees,
                           sliced mask, early-stop decision model; W_t = 1 lossless, W_t > 1 lossy
``mtad``                   ``mtad``: MTAD beam drafting + joint-likelihood acceptance; lossy
=========================  =====================================================================

Each module defines its engine proposer(s), its config section (a dataclass) and ends with a
:func:`~drafttrain.verify.methods.registry.register` call; importing this package registers them all.
How to add one: docs/design.md, "Adding a decoding method".
"""

from drafttrain.verify.methods.registry import (
    METHODS,
    Method,
    MethodContext,
    Variant,
    config_sections,
    get_method,
    register,
)

# the built-in methods register themselves on import (order = the order of listings)
from drafttrain.verify.methods import drafter, replay, sssd, mcsd, mtad  # noqa: E402, F401  isort: skip

__all__ = ["METHODS", "Method", "MethodContext", "Variant", "config_sections", "get_method", "register"]
