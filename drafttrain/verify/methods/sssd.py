"""SSSD: training-free drafting from the input and a datastore, membership acceptance, and the
speculation-length planner.

Source: Marzollo et al., "SSSD: Simply-Scalable Speculative Decoding".

Drafting (§3.1). Two sources of n-gram continuations of the recent context:

- **input** (§3.1.1): the prompt and the sequence's own output, "treated as a single input
  sequence", stored in one :class:`InputTrie` per sequence that is *updated continuously* (append-only)
  as tokens are accepted. "When searching for continuations for a prefix of size P, we construct a
  distinct candidate tree for each prefix of size 1 to P. The weights of the branches in the trees
  are the number of occurrences of the corresponding sequence in the input."
- **datastore** (§3.1.2): a suffix array over the training data
  (:class:`~drafttrain.verify.methods.sssd_datastore.Datastore`), at most N strided continuations per match,
  shorter prefixes added until a threshold is met, continuations "merged by summing the occurrences
  along the tree edges".

Fusion (§3.1.3). Every candidate path pi below the root gets a pseudo-probability
``p = occurrences(prefix + pi) / occurrences(prefix)`` ("the number of occurrences of the complete
sequence ... by the number of occurrences of the prefix alone"), then a weight:

    score = p * scale_source * depth_damp_source ** (depth - 1) * match_damp_source ** (P - L)

with ``scale_input`` the input-source scaling ("input-based estimates tend to be overconfident ...
a scaling factor is applied to tokens coming from the input") and the damping "according to the size
of the prefix match [L] and the depth of the specific candidate in the tree". The paper's Algorithm 1
is not in our copy of the text; our reading: the trees of all sources and prefix lengths are merged
into one trie whose node score is the **max** (``combine="max"``, default) or the **sum**
(``combine="sum"``) of the scores the node gets in each tree, and the candidate tree is the
``node_budget`` best nodes taken best-first from the root (so it is ancestor-closed by construction),
at most ``max_depth`` deep. Weights come from ``scripts/sssd_grid.py`` ("good weights can be
identified through a simple grid search ... to simulate the LLM inference process").

For the input source, the occurrence of the prefix at the very end of the context has no continuation
yet, so its denominator is ``occurrences(prefix) - 1`` (= the summed counts of its children). For the
datastore the denominator is the number of sampled occurrences.

Acceptance (§4.2): "greedily choosing the candidate tokens with the highest probability, then sampling
from the target model distribution, and finally checking if the sampled token is present in the
candidates" — :func:`membership_accept`. Every emitted token is drawn from the target's own conditional
at its own prefix, so the rule is lossless (sampling and greedy alike).

Planner (§3.2): the end-to-end speedup is "the algorithmic acceleration [tokens per forward] divided by
the increase in cost [forward time]"; :func:`plan_speculation_length` picks the tree size maximising
expected tokens/s for a batch size from a measured forward-time table.

Tree contract (shared with :mod:`drafttrain.verify`): ``tokens`` [n] candidate ids (root excluded; the
root is the last committed token), ``parents`` [n] (-1 = child of the root, else an index < i).

In the engine and the harness: :class:`SSSDProposer` (drafting + membership rule, lossless) and the
``sssd`` method (``python -m scripts.evaluate methods=[sssd]``, section ``sssd.*`` =
:class:`SSSDEvalConfig`; the tree size per batch size from :func:`plan_sssd_budget`, or fixed sizes).

Shape letters: b batch, n tree nodes, v vocabulary, P max prefix length, D max depth, N samples.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from drafttrain.config import SSSDEvalConfig  # the one SSSD evaluation section (sssd.*, trainer.spec_eval.sssd.*)
from drafttrain.sampling import GREEDY
from drafttrain.verify.acceptance import Acceptance, target_rows
from drafttrain.verify.methods.registry import Method, MethodContext, Variant, register
from drafttrain.verify.methods.sssd_datastore import Datastore, DatastoreMatch
from drafttrain.verify.tree import DraftTree

Path_ = tuple[int, ...]


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclass
class SSSDConfig:
    """SSSD drafting parameters (SSSD §3.1). Names in parentheses are the paper's.

    Attributes:
        max_prefix_len: P, longest context suffix looked up (input and datastore).
        min_prefix_len: shortest one.
        max_depth: D, deepest candidate below the root (tokens of continuation read).
        node_budget: n, candidate nodes per tree (root excluded); speculation length = n + 1.
        max_samples: N, strided datastore samples per matched prefix length ("usually 100").
        min_continuations: datastore threshold: shorter prefixes are searched while fewer occurrences
            than this have been gathered.
        input_scale, datastore_scale: source scaling of pseudo-probabilities (> 0).
        input_depth_damp, datastore_depth_damp: factor per level below depth 1, in (0, 1].
        input_match_damp, datastore_match_damp: factor per token the match is shorter than P, in (0, 1].
        combine: ``"max"`` or ``"sum"``: how one node's scores from several trees are fused.
        min_score: nodes scoring below this are left out (0 = fill the budget whenever possible).
        use_input, use_datastore: switch a source off (ablations of §4.1).
    """

    max_prefix_len: int = 6
    min_prefix_len: int = 1
    max_depth: int = 8
    node_budget: int = 32
    max_samples: int = 100
    min_continuations: int = 20
    # weights: the best point of the ShareGPT grid (docs/benchmarks/sssd_grid.md); the grid was flat
    # (simulated τ 2.19-2.28 over 96 points), so they are a reasonable start, not a law
    input_scale: float = 1.0
    input_depth_damp: float = 0.7
    input_match_damp: float = 0.7
    datastore_scale: float = 1.0
    datastore_depth_damp: float = 0.7
    datastore_match_damp: float = 1.0
    combine: str = "max"
    min_score: float = 0.0
    use_input: bool = True
    use_datastore: bool = True

    def validate(self) -> SSSDConfig:
        """Check ranges; returns self. Raises ValueError naming every bad field."""
        problems = []
        if not 1 <= self.min_prefix_len <= self.max_prefix_len:
            problems.append("need 1 <= min_prefix_len <= max_prefix_len")
        if self.max_depth < 1:
            problems.append("max_depth must be >= 1")
        if self.node_budget < 0:
            problems.append("node_budget must be >= 0")
        if self.max_samples < 1 or self.min_continuations < 1:
            problems.append("max_samples and min_continuations must be >= 1")
        for name in ("input_scale", "datastore_scale"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        for name in ("input_depth_damp", "input_match_damp", "datastore_depth_damp", "datastore_match_damp"):
            if not 0 < getattr(self, name) <= 1:
                problems.append(f"{name} must be in (0, 1]")
        if self.combine not in ("max", "sum"):
            problems.append("combine must be 'max' or 'sum'")
        if problems:
            raise ValueError("invalid SSSDConfig: " + "; ".join(problems))
        return self


# ---------------------------------------------------------------------------------------------
# the input source: one append-only n-gram trie per sequence (§3.1.1)
# ---------------------------------------------------------------------------------------------
class InputTrie:
    """Occurrence counts of every n-gram (n <= ``max_ngram``) of one growing token sequence.

    A node is ``[count, children]`` with ``children: dict[token, node]``; the node reached from the
    root by n-gram g holds the number of positions where g occurs. :meth:`extend` costs
    O(``max_ngram``) dict operations per token (it keeps the nodes of the suffixes ending at the last
    token), so updating with accepted tokens is cheap and never rebuilds.

    Args:
        max_ngram: longest n-gram counted (SSSD drafting needs P + D).
        tokens: initial tokens (the prompt).
    """

    def __init__(self, max_ngram: int, tokens: Iterable[int] = ()):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.root: list = [0, {}]
        self.tokens: list[int] = []
        self._active: list[list] = []  # nodes of the suffixes of length 1..max_ngram-1 ending at the last token
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (e.g. the ones just accepted) and count the n-grams ending at each."""
        limit = self.max_ngram - 1
        for x in tokens:
            x = int(x)
            new_active = []
            for parent in itertools.chain((self.root,), self._active):
                child = parent[1].get(x)
                if child is None:
                    child = parent[1][x] = [0, {}]
                child[0] += 1
                new_active.append(child)
            self.root[0] += 1
            self.tokens.append(x)
            self._active = new_active[:limit]

    def node(self, ngram: Sequence[int]) -> list | None:
        """The node of ``ngram`` (len <= max_ngram), or None if it never occurs."""
        node = self.root
        for x in ngram:
            node = node[1].get(int(x))
            if node is None:
                return None
        return node

    def count(self, ngram: Sequence[int]) -> int:
        """Occurrences of ``ngram`` in the tokens so far (overlapping occurrences count)."""
        if len(ngram) > self.max_ngram:
            raise ValueError(f"n-gram longer than max_ngram={self.max_ngram}")
        node = self.node(ngram)
        return 0 if node is None else node[0]

    def __len__(self) -> int:
        return len(self.tokens)


def _best_first_trie(children: dict, denom: float, weights: list[float], budget: int) -> list[tuple[Path_, float]]:
    """Top-``budget`` paths of a count trie by score = count / denom * weights[depth - 1], best first.

    ``weights`` is non-increasing and counts do not grow along a path, so a child never outranks its
    parent and the result is ancestor-closed. Paths are at most ``len(weights)`` deep.
    """
    if budget <= 0 or denom <= 0:
        return []
    tie = itertools.count()
    heap = [(-node[0] / denom * weights[0], next(tie), (tok,), node) for tok, node in children.items()]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < budget:
        neg, _, path, node = heapq.heappop(heap)
        out.append((path, -neg))
        depth = len(path)
        if depth < len(weights):
            w = weights[depth] / denom
            for tok, child in node[1].items():
                heapq.heappush(heap, (-child[0] * w, next(tie), path + (tok,), child))
    return out


def _datastore_paths_batch(
    matches: Sequence[DatastoreMatch], weights: Sequence[Sequence[float]], budgets: Sequence[int]
) -> list[list[tuple[Path_, float]]]:
    """Top paths of every sequence's datastore continuation tree, vectorised over the whole batch.

    The tree of sequence j merges its sampled continuations by summing counts along edges; a path's
    pseudo-probability is (samples whose continuation starts with it) / (all samples of j), its score
    that times ``weights[j][depth - 1]``. One ``np.unique`` per depth serves all sequences (node ids
    are global, the root of sequence j has id j). Per sequence the ``budgets[j]`` best nodes are kept,
    best first, ties to the shallower node: counts and weights do not grow along a path, so the
    selection is ancestor-closed.

    Returns:
        one ``[(path, score)]`` list per sequence, parents before children.
    """
    b = len(matches)
    out: list[list[tuple[Path_, float]]] = [[] for _ in range(b)]
    depth_max = len(weights[0]) if b else 0
    conts = [m.continuations[:, :depth_max] for m in matches]
    sizes = np.array([c.shape[0] for c in conts], dtype=np.int64)
    if b == 0 or sizes.sum() == 0:
        return out
    cont = np.concatenate(conts)  # [M, D]
    base = int(max(cont.max(), 0)) + 1
    prev = np.repeat(np.arange(b, dtype=np.int64), sizes)  # node id per sample row (root of its sequence)
    parent_l = [np.full(b, -1, np.int64)]
    token_l = [np.full(b, -1, np.int64)]
    count_l = [sizes]
    depth_l = [np.zeros(b, np.int64)]
    seq_l = [np.arange(b, dtype=np.int64)]
    seq_of = seq_l[0]
    next_id = b
    for d in range(cont.shape[1]):
        tok = cont[:, d]
        alive = (tok >= 0) & (prev >= 0)
        if not alive.any():
            break
        uniq, inv, cnt = np.unique(prev[alive] * base + tok[alive], return_inverse=True, return_counts=True)
        par = uniq // base
        parent_l.append(par)
        token_l.append(uniq % base)
        count_l.append(cnt)
        depth_l.append(np.full(uniq.size, d + 1, np.int64))
        seq_l.append(seq_of[par])
        seq_of = np.concatenate([seq_of, seq_l[-1]])
        new_prev = np.full(prev.size, -1, dtype=np.int64)
        new_prev[alive] = next_id + inv
        prev = new_prev
        next_id += uniq.size
    parent, token, count = np.concatenate(parent_l), np.concatenate(token_l), np.concatenate(count_l)
    depth, seq = np.concatenate(depth_l), seq_of
    w = np.zeros((b, depth_max + 1))
    w[:, 1:] = np.asarray(weights, dtype=np.float64)
    score = count / np.maximum(sizes[seq], 1) * w[seq, depth]
    nodes = np.flatnonzero(depth > 0)
    order = nodes[np.lexsort((depth[nodes], -score[nodes], seq[nodes]))]  # by sequence, best first
    seq_sorted = seq[order]
    rank = np.arange(order.size) - np.searchsorted(seq_sorted, np.arange(b))[seq_sorted]
    keep = order[rank < np.asarray(budgets, dtype=np.int64)[seq_sorted]]
    paths: dict[int, Path_] = {j: () for j in range(b)}
    for i in keep.tolist():  # within a sequence, parents come first
        chain = []
        j = i
        while j not in paths:
            chain.append(j)
            j = int(parent[j])
        for k in reversed(chain):
            paths[k] = paths[int(parent[k])] + (int(token[k]),)
        out[int(seq[i])].append((paths[i], float(score[i])))
    return out


# ---------------------------------------------------------------------------------------------
# the candidate tree
# ---------------------------------------------------------------------------------------------
@dataclass
class SSSDTree:
    """A candidate tree in the verifier's contract (convert with ``DraftTree(**tree.contract())``).

    Attributes:
        tokens: int64 [n] candidate ids (root = last committed token, excluded).
        parents: int64 [n], -1 for a child of the root, else the parent's index (< own index).
        scores: float32 [n] fused pseudo-probabilities, non-increasing (best-first node order).
        depths: int64 [n] depth below the root (1 = child of the root).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    depths: torch.Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def contract(self) -> dict[str, torch.Tensor | None]:
        """The shared tree fields: ``tokens``, ``parents``, ``draft_probs`` (None: SSSD has no draft
        distribution, its rule is membership), ``dist_index`` (None)."""
        return {"tokens": self.tokens, "parents": self.parents, "draft_probs": None, "dist_index": None}

    @classmethod
    def from_paths(cls, scored: Sequence[tuple[Path_, float]]) -> SSSDTree:
        """Tree from (path, score) pairs listed parents-first (every path's prefix listed before it)."""
        index: dict[Path_, int] = {}
        toks, pars, scores, depths = [], [], [], []
        for path, score in scored:
            parent = index[path[:-1]] if len(path) > 1 else -1  # KeyError = not ancestor-closed
            index[path] = len(toks)
            toks.append(path[-1])
            pars.append(parent)
            scores.append(score)
            depths.append(len(path))
        return cls(
            torch.tensor(toks, dtype=torch.long),
            torch.tensor(pars, dtype=torch.long),
            torch.tensor(scores, dtype=torch.float32),
            torch.tensor(depths, dtype=torch.long),
        )


def fuse_candidates(
    sources: Sequence[Sequence[tuple[Path_, float]]], budget: int, combine: str = "max", min_score: float = 0.0
) -> list[tuple[Path_, float]]:
    """Fuse scored candidate paths of several trees into one tree of at most ``budget`` nodes.

    Each input list must be ancestor-closed (every prefix of a listed path is listed). A path's fused
    score is the max (or sum) of its scores; the result is taken best-first from the root (a node
    enters only after its parent), ties broken by shallower depth then smaller token id, so it is
    ancestor-closed and deterministic whatever the scores.

    Returns:
        ``[(path, score)]``, at most ``budget`` entries, parents before children.
    """
    fused: dict[Path_, float] = {}
    for scored in sources:
        for path, score in scored:
            old = fused.get(path)
            if old is None:
                fused[path] = score
            elif combine == "max":
                fused[path] = max(old, score)
            else:
                fused[path] = old + score
    children: dict[Path_, list[Path_]] = {}
    for path in fused:
        children.setdefault(path[:-1], []).append(path)
    heap = [(-fused[p], len(p), p) for p in children.get((), [])]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < budget:
        neg, _, path = heapq.heappop(heap)
        if -neg < min_score:
            break
        out.append((path, -neg))
        for child in children.get(path, ()):
            heapq.heappush(heap, (-fused[child], len(child), child))
    return out


# ---------------------------------------------------------------------------------------------
# the drafter
# ---------------------------------------------------------------------------------------------
@dataclass
class SSSDState:
    """Per-sequence drafting state: the input trie over prompt + accepted output and, with a datastore,
    the datastore's suffix-array ranges of the context's last 1 .. P tokens, kept up to date as it grows
    (:meth:`~drafttrain.verify.methods.sssd_datastore.Datastore.extend_ranges`), so that drafting does
    not search the whole datastore again at every step.

    Call :meth:`append` with every token the verifier commits (accepted drafts and the bonus token).
    """

    trie: InputTrie
    datastore: Datastore | None = None
    max_prefix_len: int = 0
    ranges: list[tuple[int, int]] | None = None  # ranges[L - 1]: the last L tokens' (lo, hi) in the datastore

    @property
    def tokens(self) -> list[int]:
        return self.trie.tokens

    def append(self, tokens: Iterable[int]) -> None:
        tokens = [int(t) for t in tokens]
        self.trie.extend(tokens)
        if self.ranges is not None:
            self.ranges = self.datastore.extend_ranges(self.ranges, tokens, self.max_prefix_len)


class SSSDDrafter:
    """Training-free SSSD drafter (no nn.Module: it has no parameters and runs on the CPU).

    Args:
        config: :class:`SSSDConfig` (validated here).
        datastore: a :class:`~drafttrain.verify.methods.sssd_datastore.Datastore`, or None for input-only drafting.
        num_threads: > 1 runs the per-sequence part of :meth:`draft_batch` (input trie walks, fusion)
            in a thread pool. The datastore search is vectorised over the batch either way.

    Raises:
        ValueError: bad config.
    """

    def __init__(self, config: SSSDConfig, datastore: Datastore | None = None, num_threads: int = 1):
        self.config = config.validate()
        self.datastore = datastore if config.use_datastore else None
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads) if num_threads > 1 else None

    def new_state(self, prompt: Sequence[int]) -> SSSDState:
        """State for a new sequence whose context so far is ``prompt`` (its last token = first root)."""
        c = self.config
        state = SSSDState(InputTrie(c.max_prefix_len + c.max_depth, prompt))
        if self.datastore is not None and len(self.datastore) > 0:
            state.datastore, state.max_prefix_len = self.datastore, c.max_prefix_len
            state.ranges = self.datastore.suffix_ranges(state.tokens, c.max_prefix_len)
        return state

    def _weights(self, scale: float, depth_damp: float, match_damp: float, match_len: int) -> list[float]:
        c = self.config
        base = scale * match_damp ** (c.max_prefix_len - match_len)
        return [base * depth_damp**d for d in range(c.max_depth)]

    def input_candidates(self, state: SSSDState, budget: int) -> list[list[tuple[Path_, float]]]:
        """One scored, ancestor-closed candidate list per matched prefix length of the input (§3.1.1)."""
        c = self.config
        ctx = state.trie.tokens
        out = []
        for length in range(min(c.max_prefix_len, len(ctx)), c.min_prefix_len - 1, -1):
            node = state.trie.node(ctx[-length:])
            if node is None or node[0] <= 1:  # the only occurrence is the current one: no continuation
                continue
            weights = self._weights(c.input_scale, c.input_depth_damp, c.input_match_damp, length)
            out.append(_best_first_trie(node[1], node[0] - 1, weights, budget))
        return out

    def datastore_candidates(
        self, matches: Sequence[DatastoreMatch], budgets: Sequence[int]
    ) -> list[list[tuple[Path_, float]]]:
        """Scored, ancestor-closed candidates of each datastore lookup (§3.1.2), vectorised over the batch.

        The match-length damping uses each lookup's longest matched prefix."""
        c = self.config
        weights = [
            self._weights(c.datastore_scale, c.datastore_depth_damp, c.datastore_match_damp, max(m.longest_match, 1))
            for m in matches
        ]
        return _datastore_paths_batch(matches, weights, budgets)

    def draft(self, state: SSSDState, node_budget: int | None = None) -> SSSDTree:
        """Candidate tree for one sequence (see :meth:`draft_batch`)."""
        return self.draft_batch([state], node_budget)[0]

    def draft_batch(self, states: Sequence[SSSDState], node_budget: int | Sequence[int] | None = None) -> list[SSSDTree]:
        """Candidate trees for a batch of sequences.

        Args:
            states: b per-sequence states (context = ``state.tokens``; root = its last token).
            node_budget: n per tree (an int, or one per sequence); default ``config.node_budget``.

        Returns:
            b :class:`SSSDTree`, each ancestor-closed, at most n nodes and ``max_depth`` deep; a tree
            may be empty (n = 0) when nothing matches.
        """
        c = self.config
        if node_budget is None:
            budgets = [c.node_budget] * len(states)
        elif isinstance(node_budget, int):
            budgets = [node_budget] * len(states)
        else:
            budgets = [int(x) for x in node_budget]
            if len(budgets) != len(states):
                raise ValueError(f"{len(budgets)} budgets for {len(states)} states")
        if self.datastore is not None and len(self.datastore) > 0:
            # ranges kept up to date by new_state / append; a state made otherwise is searched afresh
            other = [s.tokens for s in states if s.datastore is not self.datastore]
            fresh = iter(self.datastore.suffix_ranges_batch(other, c.max_prefix_len))
            ranges = [s.ranges if s.datastore is self.datastore else next(fresh) for s in states]
            matches = self.datastore.lookup_ranges(ranges, c.max_depth, c.max_samples, c.min_continuations,
                                                   c.min_prefix_len)  # fmt: skip
            from_datastore = self.datastore_candidates(matches, budgets)
        else:
            from_datastore = [[] for _ in states]

        def one(i: int) -> SSSDTree:
            sources = self.input_candidates(states[i], budgets[i]) if c.use_input else []
            sources.append(from_datastore[i])
            return SSSDTree.from_paths(fuse_candidates(sources, budgets[i], c.combine, c.min_score))

        if self._pool is not None and len(states) > 1:
            return list(self._pool.map(one, range(len(states))))
        return [one(i) for i in range(len(states))]


# ---------------------------------------------------------------------------------------------
# acceptance: the membership rule (§4.2)
# ---------------------------------------------------------------------------------------------
@dataclass
class MembershipResult:
    """Outcome of one verification step of one sequence.

    Attributes:
        accepted_nodes: node indices of the accepted path, root to leaf (may be empty).
        tokens: tokens to commit: the accepted nodes' tokens followed by one target token
            (``len(tokens) == len(accepted_nodes) + 1``).
    """

    accepted_nodes: list[int]
    tokens: list[int]


def membership_walk(tokens: Sequence[int], parents: Sequence[int], next_token: Callable[[int], int]) -> MembershipResult:
    """The membership rule on plain lists, with the target's choice as a callback.

    From the root (node -1): ``x = next_token(node)`` is the target's token after ``node``; if a child
    of ``node`` carries x, move there and repeat; otherwise x is the bonus token and the walk ends.
    ``next_token`` is called once per visited node, in path order (so it may sample lazily). If several
    children carry x, the first one (lowest index) is taken.
    """
    kids: dict[tuple[int, int], int] = {}
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        kids.setdefault((int(par), int(tok)), i)
    node, path, out = -1, [], []
    while True:
        x = int(next_token(node))
        out.append(x)
        child = kids.get((node, x))
        if child is None:
            return MembershipResult(path, out)
        path.append(child)
        node = child


def _check_tree(tokens: torch.Tensor, parents: torch.Tensor) -> None:
    if tokens.ndim != 1 or parents.shape != tokens.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must be equal 1-D shapes")
    idx = torch.arange(tokens.shape[0])
    if bool(((parents < -1) | (parents >= idx)).any()):
        raise ValueError("parents[i] must be -1 or in [0, i)")


def membership_accept(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> MembershipResult:
    """SSSD's membership acceptance for one sequence's tree (SSSD §4.2), lossless.

    Sample the next token from the target's distribution at the current node (the root first);
    accept it if it is among the node's children and continue from that child; otherwise it is the
    bonus token and the step ends. Each emitted token is drawn from the target's conditional given
    exactly the tokens before it, so the output has the target's distribution whatever the tree.

    Args:
        tokens: int64 [n] node tokens; parents: int64 [n] (-1 = child of the root, else < own index).
        target_probs: float [n + 1, v]; row 0 = target's next-token distribution after the root (the
            last committed token), row i + 1 = after node i. Rows need not be normalised (as
            ``torch.multinomial``); temperature/top-k/top-p warping is the caller's.
        generator: for sampling; greedy: take the argmax (lowest id on ties) instead of sampling,
            which reproduces plain greedy decoding token for token.

    Returns:
        :class:`MembershipResult`.

    Raises:
        ValueError: shapes disagree or ``parents`` is not a valid tree.
    """
    _check_tree(tokens, parents)
    if target_probs.ndim != 2 or target_probs.shape[0] != tokens.shape[0] + 1:
        raise ValueError(f"target_probs must be [n + 1, v] = [{tokens.shape[0] + 1}, v], got {tuple(target_probs.shape)}")

    def next_token(node: int) -> int:
        row = target_probs[node + 1]
        if greedy:
            return int(torch.argmax(row))
        return int(torch.multinomial(row.float(), 1, generator=generator))

    return membership_walk(tokens.tolist(), parents.tolist(), next_token)


# ---------------------------------------------------------------------------------------------
# simulation against known continuations (the grid search's objective)
# ---------------------------------------------------------------------------------------------
@dataclass
class SimulationResult:
    """Greedy SSSD simulated on sequences whose continuations are known.

    Attributes:
        steps: verification steps; emitted: tokens committed by them; tau: emitted / steps.
        accept_hist: ``accept_hist[k]`` = steps that accepted k drafts.
        mean_tree_size: mean nodes per drafted tree.
    """

    steps: int
    emitted: int
    tau: float
    accept_hist: list[int] = field(default_factory=list)
    mean_tree_size: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def simulate_greedy(
    drafter: SSSDDrafter,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    node_budget: int | None = None,
    batch_size: int = 32,
) -> SimulationResult:
    """Simulated greedy SSSD decoding where the "target" emits the known continuation.

    For each ``(context, continuation)`` the drafter drafts from the context, the membership rule
    is applied with ``next_token`` = the next continuation token (what a greedy target whose output
    is the continuation would pick), the emitted tokens are appended, and so on to the end of the
    continuation. On self-distilled data (the target's own greedy answers) this equals the τ of real
    greedy SSSD decoding with that target, without running it. Sequences are drafted in lock-step
    batches of ``batch_size`` (vectorised datastore search).

    Returns:
        :class:`SimulationResult`; τ counts the bonus token (plain decoding = 1).
    """
    steps = emitted = nodes = 0
    hist = [0] * (drafter.config.max_depth + 2)
    for start in range(0, len(sequences), batch_size):
        chunk = [(list(ctx), list(cont)) for ctx, cont in sequences[start : start + batch_size] if len(ctx) and len(cont)]
        states = [drafter.new_state(ctx) for ctx, _ in chunk]
        pos = [0] * len(chunk)
        active = list(range(len(chunk)))
        while active:
            trees = drafter.draft_batch([states[i] for i in active], node_budget)
            still = []
            for i, tree in zip(active, trees):
                cont = chunk[i][1]
                p = pos[i]
                depths = tree.depths.tolist()

                def next_token(node: int, cont=cont, p=p, depths=depths) -> int:
                    j = p + (depths[node] if node >= 0 else 0)
                    return cont[j] if j < len(cont) else -1  # -1: past the end, never a child

                res = membership_walk(tree.tokens.tolist(), tree.parents.tolist(), next_token)
                take = min(len(res.tokens), len(cont) - p)
                states[i].append(cont[p : p + take])
                pos[i] = p + take
                steps += 1
                emitted += take
                nodes += len(tree)
                hist[min(take - 1, len(hist) - 1)] += 1
                if pos[i] < len(cont):
                    still.append(i)
            active = still
    return SimulationResult(steps, emitted, emitted / max(steps, 1), hist, nodes / max(steps, 1))


# ---------------------------------------------------------------------------------------------
# speculation-length planner (§3.2)
# ---------------------------------------------------------------------------------------------
@dataclass
class SpeculationPlan:
    """The planner's answer for one batch size.

    Attributes:
        batch_size: b.
        best_size: n* (candidate nodes per sequence, root excluded; 0 = plain decoding); the
            speculation length of SSSD §3.2 is n* + 1.
        tokens_per_s: ``{n: b * tau(n) / t(b, n + 1)}`` for every size considered.
        forward_seconds: ``{n: t(b, n + 1)}`` as interpolated from the table.
    """

    batch_size: int
    best_size: int
    tokens_per_s: dict[int, float]
    forward_seconds: dict[int, float]

    @property
    def speedup(self) -> float:
        """Expected tokens/s at ``best_size`` over plain decoding (n = 0)."""
        return self.tokens_per_s[self.best_size] / self.tokens_per_s[0]


def plan_speculation_length(
    forward_seconds: Mapping[tuple[int, int], float],
    tau_by_size: Mapping[int, float] | Callable[[int], float],
    batch_size: int,
    sizes: Iterable[int] | None = None,
) -> SpeculationPlan:
    """Pick the tree size that maximises expected tokens/s at one batch size (SSSD §3.2, Fig. 2).

    Expected throughput of size n is ``b * tau(n) / t(b, n + 1)``: "the theoretical end-to-end speedup
    and the optimal speculation length are obtained by dividing the algorithmic acceleration by the
    increase in cost" (drafting is on the CPU and left out, as in the paper's figure). Forward times
    between measured speculation lengths are interpolated linearly; sizes whose n + 1 lies outside
    the measured range are not considered (no extrapolation). Ties go to the smaller size.

    Args:
        forward_seconds: ``{(b, s): seconds}``: measured time of one target forward with b sequences
            of s tokens each (s = speculation length = 1 + tree nodes; s = 1 is plain decoding).
        tau_by_size: expected tokens emitted per sequence per forward, bonus included, for tree size n
            (a mapping or a callable); n = 0 is taken as 1 when missing.
        batch_size: b; must appear in ``forward_seconds``.
        sizes: tree sizes n to consider; default every n in ``tau_by_size`` (mapping) or every n with
            n + 1 in the measured range (callable).

    Returns:
        :class:`SpeculationPlan`.

    Raises:
        ValueError: ``batch_size`` not measured, s = 1 not measured for it, or no size can be evaluated.
    """
    measured = sorted((s, t) for (b, s), t in forward_seconds.items() if b == batch_size)
    if not measured:
        raise ValueError(f"batch size {batch_size} not in the forward-time table (have {sorted({b for b, _ in forward_seconds})})")
    s_vals = np.array([s for s, _ in measured], dtype=np.float64)
    t_vals = np.array([t for _, t in measured], dtype=np.float64)
    if s_vals[0] != 1:
        raise ValueError(f"the table needs plain decoding (s = 1) for batch size {batch_size}")

    def tau(n: int) -> float:
        if callable(tau_by_size):
            return float(tau_by_size(n))
        if n == 0 and 0 not in tau_by_size:
            return 1.0
        return float(tau_by_size[n])

    if sizes is None:
        sizes = range(0, int(s_vals[-1])) if callable(tau_by_size) else sorted(set(tau_by_size) | {0})
    tps, fwd = {}, {}
    for n in sorted(set(int(x) for x in sizes) | {0}):
        s = n + 1
        if n < 0 or s > s_vals[-1]:
            continue
        t = float(np.interp(s, s_vals, t_vals))
        fwd[n] = t
        tps[n] = batch_size * tau(n) / t
    best = max(tps, key=lambda n: (tps[n], -n))
    return SpeculationPlan(batch_size, best, tps, fwd)


# ---------------------------------------------------------------------------------------------
# the engine proposer
# ---------------------------------------------------------------------------------------------
class SSSDProposer:
    """SSSD drafting (input trie + datastore, SSSD §3.1) with the membership rule (§4.2), lossless.

    Args:
        drafter: an :class:`~drafttrain.verify.methods.sssd.SSSDDrafter` (its datastore is memory-mapped).
        node_budget: candidate nodes per tree (root excluded); default the drafter config's
            ``node_budget``. The speculation-length planner (:func:`~drafttrain.verify.methods.sssd.plan_speculation_length`)
            picks it per batch size.
    """

    name = "sssd"
    lossless = True

    def __init__(self, drafter: SSSDDrafter, node_budget: int | None = None):
        self.drafter = drafter
        self.node_budget = drafter.config.node_budget if node_budget is None else int(node_budget)
        self._states: dict[int, object] = {}

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        self._states[slot] = self.drafter.new_state(list(prompt_ids) + [int(first_token)])

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        trees = self.drafter.draft_batch([self._states[s] for s in slots], self.node_budget)
        return [DraftTree(t.tokens, t.parents) for t in trees]

    def commit(self, slot, tokens, hidden) -> None:
        self._states[slot].append(int(t) for t in tokens)

    def release(self, slot) -> None:
        self._states.pop(slot, None)

    def accept(self, slot, tree: DraftTree, target_logits, sampling=GREEDY, generator=None) -> Acceptance:
        """Membership rule: the target's token (argmax or a draw) at each node, kept while it is a child."""
        res = membership_accept(tree.tokens, tree.parents, target_rows(target_logits, sampling), generator,
                                greedy=sampling.greedy)  # fmt: skip
        return Acceptance(res.accepted_nodes, res.tokens[-1])


# ---------------------------------------------------------------------------------------------
# the method in the harness: config section, planner, registry entry
# ---------------------------------------------------------------------------------------------
def drafting_config(section) -> SSSDConfig:
    """The drafting parameters of an evaluation's SSSD section (:class:`~drafttrain.config.SSSDEvalConfig`:
    ``sssd.*`` of ``conf/evaluate.yaml`` or ``trainer.spec_eval.sssd.*``): :class:`SSSDConfig` with its
    ``max_prefix_len`` and ``max_depth``, the rest (the grid-searched weights) :class:`SSSDConfig`'s own defaults."""
    return SSSDConfig(max_prefix_len=section.max_prefix_len, max_depth=section.max_depth)


def measure_forward_seconds(target, batch_size: int, lengths, context: int = 256, steps: int = 6,
                            mode: str = "unpadded") -> dict[tuple[int, int], float]:  # fmt: skip
    """Mean time of one verification forward of ``batch_size`` sequences x s tokens (root + a chain of
    s - 1 drafts) through the engine itself (same cache, masks and attention path as the timed runs),
    over ``context`` cached tokens, for every s in ``lengths``: the forward-time curve of SSSD §3.2 / Fig. 2.

    The drafts are random tokens (rejected), so every step is one forward at the same context length;
    a short run at each size comes first as a warm-up.

    Returns:
        ``{(batch_size, s): seconds}`` (the table :func:`plan_speculation_length` reads).
    """
    from drafttrain.verify.engine import SpecEngine
    from drafttrain.verify.proposers import PlainProposer

    g = torch.Generator().manual_seed(0)
    vocab = int(target.config.vocab_size)
    prompts = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch_size)]

    class FixedChain(PlainProposer):  # a chain of n random drafts per sequence: the forward shape, no drafting cost
        name = "timing"

        def __init__(self, n):
            self.n = n

        def draft(self, slots, sampling=None, generator=None):
            return [DraftTree(torch.randint(0, vocab, (self.n,), generator=g), torch.arange(-1, self.n - 1))
                    for _ in slots]  # fmt: skip

    out = {}
    with torch.no_grad():
        for s in sorted(set(int(x) for x in lengths)):
            for n_steps, keep in ((2, False), (steps, True)):  # warm-up, then timed
                eng = SpecEngine(target, FixedChain(s - 1), batch_size=batch_size, max_new_tokens=n_steps + 1,
                                 mode=mode, stop_token_ids=[-1], initial_capacity=context + 2 * (steps + s))  # fmt: skip
                eng.run(prompts)
                if keep:
                    out[(batch_size, s)] = eng.stats.forward_seconds / max(eng.stats.forwards, 1)
    return out


def plan_sssd_budget(c, target, batch_size: int) -> dict:
    """The speculation-length planner (SSSD §3.2) for one batch size: forward times measured now on this
    machine, τ(n) from ``c.sssd.tau_table`` (the grid search's simulated acceptance per tree size).

    Args:
        c: a validated eval config (reads ``c.sssd`` and ``c.modes[0]``).

    Raises:
        FileNotFoundError: no τ table (the message names the command that writes it).
    """
    import json
    from pathlib import Path

    table = Path(c.sssd.tau_table)
    if not table.is_file():
        raise FileNotFoundError(f"no SSSD τ(n) table at {table}: run `python -m scripts.sssd_grid` "
                                f"(or pass sssd.node_budgets=[...])")  # fmt: skip
    tau = {int(n): float(t) for n, t in json.loads(table.read_text())["tau_by_size"].items()}
    fwd = measure_forward_seconds(target, batch_size, [n + 1 for n in tau] + [1], c.sssd.planner_context,
                                  mode=c.modes[0])  # fmt: skip
    plan = plan_speculation_length(fwd, tau, batch_size)
    return {"batch_size": batch_size, "best_size": plan.best_size, "expected_speedup": plan.speedup,
            "tau_by_size": tau, "forward_seconds": {str(k[1]): v for k, v in fwd.items()},
            "expected_tokens_per_s": {str(n): v for n, v in plan.tokens_per_s.items()}}  # fmt: skip


def _check(c) -> list[str]:
    from drafttrain.config import EVAL_ONLY_KEYS

    problems, b = [], c.sssd.node_budgets
    if b is not None and (not b or min(b) < 0):
        problems.append("sssd.node_budgets must be a non-empty list of ints >= 0 (or null for the planner)")
    default = SSSDEvalConfig()
    for key in EVAL_ONLY_KEYS["sssd"][1]:  # the hybrid trees' keys of the in-training evaluation
        if getattr(c.sssd, key) != getattr(default, key):
            problems.append(f"sssd.{key} is read by the in-training evaluation's hybrid trees "
                            f"(trainer.spec_eval.sssd.{key}), not by the sssd method: leave it unset")  # fmt: skip
    return problems


def _preflight(c) -> None:
    from pathlib import Path

    if not Path(c.sssd.datastore).is_dir():  # before the target loads: a missing datastore fails fast
        raise FileNotFoundError(f"no SSSD datastore at {c.sssd.datastore}: run `python -m scripts.build_datastore`")


def _build(ctx: MethodContext) -> list[Variant]:
    import logging

    c = ctx.config
    drafter = SSSDDrafter(drafting_config(c.sssd), Datastore.load(c.sssd.datastore), num_threads=c.sssd.num_threads)

    def record_budget(prop, rec, bs):
        rec["node_budget"] = prop.node_budget

    if c.sssd.node_budgets is not None:
        return [Variant(f"sssd_n{n}", lambda bs, refs, n=n: SSSDProposer(drafter, n), finish=record_budget)
                for n in c.sssd.node_budgets]  # fmt: skip
    plans = ctx.results.setdefault("sssd_planner", {})  # batch size (str) -> the planner's choice

    def planned(bs, refs):
        if str(bs) not in plans:
            plans[str(bs)] = plan = plan_sssd_budget(c, ctx.target, bs)
            logging.getLogger(__name__).info("SSSD planner, batch %d: tree size %d (expected speedup %.2f)", bs,
                                             plan["best_size"], plan["expected_speedup"])  # fmt: skip
        return SSSDProposer(drafter, plans[str(bs)]["best_size"])

    return [Variant("sssd", planned, warm=lambda: SSSDProposer(drafter, 8), finish=record_budget)]


SSSD = register(Method("sssd", _build, needs_drafter=False, lossless=True, config=SSSDEvalConfig, check=_check,
                       preflight=_preflight,
                       summary="SSSD: input trie + suffix-array datastore, membership rule (training-free, lossless)"))  # fmt: skip
