"""The bundled verifier and the decoding modes it serves (DESIGN.md section 4).

This branch adds the self-contained building blocks of the extra decoding modes (issue 6):
:mod:`~drafttrain.verify.datastore` (suffix-array datastore), :mod:`~drafttrain.verify.sssd`
(SSSD drafting, membership acceptance, speculation-length planner), :mod:`~drafttrain.verify.mcsd`
(improved MCSD topology, sliced mask, decision model) and :mod:`~drafttrain.verify.mtad` (MTAD beam
drafting, joint-likelihood acceptance, perplexity).
"""
