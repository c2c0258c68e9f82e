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

Optional: ``accept(slot, tree, target_logits, sampling, generator) -> Acceptance`` replaces the
engine's rule (:func:`~drafttrain.verify.acceptance.accept`) for this proposer's trees (SSSD's
membership rule, MCSD's target-initialized rule, MTAD's joint-likelihood rule; see
:mod:`drafttrain.verify.methods`), and ``lossless`` (default True) says whether the output keeps the
target's distribution. A rule may return ``bonus=None``: then ``commit`` gets the accepted tokens
only, with the hidden states at [root, path[:-1]], and the last accepted token is the next root.

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
    (:class:`~drafttrain.drafters.parallelspec.ParallelSpecDrafter`): one drafter forward gives the K + 1
    distributions after the root, turned into a tree by :func:`~drafttrain.verify.tree.parallelspec_tree`
    (ParallelSpec Algorithm 1, Appendix A.3).

    With a ParallelSpec drafter (it has ``items``, ``decode``, ``logits``, ``mask_embed``) and
    ``batched=True`` the drafter runs **one forward per step for the whole batch**: every sequence's
    new items + K mask inputs in a ``[B, q_max]`` layout over a one-layer
    :class:`~drafttrain.verify.cache.RaggedKVCache` (each sequence at its own offset; the mask
    slots' keys/values are written but never committed, which is ``propose``'s crop). Otherwise it
    calls ``propose`` once per sequence, each with its own ``DynamicCache``.

    Args:
        drafter: the drafter (eval mode is set here).
        widths: candidates per depth (default: a chain, one per depth for all K + 1 depths).
        budget: maximum tree nodes (default: one per depth).
        choices: optional static shape (a Medusa-style choice list) instead of the best-first shape.
        batched: use the batched path when the drafter supports it.
    """

    name = "parallelspec"

    def __init__(
        self,
        drafter,
        widths: Sequence[int] | None = None,
        budget: int | None = None,
        choices: Sequence[Sequence[int]] | None = None,
        batched: bool = True,
    ):
        self.drafter = drafter.eval() if hasattr(drafter, "eval") else drafter
        self.k = int(getattr(drafter, "num_mask_tokens", 0))
        self.widths = list(widths) if widths is not None else [1] * (self.k + 1)
        self.budget = int(budget) if budget is not None else len(self.widths)
        self.template: TreeTemplate | None = template_from_choices(choices) if choices is not None else None
        self.batched = batched and all(hasattr(drafter, a) for a in ("items", "decode", "logits", "mask_embed"))
        self._state: dict[int, dict] = {}
        self._cache = None  # batched path: one-layer RaggedKVCache, row = slot

    # -- protocol -------------------------------------------------------------------------------
    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        prompt_ids = list(prompt_ids)
        ids = torch.tensor(prompt_ids[1:] + [int(first_token)], dtype=torch.long, device=hidden.device)
        st = {"ids": ids, "feats": hidden}  # [P], [P, d]: the prompt's items
        if self.batched:
            self._reset_row(slot, hidden)
        else:
            from transformers import DynamicCache

            st["cache"] = DynamicCache()
        self._state[slot] = st

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        logits = self._draft_logits_batched(slots) if self.batched else [self._draft_logits_one(s) for s in slots]
        trees = []
        for lg in logits:  # [K + 1, v] per sequence
            if sampling.greedy:  # shape scores from the drafter's own (T = 1) confidences; top-k candidates
                probs = torch.softmax(lg.float(), dim=-1)
            else:  # draws from the same processed distributions the acceptance rule divides by
                probs = process_logits(lg, sampling)
            trees.append(parallelspec_tree(probs, self.widths, self.budget, not sampling.greedy, generator, self.template))
        return trees

    def commit(self, slot, tokens, hidden) -> None:
        st = self._state[slot]
        st["ids"] = torch.tensor(list(tokens), dtype=torch.long, device=hidden.device)  # [m + 1]
        st["feats"] = hidden  # [m + 1, d]

    def release(self, slot) -> None:
        self._state.pop(slot, None)

    # -- drafting -------------------------------------------------------------------------------
    def _draft_logits_one(self, slot) -> torch.Tensor:
        st = self._state[slot]
        out = self.drafter.propose(st["ids"][None], st["feats"][None], st["cache"])[0]  # [K + 1, v]
        st["ids"] = st["feats"] = None  # consumed: the drafter cache now holds these items
        return out

    def _reset_row(self, slot: int, like: torch.Tensor) -> None:
        from types import SimpleNamespace

        from drafttrain.verify.cache import RaggedKVCache

        if self._cache is None:
            attn = self.drafter.layer.self_attn
            n_kv = attn.config.num_key_value_heads
            cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=n_kv, num_attention_heads=n_kv,
                                  head_dim=attn.head_dim, hidden_size=n_kv * attn.head_dim)  # fmt: skip
            dtype = self.drafter.fc.weight.dtype
            self._cache = RaggedKVCache(cfg, 0, 256, dtype, like.device)
        if slot >= self._cache.batch_size:
            self._cache.add_rows(slot + 1 - self._cache.batch_size)
        self._cache.valid[slot] = False
        self._cache.lengths[slot] = 0

    @torch.no_grad()
    def _draft_logits_batched(self, slots) -> list[torch.Tensor]:
        """One drafter forward for all ``slots``: items + K masks each, ParallelSpec's inference layout
        (:func:`drafttrain.layout.inference_layout`) at each sequence's own cache offset."""
        from drafttrain.layout import inference_layout
        from drafttrain.verify.cache import batched_layout

        d, cache, k = self.drafter, self._cache, self.k
        sts = [self._state[s] for s in slots]
        n = [st["ids"].numel() for st in sts]
        u = d.items(torch.cat([st["ids"] for st in sts])[None], torch.cat([st["feats"] for st in sts])[None])[0]
        xs, pos, masks, slot_ids = [], [], [], []
        for slot, ui, ni in zip(slots, torch.split(u, n), n):
            past = int(cache.lengths[slot])
            p, m = inference_layout(ni, k, dtype=torch.float32, past=past)
            xs.append(torch.cat([ui, d.mask_embed.to(ui.dtype)]))  # [n_i + K, d]
            pos.append(p[0].to(u.device))
            masks.append(m[0, 0, :, past:] == 0)  # [q_i, q_i] this call's own part
            slot_ids.append(past + torch.arange(ni + k, device=u.device))
        cache.ensure_capacity(max(int(cache.lengths[s]) for s in slots) + max(n) + k)
        lay = batched_layout(cache, list(slots), masks, slot_ids, u.dtype)
        cache.set_plan(lay.plan)
        try:
            h = d.decode(lay.scatter(xs, 0.0), lay.mask, lay.scatter(pos), past_key_values=cache, use_cache=True)
        finally:
            cache.set_plan(None)
        hs = lay.gather(h)
        last = torch.stack([hi[ni - 1 :] for hi, ni in zip(hs, n)])  # [B, K + 1, d]: anchor + K mask slots
        logits = d.full_vocab_logits(d.logits(last))  # [B, K + 1, v]
        for slot, st, ni in zip(slots, sts, n):  # commit the items (not the mask slots: propose's crop)
            past = int(cache.lengths[slot])
            cache.valid[slot, past : past + ni] = True
            cache.lengths[slot] += ni
            st["ids"] = st["feats"] = None
        return list(logits)
