"""The bundled batched verifier (docs/design.md, "The verifier"): trees, acceptance rules, the ragged KV
cache, proposers, engine.

The extra decoding modes live beside it as self-contained building blocks:
:mod:`~drafttrain.verify.methods.sssd_datastore` (suffix-array datastore), :mod:`~drafttrain.verify.methods.sssd`
(SSSD drafting, membership acceptance, speculation-length planner), :mod:`~drafttrain.verify.methods.mcsd`
(improved MCSD topology, sliced mask, decision model) and :mod:`~drafttrain.verify.methods.mtad` (MTAD beam
drafting, joint-likelihood acceptance, perplexity).
"""

from drafttrain.sampling import GREEDY, SamplingParams, process_logits  # the one sampling vocabulary, re-exported
from drafttrain.verify.acceptance import (
    Acceptance,
    accept,
    accept_greedy,
    speculative_sampling_chain,
    speculative_sampling_tree,
)
from drafttrain.verify.cache import RaggedKVCache
from drafttrain.verify.engine import MODES, EngineRun, EngineStats, SequenceResult, SpecEngine
from drafttrain.verify.proposers import EagleProposer, ParallelSpecProposer, PlainProposer, Proposer, proposer_for
from drafttrain.verify.tree import (
    EAGLE_DEFAULT_CHOICES,
    MEDUSA_DEFAULT_CHOICES,
    DraftTree,
    TreeTemplate,
    best_first_template,
    chain_template,
    parallelspec_tree,
    template_from_choices,
)

__all__ = [
    "GREEDY", "Acceptance", "SamplingParams", "accept", "accept_greedy", "process_logits",
    "speculative_sampling_chain", "speculative_sampling_tree", "RaggedKVCache", "MODES", "EngineRun",
    "EngineStats", "SequenceResult", "SpecEngine", "EagleProposer", "ParallelSpecProposer", "PlainProposer", "Proposer",
    "proposer_for",
    "EAGLE_DEFAULT_CHOICES", "MEDUSA_DEFAULT_CHOICES", "DraftTree", "TreeTemplate", "best_first_template",
    "chain_template", "parallelspec_tree", "template_from_choices",
]  # fmt: skip
