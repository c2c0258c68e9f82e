"""Proposers: what drafts the candidate tree of each sequence, kept in step with the engine.

The engine talks to a proposer through five calls (the :class:`Proposer` protocol). ``slot`` is a
small integer naming one live sequence (0..batch_size-1, reused after :meth:`~Proposer.release`).

1. ``start(slot, prompt_ids, hidden, first_token)`` after the prompt's prefill: ``hidden`` [P, d]
   are the target's last hidden states f_0..f_{P-1} at the prompt positions and ``first_token`` the
   token the target produced after the prompt. In the item convention of docs/design.md, "Definitions", the
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

Optional: ``feature_layers`` (a tuple of target layer ids, :class:`~drafttrain.drafters.base.DrafterSpec`;
absent or None = the final post-norm state) says which target hidden states the engine hands ``start``
and ``commit`` as ``hidden`` ([P, F] / [m + 1, F], F = len(ids) * d, the layers concatenated in order):
the drafter proposers set it to their drafter's declaration.
``accept(slot, tree, target_logits, sampling, generator) -> Acceptance`` replaces the
engine's rule (:func:`~drafttrain.verify.acceptance.accept`) for this proposer's trees (SSSD's
membership rule, MCSD's target-initialized rule, MTAD's joint-likelihood rule; see
:mod:`drafttrain.verify.methods`), and ``lossless`` (default True) says whether the output keeps the
target's distribution. A rule may return ``bonus=None``: then ``commit`` gets the accepted tokens
only, with the hidden states at [root, path[:-1]], and the last accepted token is the next root.

The drafters' proposers (:func:`proposer_for` picks one):

- **ParallelSpec** (:class:`ParallelSpecProposer`): one drafter forward per step for the whole batch
  gives K + 1 per-depth distributions; the tree is the best-first top-k per depth or a static shape.
- **Medusa** heads read only f_t: the same class keeps ``hidden[-1]`` from start/commit (the feature
  whose LM-head argmax is the root/bonus token) and ``propose`` applies head k for depth k; with
  Medusa's choice list the tree is Medusa's Cartesian-product tree (``dist_index`` = head index).
- **EAGLE** (:class:`EagleProposer`) keeps a drafter KV cache (one ragged cache for the batch);
  ``draft`` runs the autoregressive tree expansion for the whole batch at once (one drafter forward
  per depth over every sequence's frontier, children = top-k / draws of each node's own distribution,
  ``draft_probs`` row per expanded node, ``dist_index`` = the parent's row); the speculative items
  never become committed.

Shape letters: P prompt length, d hidden, v vocab, K mask tokens, n tree nodes.
"""

from __future__ import annotations

import functools

from typing import Protocol, Sequence, runtime_checkable

import torch

from drafttrain.sampling import GREEDY, SamplingParams, process_logits
from drafttrain.verify.hybrid import DEFAULT_EXTRA_NODES
from drafttrain.verify.tree import (
    DraftTree,
    TreeTemplate,
    parallelspec_tree,
    parallelspec_trees_greedy,
    template_from_choices,
)


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


def drafter_kv_cache(drafter, device: torch.device | str):
    """An empty one-layer :class:`~drafttrain.verify.cache.RaggedKVCache` (0 rows, 256 slots, grown on demand)
    shaped for the drafter's decoder layer (``drafter.kv_cache_shape()``: key/value heads, head dim), in its
    dtype: the batched proposers' drafter cache."""
    from types import SimpleNamespace

    from drafttrain.verify.cache import RaggedKVCache

    n_kv, head_dim = drafter.kv_cache_shape()
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=n_kv, num_attention_heads=n_kv,
                          head_dim=head_dim, hidden_size=n_kv * head_dim)  # fmt: skip
    return RaggedKVCache(cfg, 0, 256, drafter.dtype, device)


def _reset_drafter_row(drafter, cache, slot: int, like: torch.Tensor):
    """Give ``slot`` an empty row in the drafter's one-layer :class:`~drafttrain.verify.cache.RaggedKVCache`
    (:func:`drafter_kv_cache`, created on first use, grown by rows as slots appear). Returns the cache."""
    if cache is None:
        cache = drafter_kv_cache(drafter, like.device)
    if slot >= cache.batch_size:
        cache.add_rows(slot + 1 - cache.batch_size)
    cache.valid[slot] = False
    cache.lengths[slot] = 0
    return cache


def _ragged_decode(drafter, cache, rows, xs, pos, masks, slot_ids, extra=None) -> list[torch.Tensor]:
    """One drafter-layer forward of per-row inputs over a ragged drafter cache
    (:func:`~drafttrain.verify.cache.batched_layout`, ``[B, q_max]``, each row at its own offset).

    Args:
        drafter: a drafter with ``decode`` (one decoder layer).
        cache: the one-layer :class:`~drafttrain.verify.cache.RaggedKVCache` (row = slot); grown as needed.
        rows: cache rows (slots); xs: per row [q_i, d] inputs; pos: per row [q_i] int64 positions;
        masks: per row [q_i, q_i] bool (the inputs among themselves); slot_ids: per row [q_i] int64
            cache slots they are written to (consecutive); extra: per row, per input, further
            (uncommitted) cache slots it may read, e.g. its speculative ancestors.

    Returns:
        per row the layer's hidden states [q_i, d] (pre-norm). Keys/values are written at ``slot_ids``;
        nothing is marked committed (see :func:`_commit_new_items`).
    """
    from drafttrain.verify.cache import batched_layout

    cache.ensure_capacity(max(int(s[0]) for s in slot_ids) + max(s.numel() for s in slot_ids))
    lay = batched_layout(cache, list(rows), masks, slot_ids, xs[0].dtype)
    for b, per_input in enumerate(extra or []):
        for j, anc in enumerate(per_input):
            if anc:  # the read window starts at slot 0: kv index = cache slot
                lay.mask[b, 0, int(lay.real[b][j]), torch.tensor(anc, dtype=torch.long, device=lay.mask.device)] = 0.0
    cache.set_plan(lay.plan)
    try:
        h = drafter.decode(lay.scatter(xs, 0.0), lay.mask, lay.scatter(pos), cache=cache, use_cache=True)
    finally:
        cache.set_plan(None)
    return lay.gather(h)


def _new_items_layout(drafter, cache, slots, states):
    """Inputs of one drafting forward that appends every slot's pending items (``states[i]["ids"]`` [n_i],
    ``["feats"]`` [n_i, F]), each followed by the drafter's ``draft_inputs()`` (ParallelSpec's K [MASK]
    inputs; K = 0 for EAGLE), in ParallelSpec's inference layout (:func:`drafttrain.layout.inference_layout`)
    at the row's own offset. Returns (xs, pos, masks, slot_ids, n) for :func:`_ragged_decode`."""
    extra = drafter.draft_inputs()  # [K, d]
    num_mask_tokens = extra.shape[0]
    n = [st["ids"].numel() for st in states]
    u = drafter.items(torch.cat([st["ids"] for st in states])[None], torch.cat([st["feats"] for st in states])[None])[0]
    xs, pos, masks, slot_ids = [], [], [], []
    lengths = cache.lengths[list(slots)].tolist()
    for ui, ni, past in zip(torch.split(u, n), n, lengths):
        p, m = _own_layout(ni, num_mask_tokens)
        xs.append(torch.cat([ui, extra.to(ui.dtype)]) if num_mask_tokens else ui)  # [n_i + K, d]
        pos.append((p + past).to(u.device))
        masks.append(m.to(u.device))  # [q_i, q_i] this call's own part (read only)
        slot_ids.append(past + torch.arange(ni + num_mask_tokens, device=u.device))
    return xs, pos, masks, slot_ids, n


@functools.lru_cache(maxsize=256)
def _own_layout(num_items: int, num_mask_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`drafttrain.layout.inference_layout` at ``past = 0`` as (positions [q] int64, mask [q, q] bool):
    the part of a drafting step's layout that does not depend on the cached items (positions shift by
    ``past``; the cached items are all visible), built once per (items, K). Shared: never modify."""
    from drafttrain.layout import inference_layout

    p, m = inference_layout(num_items, num_mask_tokens, dtype=torch.float32, past=0, device="cpu")
    return p[0], m[0, 0] == 0


def _commit_new_items(cache, slots, states, n) -> list[int]:
    """Mark each slot's n_i just-written items committed (their keys/values stay; anything written after
    them, [MASK] slots or speculative tree items, is not). Returns the committed counts."""
    out = []
    for slot, st, ni in zip(slots, states, n):
        past = int(cache.lengths[slot])
        cache.valid[slot, past : past + ni] = True
        cache.lengths[slot] += ni
        st["ids"] = st["feats"] = None  # consumed: the cache now holds these items
        out.append(past + ni)
    return out


class ParallelSpecProposer:
    """Drafts with any drafter exposing ``propose(next_ids [1, n], features [1, n, d], cache) -> [1, D, v]``
    (:class:`~drafttrain.drafters.parallelspec.ParallelSpecDrafter`: D = K + 1 from one forward;
    :class:`~drafttrain.drafters.medusa.MedusaDrafter`: D = K heads on the root's feature): the D
    per-depth distributions after the root, turned into a tree by
    :func:`~drafttrain.verify.tree.parallelspec_tree` (ParallelSpec Algorithm 1, Appendix A.3; with
    Medusa's choice list this is Medusa's Cartesian-product tree).

    What it hands the drafter follows the drafter's declaration (``drafter.spec``,
    :class:`~drafttrain.drafters.base.DrafterSpec`): the features of every new item (``step_input =
    "items"``) or of the last one only (``"last"``, Medusa), of the declared ``feature_layers``.
    With a drafter that declares ``batched`` (the one-decoder-layer interface: ``items``, ``decode``,
    ``logits``, ``draft_inputs``, ``kv_cache_shape``) and ``batched=True`` the drafter runs **one
    forward per step for the whole batch**: every sequence's new items + its ``draft_inputs()`` (K mask
    inputs) in a ``[B, q_max]`` layout over a one-layer
    :class:`~drafttrain.verify.cache.RaggedKVCache` (each sequence at its own offset; the mask
    slots' keys/values are written but never committed, which is ``propose``'s crop). Otherwise it
    calls ``propose`` once per sequence, each with its own ``DynamicCache``.

    Args:
        drafter: the drafter (eval mode is set here).
        widths: candidates per depth (default: a chain, one per depth for all D depths; with ``choices``:
            as wide as the choice list asks, up to depth D).
        budget: maximum tree nodes (default: one per depth; with ``choices``: the list's length).
        choices: optional static shape (a Medusa-style choice list) instead of the best-first shape.
        batched: use the batched path when the drafter supports it.
        fast_greedy: under greedy decoding on the batched path, build the trees from the draft
            vocabulary in one batched top-k (:func:`~drafttrain.verify.tree.parallelspec_trees_greedy`;
            same trees). False: the per-sequence full-vocabulary path (the reference; sampling always uses it).
    """

    name = "parallelspec"

    def __init__(
        self,
        drafter,
        widths: Sequence[int] | None = None,
        budget: int | None = None,
        choices: Sequence[Sequence[int]] | None = None,
        batched: bool = True,
        fast_greedy: bool = True,
    ):
        self.drafter = drafter.eval()
        spec = drafter.spec
        self.feature_layers = tuple(drafter.feature_layers)  # the engine hands start/commit these layers
        self.last_only = spec.step_input == "last"  # Medusa: the heads read the last feature only
        self.depth = depth = int(drafter.draft_depth)  # rows of one propose call (ParallelSpec K + 1, Medusa K heads)
        self.fast_greedy = bool(fast_greedy)
        self.template: TreeTemplate | None = template_from_choices(choices) if choices is not None else None
        if widths is None and self.template is not None:  # a static shape: as wide as it asks, as deep as the drafter
            widths = [1 + max((r[t] for r in self.template.ranks if len(r) > t), default=-1) for t in range(depth)]
            widths = [w for w in widths if w > 0]
        self.widths = list(widths) if widths is not None else [1] * depth
        if budget is None:
            budget = self.template.n if self.template is not None else len(self.widths)
        self.budget = int(budget)
        self.batched = bool(batched) and spec.batched
        self._state: dict[int, dict] = {}
        self._cache = None  # batched path: one-layer RaggedKVCache, row = slot

    # -- protocol -------------------------------------------------------------------------------
    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        prompt_ids = list(prompt_ids)
        ids = torch.tensor(prompt_ids[1:] + [int(first_token)], dtype=torch.long, device=hidden.device)
        if self.last_only:
            ids, hidden = ids[-1:], hidden[-1:]
        st = {"ids": ids, "feats": hidden}  # [P], [P, F]: the prompt's items (F = the declared features' width)
        if self.batched:
            self._reset_row(slot, hidden)
        else:
            from transformers import DynamicCache

            st["cache"] = DynamicCache()
        self._state[slot] = st

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        if sampling.greedy and self.batched and self.fast_greedy:  # draft vocabulary, batched top-k, cached shapes
            lg = self._draft_logits_batched(slots, full_vocab=False)  # [B, K + 1, N]
            d2t = self.drafter.draft_token_ids if getattr(self.drafter, "restricted_vocab", False) else None
            return parallelspec_trees_greedy(lg, self.widths, self.budget, self.template, d2t)
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
        st["feats"] = hidden  # [m + 1, F]
        if self.last_only:
            st["ids"], st["feats"] = st["ids"][-1:], st["feats"][-1:]

    def release(self, slot) -> None:
        self._state.pop(slot, None)

    # -- drafting -------------------------------------------------------------------------------
    def _draft_logits_one(self, slot) -> torch.Tensor:
        st = self._state[slot]
        out = self.drafter.propose(st["ids"][None], st["feats"][None], st["cache"])[0]  # [K + 1, v]
        st["ids"] = st["feats"] = None  # consumed: the drafter cache now holds these items
        return out

    def _reset_row(self, slot: int, like: torch.Tensor) -> None:
        self._cache = _reset_drafter_row(self.drafter, self._cache, slot, like)

    @torch.no_grad()
    def _draft_logits_batched(self, slots, full_vocab: bool = True):
        """One drafter forward for all ``slots``: items + K masks each, ParallelSpec's inference layout
        (:func:`drafttrain.layout.inference_layout`) at each sequence's own cache offset. Returns per slot
        [K + 1, v] logits (``full_vocab``), else one [B, K + 1, N] tensor over the draft vocabulary."""
        d, cache = self.drafter, self._cache
        sts = [self._state[s] for s in slots]
        xs, pos, masks, slot_ids, n = _new_items_layout(d, cache, slots, sts)
        hs = _ragged_decode(d, cache, slots, xs, pos, masks, slot_ids)
        last = torch.stack([hi[ni - 1 :] for hi, ni in zip(hs, n)])  # [B, K + 1, d]: anchor + K mask slots
        logits = d.logits(last)  # [B, K + 1, N]
        _commit_new_items(cache, slots, sts, n)  # the items, not the mask slots (propose's crop)
        return list(d.full_vocab_logits(logits)) if full_vocab else logits


class EagleProposer:
    """EAGLE's autoregressive tree drafting (Li et al. 2024, "EAGLE", section 4.3 and its static tree).

    Each step first appends the slot's new items (accepted tokens + bonus with the target's true
    features) to the drafter's KV cache; the last item's output is the root's distribution and
    predicted feature. The tree then grows **one drafter forward per depth**: every node of the
    previous depth that has children in the template becomes an item (its token, the predicted feature
    of the item that drafted it), all of them in one forward with tree attention (each sees the
    committed items, its own ancestors and itself, at position = root position + depth); a node's
    children are the first m candidates of *its own* distribution (top-m under greedy; m draws without
    replacement from the processed distribution under sampling). So, unlike Medusa/ParallelSpec trees,
    the candidates below a node are conditioned on the node's token. The speculative items never
    become committed: after drafting the cache holds exactly the committed items again.

    Lossless under sampling: every node's children are successive draws without replacement from the
    row ``draft_probs[dist_index]`` (the parent's own distribution) and the shape is the template's,
    trimmed only where a distribution's support is smaller than the width (a property of the
    distribution, not of the draws), which is what
    :func:`~drafttrain.verify.acceptance.speculative_sampling_tree` needs.

    Batching (``batched=True``, the default): the whole batch drafts together, so a step costs
    1 + (tree depth - 1) drafter forwards whatever the batch size: one forward appends every
    sequence's new items, then one forward per depth carries every sequence's frontier. The drafter
    keeps one one-layer :class:`~drafttrain.verify.cache.RaggedKVCache` (row = slot, each row at its
    own length, as the target's cache in the engine); each sequence's inputs are laid out ``[B, q_max]``
    with its own tree mask (committed slots + its ancestors' speculative slots + itself). Speculative
    items are written after the row's committed slots but never marked valid, and the next step's
    items overwrite them: nothing to crop. ``batched=False`` drafts one sequence after another, each
    with its own ``DynamicCache`` (the reference the batched path is tested against: same trees; under
    sampling the same draws, since both visit sequences and depths in the same order).

    Args:
        drafter: an EAGLE drafter (``draft_step``, ``items``, ``forward_inputs``, ``full_vocab_logits``,
            ``draft_depth``); eval mode is set here.
        choices: static tree shape (a Medusa-style rank-tuple list such as
            :data:`~drafttrain.verify.tree.EAGLE_DEFAULT_CHOICES`); default: a chain of the drafter's
            ``draft_depth`` (the drafter's :meth:`propose`, verified as a chain).
        budget: keep only the first ``budget`` nodes of the template in (depth, ranks) order (with
            ``widths``: of the dynamic tree, by value).
        widths: without ``choices``: under greedy decoding, EAGLE-2's dynamic tree (:class:`_DynamicTree`):
            ``len(widths)`` depths, the ``expand`` most confident nodes of each depth get ``widths[t - 1]``
            children, the ``budget`` most confident nodes are kept (default budget: sum of widths). Under
            sampling (where a shape chosen by the drawn tokens' probabilities would bias the rule): the
            static tree where every node at depth t has ``widths[t - 1]`` children, cut to ``budget``.
        expand: nodes expanded per depth in the dynamic tree (default ``widths[0]``).
        batched: draft the whole batch in shared forwards (see above).

    Raises:
        ValueError: a bad choice list (see :func:`~drafttrain.verify.tree.template_from_choices`).
    """

    name = "autoregressive"  # proposer_for names it after its drafter

    def __init__(self, drafter, choices: Sequence[Sequence[int]] | None = None, budget: int | None = None,
                 widths: Sequence[int] | None = None, expand: int | None = None, batched: bool = True):  # fmt: skip
        import itertools

        from drafttrain.verify.tree import chain_template

        self.drafter = drafter.eval()
        self.feature_layers = tuple(drafter.feature_layers)  # the engine hands start/commit these layers
        self.dynamic = choices is None and widths is not None
        if self.dynamic:
            self.widths = [int(w) for w in widths]
            if not self.widths or min(self.widths) < 1:
                raise ValueError(f"widths must be positive ints, got {list(widths)}")
            self.expand = int(expand) if expand is not None else self.widths[0]
            self.budget = int(budget) if budget is not None else sum(self.widths)
            if self.expand < 1 or self.budget < 1:
                raise ValueError("expand and budget must be >= 1")
            # under sampling: the static tree where every node at depth t gets widths[t - 1] children
            choices = [r for t in range(1, len(widths) + 1) for r in itertools.product(*(range(w) for w in widths[:t]))]
        tpl = template_from_choices(choices) if choices is not None else chain_template(int(drafter.draft_depth))
        if budget is not None and budget < tpl.n:
            tpl = template_from_choices(tpl.ranks[: max(int(budget), 0)])  # a (depth, ranks) prefix is a tree
        self.template = tpl
        self._parents = tpl.parents.tolist()
        self._depth = [len(r) for r in tpl.ranks]
        self._kids: list[list[int]] = [[] for _ in range(tpl.n + 1)]  # entry 0: the root's children
        for i, p in enumerate(self._parents):
            self._kids[p + 1].append(i)
        self.batched = bool(batched)
        self._state: dict[int, dict] = {}
        self._cache = None  # batched: one-layer RaggedKVCache, row = slot

    # -- protocol -------------------------------------------------------------------------------
    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        ids = torch.tensor(list(prompt_ids)[1:] + [int(first_token)], dtype=torch.long, device=hidden.device)
        st = {"ids": ids, "feats": hidden}
        if self.batched:
            self._cache = _reset_drafter_row(self.drafter, self._cache, slot, hidden)
        else:
            from transformers import DynamicCache

            st["cache"] = DynamicCache()
        self._state[slot] = st

    @torch.no_grad()
    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        slots = list(slots)
        if not slots:
            return []
        if self.batched:
            roots = self._append_batched(slots)
        else:
            roots = [self._append_items(self._state[s]) for s in slots]
        build = _DynamicTree if self.dynamic and sampling.greedy else _StaticTree
        trees = [build(self, lg, f, sampling, generator) for lg, f, _ in roots]
        committed = [c for _, _, c in roots]
        spec = [0] * len(slots)  # speculative items written per sequence
        while True:
            reqs = [t.request() for t in trees]  # each sequence's next depth: (tokens, feats, ancestors, depth)
            live = [i for i, r in enumerate(reqs) if r is not None]
            if not live:
                break
            if self.batched:
                outs = self._forward_levels_batched([slots[i] for i in live], [reqs[i] for i in live],
                                                    [committed[i] for i in live], [spec[i] for i in live])  # fmt: skip
            else:
                outs = [self._forward_level(self._state[slots[i]]["cache"], committed[i], spec[i], *reqs[i]) for i in live]
            for i, (lg, fo) in zip(live, outs):
                trees[i].absorb(lg, fo, committed[i] + spec[i])
                spec[i] += len(reqs[i][0])
        if not self.batched:
            for s, n in zip(slots, spec):
                if n:
                    self._state[s]["cache"].crop(-n)
        return [t.tree() for t in trees]

    def commit(self, slot, tokens, hidden) -> None:
        st = self._state[slot]
        st["ids"] = torch.tensor(list(tokens), dtype=torch.long, device=hidden.device)
        st["feats"] = hidden

    def release(self, slot) -> None:
        self._state.pop(slot, None)

    def committed_length(self, slot: int) -> int:
        """Items in ``slot``'s drafter KV cache (= the committed items: speculative ones never count)."""
        if self.batched:
            return int(self._cache.lengths[slot])
        return self._state[slot]["cache"].get_seq_length()

    # -- drafting: one sequence, its own DynamicCache -------------------------------------------
    def _append_items(self, st: dict):
        """Feed the slot's pending items into its drafter cache. Returns (root logits [N] over the draft
        vocabulary, root predicted feature [d], committed item count)."""
        from drafttrain import layout as L

        d, cache = self.drafter, st["cache"]
        device = st["feats"].device
        past, n_new = cache.get_seq_length(), st["ids"].numel()
        pos, mask = L.inference_layout(n_new, 0, dtype=d.dtype, past=past, device=device)
        logits, f = d.draft_step(st["ids"][None], st["feats"][None], pos, mask, cache)
        st["ids"] = st["feats"] = None  # consumed: the cache now holds these items
        return logits[0, -1], f[0, -1], past + n_new

    def _forward_level(self, cache, committed: int, spec: int, tokens, feats, ancestors, depth: int):
        """One drafter forward over q speculative items at one depth, with tree attention.

        Args:
            tokens: q token ids; feats: [q, d] the predicted feature each item reads (its parent's output);
            ancestors: per item, the drafter-cache indices of its speculative ancestors' items;
            committed / spec: committed items / speculative items already in ``cache``; depth: t.

        Returns:
            (logits [q, N], predicted features [q, d]); the q items are appended to ``cache`` at
            indices committed + spec + j.
        """
        from drafttrain import layout as L

        d = self.drafter
        q = len(tokens)
        allowed = torch.zeros(q, committed + spec + q, dtype=torch.bool)
        allowed[:, :committed] = True
        for j, anc in enumerate(ancestors):
            allowed[j, list(anc)] = True
            allowed[j, committed + spec + j] = True
        device = feats.device
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
        pos = torch.full((1, q), committed - 1 + depth, dtype=torch.long, device=device)
        mask = L.additive_mask(allowed, d.dtype)[None, None].to(device)
        lg, fo = d.draft_step(ids, feats[None], pos, mask, cache)
        return lg[0], fo[0]

    # -- drafting: the whole batch, one RaggedKVCache ---------------------------------------------
    def _ragged_forward(self, rows, xs, pos, masks, slot_ids, extra=None):
        """:func:`_ragged_decode` + EAGLE's head: per row (logits [q_i, N] float32, predicted features [q_i, d])."""
        d = self.drafter
        hs = _ragged_decode(d, self._cache, rows, xs, pos, masks, slot_ids, extra)
        f = d.predict_features(torch.cat(hs))  # one head matmul for the batch (the head's weight is read once)
        q = [h.shape[0] for h in hs]
        return list(zip(torch.split(d.vocab_logits(f), q), torch.split(f, q)))

    def _append_batched(self, slots):
        """Every slot's pending items in one forward; they become committed. Returns per slot
        (root logits [N], root predicted feature [d], committed item count)."""
        sts = [self._state[s] for s in slots]
        d = self.drafter
        xs, pos, masks, slot_ids, n = _new_items_layout(d, self._cache, slots, sts)
        hs = _ragged_decode(d, self._cache, slots, xs, pos, masks, slot_ids)
        f = d.predict_features(torch.stack([h[-1] for h in hs]))  # [B, d]: only the last item drafts
        lg = d.vocab_logits(f)  # [B, N]
        committed = _commit_new_items(self._cache, slots, sts, n)
        return list(zip(lg, f, committed))

    def _forward_levels_batched(self, slots, reqs, committed, spec):
        """One forward over every listed slot's next depth (``reqs[i]`` = (tokens, feats [q_i, d],
        ancestors, depth)); slot i's items go to cache slots committed[i] + spec[i] + j and see the
        committed items, their ancestors and themselves. Returns per slot (logits [q_i, N], f^ [q_i, d])."""
        d = self.drafter
        q = [len(r[0]) for r in reqs]
        device = reqs[0][1].device
        ids = torch.tensor([t for r in reqs for t in r[0]], dtype=torch.long, device=device)
        u = d.items(ids[None], torch.cat([r[1] for r in reqs])[None])[0]
        pos = [torch.full((qi,), c - 1 + r[3], dtype=torch.long, device=device) for qi, c, r in zip(q, committed, reqs)]
        masks = [torch.eye(qi, dtype=torch.bool, device=device) for qi in q]  # same-depth nodes never see each other
        slot_ids = [c + s + torch.arange(qi, device=device) for c, s, qi in zip(committed, spec, q)]
        return self._ragged_forward(slots, list(torch.split(u, q)), pos, masks, slot_ids, [r[2] for r in reqs])

    def _probs(self, lg: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """[..., N] draft-vocabulary logits -> [..., v] probabilities (softmax under greedy, processed under sampling)."""
        full = self.drafter.full_vocab_logits(lg)
        return torch.softmax(full.float(), dim=-1) if sampling.greedy else process_logits(full, sampling)


class _StaticTree:
    """One sequence's tree of an :class:`EagleProposer` template, grown one depth per :meth:`request`.

    ``request()`` fills the next depth's tokens from their parents' rows (top-m or m draws without
    replacement) and returns the items to feed, (tokens, feats [q, d], ancestor cache slots, depth), or
    None when done; ``absorb(logits, feats, first_slot)`` takes that forward's outputs (each expanded
    node's own distribution becomes a row); ``tree()`` returns the :class:`DraftTree`.
    """

    def __init__(self, prop: EagleProposer, root_lg, root_f, sampling: SamplingParams, generator):
        self.p, self.sampling, self.generator = prop, sampling, generator
        self.rows = [prop._probs(root_lg, sampling)]  # row 0: the root's distribution
        self.row_feat = [root_f]  # predicted feature that goes with each row's children
        self.tokens: list[int | None] = [None] * prop.template.n
        self.own_row: dict[int, int] = {}  # expanded node -> its row
        self.cache_index: dict[int, int] = {}  # expanded node -> its item's slot in the drafter cache
        self.depth, self.done, self.expand = 0, False, []

    def request(self):
        from drafttrain.verify.tree import draft_candidates

        p = self.p
        if self.done or self.depth >= p.template.max_depth:
            self.done = True
            return None
        self.depth += 1
        level = [i for i in range(p.template.n) if p._depth[i] == self.depth]
        for parent in dict.fromkeys(p._parents[i] for i in level):  # fill this depth's tokens
            row = 0 if parent < 0 else self.own_row.get(parent)
            if row is None:
                continue  # parent was dropped (a distribution with a small support)
            kids = p._kids[parent + 1]
            cands = draft_candidates(self.rows[row], len(kids), not self.sampling.greedy, self.generator).tolist()
            for c in kids:
                r = p.template.ranks[c][-1]
                if r < len(cands):
                    self.tokens[c] = cands[r]
        self.expand = [i for i in level if self.tokens[i] is not None and p._kids[i + 1]]
        if not self.expand:
            self.done = True
            return None
        feats = torch.stack([self.row_feat[self._row_of_parent(i)] for i in self.expand])
        ancestors = [self._ancestor_slots(i) for i in self.expand]
        return [self.tokens[i] for i in self.expand], feats, ancestors, self.depth

    def absorb(self, lg: torch.Tensor, fo: torch.Tensor, first_slot: int) -> None:
        probs = self.p._probs(lg, self.sampling)
        for j, i in enumerate(self.expand):
            self.own_row[i] = len(self.rows)
            self.cache_index[i] = first_slot + j
            self.rows.append(probs[j])
            self.row_feat.append(fo[j])

    def _row_of_parent(self, i: int) -> int:
        par = self.p._parents[i]
        return 0 if par < 0 else self.own_row[par]

    def _ancestor_slots(self, i: int) -> list[int]:
        out, a = [], self.p._parents[i]
        while a >= 0:
            out.append(self.cache_index[a])
            a = self.p._parents[a]
        return out

    def tree(self) -> DraftTree:
        p = self.p
        keep = [i for i in range(p.template.n) if self.tokens[i] is not None]  # ancestor-closed
        new_index = {i: j for j, i in enumerate(keep)}
        parents = torch.tensor([new_index[p._parents[i]] if p._parents[i] >= 0 else -1 for i in keep],
                               dtype=torch.long, device="cpu")  # a DraftTree lives on the host  # fmt: skip
        toks = torch.tensor([self.tokens[i] for i in keep], dtype=torch.long, device="cpu")
        if self.sampling.greedy:
            return DraftTree(toks, parents)
        dist = [self._row_of_parent(i) for i in keep]
        return DraftTree(toks, parents, torch.stack(self.rows), torch.tensor(dist, device="cpu"))


class _DynamicTree:
    """EAGLE-2's context-aware dynamic tree (Li et al. 2024, "EAGLE-2", section 4), greedy only; same
    ``request`` / ``absorb`` / ``tree`` steps as :class:`_StaticTree`.

    A node's value is its path's draft confidence (product of the drafter's probabilities along it).
    Expansion: at each depth t the ``expand`` most valuable nodes of that depth are fed to the drafter
    (one forward) and each gets its top ``widths[t]`` children; after ``len(widths)`` depths the
    ``budget`` most valuable nodes of the whole tree are kept (reranking). A child is never worth more
    than its parent, so the kept set is ancestor-closed (ties go to the shallower node).
    """

    def __init__(self, prop: EagleProposer, root_lg, root_f, sampling: SamplingParams, generator):
        self.p = prop
        self.toks, self.parents, self.values, self.depths = [], [], [], []  # nodes in depth order
        top = torch.topk(prop._probs(root_lg, GREEDY), prop.widths[0])
        for v, t in zip(top.values.tolist(), top.indices.tolist()):
            self._add(t, -1, v, 1)
        self.feat = {-1: root_f}  # expanded node -> its predicted feature (the root's: -1)
        self.cache_index: dict[int, int] = {}
        self.depth, self.expand = 0, []

    def _add(self, tok: int, parent: int, value: float, depth: int) -> None:
        self.toks.append(tok), self.parents.append(parent), self.values.append(value), self.depths.append(depth)

    def request(self):
        self.depth += 1
        if self.depth >= len(self.p.widths):
            return None
        level = [i for i in range(len(self.toks)) if self.depths[i] == self.depth]
        self.expand = sorted(level, key=lambda i: -self.values[i])[: self.p.expand]
        feats = torch.stack([self.feat[self.parents[i]] for i in self.expand])
        ancestors = []
        for i in self.expand:
            a, lst = self.parents[i], []
            while a >= 0:
                lst.append(self.cache_index[a])
                a = self.parents[a]
            ancestors.append(lst)
        return [self.toks[i] for i in self.expand], feats, ancestors, self.depth

    def absorb(self, lg: torch.Tensor, fo: torch.Tensor, first_slot: int) -> None:
        top = torch.topk(self.p._probs(lg, GREEDY), self.p.widths[self.depth], dim=-1)
        for j, i in enumerate(self.expand):
            self.cache_index[i] = first_slot + j
            self.feat[i] = fo[j]
            for v, t in zip(top.values[j].tolist(), top.indices[j].tolist()):
                self._add(t, i, self.values[i] * v, self.depth + 1)

    def tree(self) -> DraftTree:
        n = len(self.toks)
        keep = sorted(range(n), key=lambda i: (-self.values[i], self.depths[i], i))[: self.p.budget]
        keep.sort(key=lambda i: (self.depths[i], i))  # parents first
        new_index = {i: j for j, i in enumerate(keep)}
        assert all(self.parents[i] < 0 or self.parents[i] in new_index for i in keep), "reranked tree is not ancestor-closed"
        return DraftTree(torch.tensor([self.toks[i] for i in keep], dtype=torch.long, device="cpu"),
                         torch.tensor([new_index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
                                      dtype=torch.long, device="cpu"),
                         scores=torch.tensor([self.values[i] for i in keep], dtype=torch.float32,
                                             device="cpu"))  # fmt: skip


def proposer_for(drafter, widths: Sequence[int] | None = None, budget: int | None = None,
                 choices: Sequence[Sequence[int]] | None = None, batched: bool = True, plan: bool = False,
                 sssd=None, sssd_nodes: int = DEFAULT_EXTRA_NODES):  # fmt: skip
    """The proposer that drafts the way ``drafter`` declares (``drafter.spec.drafting``,
    :class:`~drafttrain.drafters.base.DrafterSpec`).

    - ``"autoregressive"`` (EAGLE): :class:`EagleProposer` (a tree grown one drafter forward per depth;
      ``choices`` static shape, or ``widths`` children per node at each depth, default a chain of
      ``draft_depth``). The drafter implements the one-decoder-layer interface (``draft_step``, ...).
    - ``"parallel"`` (ParallelSpec in both integrations, Medusa, any ``propose`` drafter):
      :class:`ParallelSpecProposer`, whose trees come from one set of per-depth distributions (the
      K + 1 slots of one ParallelSpec forward, or the K Medusa heads on the root's feature: Medusa's
      Cartesian-product tree when ``choices`` is its choice list).

    ``batched``: draft the whole batch in shared drafter forwards where the drafter declares it can
    (``spec.batched``; False: one sequence at a time).
    ``plan``: wrap it in a :class:`~drafttrain.verify.planner.PlannedProposer`: every step verifies only
    the nodes whose expected gain pays for their measured cost, and drafting pauses while it does not
    pay (lossless; SSSD §3.2's planner, online).
    ``sssd``: an :class:`~drafttrain.verify.methods.sssd.SSSDDrafter` whose training-free candidates (up to
    ``sssd_nodes`` per tree) are merged into the drafter's trees under greedy decoding
    (:class:`~drafttrain.verify.hybrid.HybridProposer`; inside the planner when ``plan``).

    Returns:
        a :class:`Proposer` whose ``name`` is the drafter's (``+sssd`` with ``sssd``) and whose
        ``feature_layers`` are the drafter's.
    """
    if drafter.spec.drafting == "autoregressive":
        prop = EagleProposer(drafter, choices=choices, budget=budget, widths=widths, batched=batched)
    else:
        prop = ParallelSpecProposer(drafter, widths=widths, budget=budget, choices=choices, batched=batched)
    prop.name = drafter.name
    if sssd is not None:
        from drafttrain.verify.hybrid import HybridProposer

        prop = HybridProposer(prop, sssd, sssd_nodes)
    if plan:
        from drafttrain.verify.planner import PlannedProposer

        prop = PlannedProposer(prop)
    return prop
