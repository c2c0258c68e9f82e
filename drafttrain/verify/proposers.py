"""Proposers: what drafts the candidate tree of each sequence, kept in step with the engine.

The engine talks to a proposer through five calls (the :class:`Proposer` protocol). ``slot`` is a
small integer naming one live sequence (0..batch_size-1, reused after :meth:`~Proposer.release`).

1. ``start(slot, prompt_ids, hidden, first_token)`` after the prompt's prefill: ``hidden`` [P, d]
   are the target's last hidden states f_0..f_{P-1} at the prompt positions and ``first_token`` the
   token the target produced after the prompt. In the item convention of DESIGN.md §3 the
   sequence's first items are (x_{i+1}, f_i) = zip(prompt_ids[1:] + [first_token], hidden).
2. ``draft(slots, sampling, generator) -> list[DraftTree]``: one tree per slot, rooted at the
   slot's last emitted token (the root is not in the tree). Under sampling (``not
   sampling.greedy``) every node's children must be successive draws from ``tree.draft_probs[...]``
   processed with ``sampling`` (see :mod:`drafttrain.verify.acceptance`), and the tree's shape must
   not depend on which tokens were drawn; under greedy any tree works.
3. ``commit(slot, tokens, hidden)`` after verification: ``tokens`` [m + 1] are the accepted drafts
   followed by the bonus token, ``hidden`` [m + 1, d] the target's last hidden states at the root and
   at the accepted nodes, so again the new items are zip(tokens, hidden). A proposer with its own
   KV cache (EAGLE, ParallelSpec) appends exactly these items: it stays in step with the target's
   accepted sequence, and rejected drafts never enter it.
4. ``release(slot)`` when the sequence finished; the slot may be started again later.

How the other drafters fit without touching the engine:

- **Medusa** heads read only f_t: keep ``hidden[-1]`` from start/commit (the feature whose LM-head
  argmax is the root/bonus token); ``draft`` applies head k to it for depth k + 1 and fills a static
  tree (``TreeTemplate.fill`` with the per-head top-k / draws, ``dist_index`` = head index).
- **EAGLE** keeps a drafter KV cache like :class:`ParallelSpecProposer`; ``draft`` runs its
  autoregressive tree expansion (one drafter forward per depth over the current frontier, children
  = top-k of each node's own distribution, ``draft_probs`` row per expanded node, ``dist_index`` =
  the parent's row) and must crop its cache back to the committed items before returning.

Shape letters: P prompt length, d hidden, v vocab, K mask tokens, n tree nodes.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from drafttrain.verify.acceptance import GREEDY, SamplingParams, process_logits
from drafttrain.verify.tree import DraftTree, TreeTemplate, parallelspec_tree, template_from_choices


@runtime_checkable
class Proposer(Protocol):
    """The engine-facing interface of a drafter (see the module docstring)."""

    name: str

    def start(self, slot: int, prompt_ids: Sequence[int], hidden: torch.Tensor, first_token: int) -> None: ...

    def draft(
        self, slots: Sequence[int], sampling: SamplingParams = GREEDY, generator: torch.Generator | None = None
    ) -> list[DraftTree]: ...

    def commit(self, slot: int, tokens: Sequence[int], hidden: torch.Tensor) -> None: ...

    def release(self, slot: int) -> None: ...


class PlainProposer:
    """No drafts: every step verifies only the root and emits the target's own next token (plain decoding).

    Running plain decoding through the same engine makes it the baseline of every speedup figure.
    """

    name = "plain"

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        pass

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        return [DraftTree.empty() for _ in slots]

    def commit(self, slot, tokens, hidden) -> None:
        pass

    def release(self, slot) -> None:
        pass


class ReplayProposer:
    """Benchmark proposer: drafts a chain from known greedy outputs, each depth right with probability ``p``.

    It measures what the *verifier* does with a drafter of a given quality, independent of any drafter's
    cost (drafting is free): acceptance lengths follow EMS-SD Appendix B's geometric model
    (P(τ = k) = p^(k-1) (1 - p), capped at ``depth`` + 1), so padding in the vanilla mode is realistic.
    Greedy only: its drafts are not draws from a distribution.

    Args:
        references: prompt ids (tuple) -> the target's greedy output for it (e.g. a plain run's tokens).
        depth: chain length.
        accept_prob: probability that each draft is the right token.
        seed: RNG of the right/wrong choices.
    """

    name = "replay"

    def __init__(self, references: dict[tuple[int, ...], list[int]], depth: int = 5, accept_prob: float = 0.7, seed: int = 0):
        self.refs, self.depth, self.p = references, int(depth), float(accept_prob)
        self.rng = torch.Generator().manual_seed(seed)
        self._state: dict[int, dict] = {}

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        self._state[slot] = {"ref": self.refs[tuple(prompt_ids)], "generated": 1}

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        if not sampling.greedy:
            raise ValueError("ReplayProposer drafts known greedy outputs: use it with greedy decoding only")
        trees = []
        for slot in slots:
            st = self._state[slot]
            ref, g = st["ref"], st["generated"]
            right = (torch.rand(self.depth, generator=self.rng) < self.p).tolist()
            toks = []
            for t in range(self.depth):
                true = ref[g + t] if g + t < len(ref) else 0
                toks.append(true if right[t] and g + t < len(ref) else true + 1)
            trees.append(DraftTree.chain(toks))
        return trees

    def commit(self, slot, tokens, hidden) -> None:
        self._state[slot]["generated"] += len(tokens)

    def release(self, slot) -> None:
        self._state.pop(slot, None)


class ParallelSpecProposer:
    """Drafts with any drafter exposing ``propose(next_ids [1, n], features [1, n, d], cache) -> [1, K + 1, v]``
    (:class:`~drafttrain.drafters.parallelspec.ParallelSpecDrafter`): one drafter forward per sequence
    and step gives the K + 1 distributions after the root, turned into a tree by
    :func:`~drafttrain.verify.tree.parallelspec_tree` (ParallelSpec Algorithm 1, Appendix A.3).

    Args:
        drafter: the drafter (eval mode is set here).
        widths: candidates per depth (default: a chain, one per depth for all K + 1 depths).
        budget: maximum tree nodes (default: sum of widths' chain, i.e. K + 1).
        choices: optional static shape (a Medusa-style choice list) instead of the best-first shape.
    """

    name = "parallelspec"

    def __init__(
        self,
        drafter,
        widths: Sequence[int] | None = None,
        budget: int | None = None,
        choices: Sequence[Sequence[int]] | None = None,
    ):
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.drafter = drafter.eval() if hasattr(drafter, "eval") else drafter
        k1 = int(getattr(drafter, "num_mask_tokens", 0)) + 1  # depths the drafter covers
        self.widths = list(widths) if widths is not None else [1] * k1
        self.budget = int(budget) if budget is not None else len(self.widths)
        self.template: TreeTemplate | None = template_from_choices(choices) if choices is not None else None
        self._state: dict[int, dict] = {}

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        prompt_ids = list(prompt_ids)
        ids = torch.tensor([prompt_ids[1:] + [int(first_token)]], dtype=torch.long, device=hidden.device)
        self._state[slot] = {"cache": self._cache_cls(), "ids": ids, "feats": hidden[None]}  # [1, P], [1, P, d]

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        trees = []
        for slot in slots:
            st = self._state[slot]
            logits = self.drafter.propose(st["ids"], st["feats"], st["cache"])[0]  # [K + 1, v]
            st["ids"] = st["feats"] = None  # consumed: the drafter cache now holds these items
            if sampling.greedy:  # shape scores from the drafter's own (T = 1) confidences; top-k candidates
                probs = torch.softmax(logits.float(), dim=-1)
            else:  # draws from the same processed distributions the acceptance rule divides by
                probs = process_logits(logits, sampling)
            trees.append(
                parallelspec_tree(probs, self.widths, self.budget, not sampling.greedy, generator, self.template)
            )
        return trees

    def commit(self, slot, tokens, hidden) -> None:
        st = self._state[slot]
        st["ids"] = torch.tensor([list(tokens)], dtype=torch.long, device=hidden.device)  # [1, m + 1]
        st["feats"] = hidden[None]  # [1, m + 1, d]

    def release(self, slot) -> None:
        self._state.pop(slot, None)
