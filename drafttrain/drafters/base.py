"""The small interface every drafter implements, and the frozen target modules they share.

A drafter is a plain ``nn.Module``: no Accelerator, tokenizer, dataset or file I/O beyond its own
``save_pretrained``/``from_pretrained``.

**The declaration** (:class:`DrafterSpec`, class attribute ``spec``) says what a drafter is; every
consumer follows it and none looks at a drafter's name or probes its attributes:

- ``drafting``: ``"parallel"`` (one drafter pass gives every draft depth: ParallelSpec, Medusa) or
  ``"autoregressive"`` (one pass per depth, each feeding back the previous one: EAGLE). The verifier
  picks the proposer by it (:func:`drafttrain.verify.proposers.proposer_for`), and so do the decoding
  methods that need per-depth distributions from one pass (MCSD) or a joint likelihood (MTAD).
- ``feature_layers``: which of the target's hidden states the drafter reads, as layer ids.
  **Convention**: id i is the hidden state *entering* decoder layer i, i.e. Hugging Face's
  ``output_hidden_states[i]``; 0 = the token embeddings; id L (L = ``num_hidden_layers``) = the final
  hidden state after the target's final norm (the LM head's input, ``last_hidden_state``; HF's
  ``output_hidden_states[L]``). Negative ids count from the end as in Python: -1 = L. Every
  drafter of the library reads ``(-1,)`` (:data:`LAST_LAYER`), the feature f of docs/design.md, "Definitions".
  Several ids are **concatenated along the last dimension in the declared order**: the drafter's
  features are ``[..., len(ids) * d]``, layer ids[j] at ``[..., j * d : (j + 1) * d]``
  (:func:`drafttrain.target.resolve_feature_layers` normalises ids; ``Target.forward(...,
  feature_layers=ids).features`` computes them). Self-distillation, the feature cache, the training
  batch (``batch["features"]`` [b, L-1, len(ids) * d]), the engine and the in-training evaluation
  all hand the drafter exactly these.
- ``step_input``: what the engine hands it per verification step. ``"items"``: the features of every
  new item, i.e. the accepted tokens and the bonus token (docs/design.md, "Definitions"), which a drafter with its own
  KV cache appends; ``"last"``: only the last position's feature (Medusa heads; no drafter cache).
- ``batched``: the drafter implements the one-decoder-layer interface of
  :class:`~drafttrain.drafters.feature_layer.FeatureLayerDrafter` (``items``, ``decode``, ``logits`` /
  ``forward_inputs``, ``draft_inputs``, ``kv_cache_shape``), so proposers draft the whole batch in
  shared forwards over one ragged drafter cache. False: proposers call :meth:`propose` once per
  sequence, each with its own ``DynamicCache``.

A drafter defined anywhere (a test file, a user's module) becomes usable by name in the training loop,
config validation and the engine once registered with :func:`drafttrain.drafters.register_drafter`.

The training loop only needs:

- ``training_loss(batch, generator)``: loss + sums of metrics (reduced across ranks by the loop). In
  ``eval()`` mode it is the held-out evaluation: every group is scored (no subsampling, no noise);
- ``set_draft_vocab(ids)``: the restricted draft vocabulary, when ``draft_vocab_size`` > 0;
- ``save_pretrained(dir)`` / ``Drafter.from_pretrained(dir, target)``: weights as safetensors plus a
  json config, loadable without the training config.

The in-training speculative evaluation (:mod:`drafttrain.eval.driver`) needs one more method,
``propose(next_ids [1, n], features [1, n, d], cache) -> [1, depth, v]`` (see each drafter).

The target's embedding, final norm and LM head are shared *by reference* and frozen; they are kept
out of the module tree (so they are neither optimised, nor wrapped by DDP, nor saved).

Draft vocabulary (EAGLE-3's lever, docs/design.md): every drafter has two buffers in the serving
engines' convention (vLLM / speculators / SGLang; docs/design.md, "Serving formats"), the ONE convention of
this codebase:

- ``d2t`` [N] int64, an **offset**: draft id i is target id ``i + d2t[i]`` (all zeros when unrestricted,
  N = v); :attr:`Drafter.draft_token_ids` gives the absolute ids ``arange(N) + d2t``;
- ``t2d`` [v] bool: True where a target id is in the draft vocabulary.

Exporters write both buffers as they are. Checkpoints written before this convention (``d2t`` held
absolute ids, no ``t2d``) are converted on load (:meth:`Drafter.from_pretrained`). Drafters score the N
rows only; :meth:`Drafter.full_vocab_logits` scatters back to the target vocabulary with -inf elsewhere,
so acceptance rules always see target ids.

Shape letters: b batch, t items, d hidden, v target vocab, N draft vocab, m selected slots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from drafttrain.target import fastlinear

DRAFTER_WEIGHTS = "drafter.safetensors"
DRAFTER_CONFIG = "drafter_config.json"

#: The final post-norm hidden state (the LM head's input): layer id -1 = L (module docstring).
LAST_LAYER = -1
DRAFTING = ("parallel", "autoregressive")
STEP_INPUTS = ("items", "last")


#: The registry: drafter name -> class, filled by :func:`drafttrain.drafters.register_drafter` (the library's
#: drafters are registered when :mod:`drafttrain.drafters` is imported, which any import of this module does).
DRAFTERS: dict[str, type] = {}


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter is, for every consumer (module docstring: the layer-id convention and shapes).

    Attributes:
        drafting: ``"parallel"`` (one pass drafts every depth) or ``"autoregressive"`` (one pass per depth).
        feature_layers: target hidden states read, as layer ids (id i = HF ``output_hidden_states[i]``,
            the state entering decoder layer i; 0 = embeddings; L or -1 = the final post-norm state),
            concatenated in this order along the feature dimension.
        step_input: ``"items"`` (features of the accepted tokens + bonus token each step) or ``"last"``
            (only the last position's feature).
        batched: implements :class:`~drafttrain.drafters.feature_layer.FeatureLayerDrafter`'s batched
            drafting interface (the whole batch drafts in shared forwards).

    Raises:
        ValueError: an unknown ``drafting``/``step_input``, no layer ids, non-int or repeated ids.
    """

    drafting: str
    feature_layers: tuple[int, ...] = (LAST_LAYER,)
    step_input: str = "items"
    batched: bool = False

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        if self.drafting not in DRAFTING:
            raise ValueError(f"DrafterSpec.drafting must be one of {DRAFTING}, got {self.drafting!r}")
        if self.step_input not in STEP_INPUTS:
            raise ValueError(f"DrafterSpec.step_input must be one of {STEP_INPUTS}, got {self.step_input!r}")
        ids = self.feature_layers
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"DrafterSpec.feature_layers must be distinct ints (layer ids), got {ids!r}")


@dataclass
class SharedTargetModules:
    """Frozen modules of the target that a drafter uses (never trained, never saved with the drafter)."""

    embed_tokens: nn.Module
    final_norm: nn.Module
    lm_head: nn.Module
    model_config: Any  # the target's transformers config
    decoder_layer: nn.Module | None = None  # the target's last layer (class + optional init source)
    rotary_emb: nn.Module | None = None
    decoder_layers: tuple | None = None  # every decoder layer of the target (init sources of multi-layer drafters)
    decoder_layer_index: int | None = None  # index of decoder_layer among the target's layers

    @classmethod
    def from_target(cls, target) -> "SharedTargetModules":
        return cls(
            embed_tokens=target.embed_tokens,
            final_norm=target.final_norm,
            lm_head=target.lm_head,
            model_config=target.config,
            decoder_layer=target.last_layer,
            rotary_emb=target.rotary_emb,
            decoder_layers=tuple(target.layers),
            decoder_layer_index=target.last_attention_index,
        )


@dataclass
class LossOutput:
    """loss: scalar to backpropagate; sums: float tensors to all-reduce (see :mod:`drafttrain.metrics`)."""

    loss: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    num_tokens: int = 0  # drafter input slots processed (for tokens/s)


@dataclass
class DraftGroups:
    """Parallel groups whose drafted continuations the frozen target labels (on-policy training).

    Group g continues row ``row[g]`` of the training batch after item ``anchor[g]`` (so after the token
    x_{a+1}, the last token the drafter's context holds) with the drafter's own drafts.

    Attributes:
        row: [g] int64 batch row of each group.
        anchor: [g] int64 anchor item a of each group (in [0, t); the token context is x_0..x_{a+1}).
        drafts: [g, K] int64 target token ids d_0..d_{K-1}: the drafter's guesses at group positions 0..K-1,
            placed at token positions a + 2 .. a + K + 1.
    """

    row: torch.Tensor
    anchor: torch.Tensor
    drafts: torch.Tensor


@dataclass
class Objective:
    """What a training step asks of a drafter's loss beyond its recipe (``loss.*`` and the training strategy,
    :mod:`drafttrain.strategies`). The default is the offline objective of every recipe.

    Attributes:
        divergence: ``forward_kl`` | ``reverse_kl`` | ``js`` (:func:`drafttrain.losses.divergence`), where the
            drafter's loss is a distance to the target's distribution.
        cut_at_first_miss: Spec-AUF: a group's slots after its first predicted miss (the drafter's argmax differs
            from the label, or the label lies outside the draft vocabulary) count ``cut_weight``.
        cut_weight: weight of those slots (0 = left out of the loss and of its per-position means).
        labeller: on-policy: ``labeller(groups: DraftGroups) -> [g, K, d] float32``, the target's post-norm
            hidden states at the drafted positions (row j-1 of a group: the state after x_0..x_{a+1}, d_0..d_{j-1},
            whose LM head is the target's distribution for group position j). None = offline labels.
        temperature: on-policy drafts: 0 = argmax, > 0 = sampled at this temperature (the step's generator).
        groups_per_row: on-policy: at most this many groups per row are drafted and labelled (0 = all); the
            others keep their offline labels.
    """

    divergence: str = "forward_kl"
    cut_at_first_miss: bool = False
    cut_weight: float = 0.0
    labeller: Any = None
    temperature: float = 0.0
    groups_per_row: int = 0

    @property
    def on_policy(self) -> bool:
        return self.labeller is not None


class Drafter(nn.Module):
    """Base class: config keys, shared target modules (outside the module tree), draft vocabulary, save/load.

    Subclasses set ``name`` (= recipe name = registry key), ``spec`` (:class:`DrafterSpec`, the
    declaration), ``defaults`` (every config key the drafter reads, with its default: the one source of
    these defaults; any other key is refused) and implement ``training_loss`` and ``propose``.
    """

    name: ClassVar[str] = "base"
    spec: ClassVar[DrafterSpec]
    defaults: ClassVar[dict[str, Any]] = {}
    #: :class:`Objective` features its ``training_loss`` honours: "divergence", "cut_at_first_miss", "on_policy".
    #: Validation refuses a config asking for one the drafter lacks, naming :attr:`objective_refusal`.
    objectives: ClassVar[frozenset[str]] = frozenset()
    #: Why the drafter cannot train on its own drafts (printed when ``trainer.strategy`` asks for it).
    objective_refusal: ClassVar[str] = "its training loss has no on-policy path yet"
    #: The serving formats this drafter's network is (:data:`drafttrain.export.formats.FORMATS`), the first its
    #: default export, each with the model type that format's ``config.json`` names for it (speculators' registry:
    #: ``eagle3``, ``peagle``, ``dflash``; vLLM's ``medusa`` / ``eagle``). The exporters write a drafter only in a
    #: format it declares and read a folder back into the class that declares the folder's type; none is empty
    #: (no engine runs the network).
    serving_formats: ClassVar[dict[str, str]] = {}

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules):
        """Raises:
        ValueError: ``config`` has a key that is not in ``defaults``.
        """
        unknown = sorted(set(config) - set(self.defaults))
        if unknown:
            raise ValueError(f"drafter '{self.name}' has no config key(s) {unknown}; its keys: {sorted(self.defaults)}")
        super().__init__()
        self.config = {**self.defaults, **config}
        object.__setattr__(self, "_shared", shared)  # not a submodule: frozen, not saved

    @classmethod
    def select_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The keys of a full drafter config (e.g. the validated ``DrafterConfig``) that this drafter reads."""
        return {k: v for k, v in config.items() if k in cls.defaults}

    @property
    def shared(self) -> SharedTargetModules:
        return self._shared

    #: how the training layouts are masked: "dense" (additive float masks, the reference) or "flex" (block
    #: masks from the same rules, :mod:`drafttrain.attention`); drafters without a layout mask ignore it
    attention: str = "dense"

    def set_attention(self, mode: str, device: torch.device | str | None = None) -> None:
        """Mask the training layouts densely or with flex block masks (``trainer.attention``).

        Args:
            mode: dense | flex.
            device: the training device; with it, ``flex`` on a CPU device fails (no flex backward there).

        Raises:
            ValueError: an unknown mode, or flex for training on CPU (:func:`drafttrain.attention.check_mode`).
        """
        from drafttrain.attention import check_mode

        check_mode(mode, device if device is not None else "cuda", training=device is not None)
        self.attention = mode

    # -- the declaration, resolved for the bound target ------------------------------------------
    @classmethod
    def layers_for(cls, config: dict[str, Any], num_hidden_layers: int) -> tuple[int, ...]:
        """The target layer ids a drafter of this class with ``config`` reads, normalised to [0, L].

        Default: ``spec.feature_layers``. A drafter whose layers depend on its config or on the
        target's depth (e.g. EAGLE-3's low/middle/high layers) overrides this classmethod; the data
        pipeline calls it before the drafter is built.

        Raises:
            ValueError: an id outside [-(L + 1), L].
        """
        from drafttrain.target import resolve_feature_layers

        return resolve_feature_layers(cls.spec.feature_layers, num_hidden_layers)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layer ids this drafter reads, in [0, L] (L = the bound target's ``num_hidden_layers``)."""
        return self.layers_for(self.config, int(self.shared.model_config.num_hidden_layers))

    @property
    def feature_dim(self) -> int:
        """Width of the features this drafter reads: ``len(feature_layers) * d``."""
        return len(self.feature_layers) * int(self.shared.model_config.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the drafter's parameters (the shared embedding's when it has none)."""
        p = next(self.parameters(), None)
        return p.dtype if p is not None else self.shared.embed_tokens.weight.dtype

    @property
    def draft_depth(self) -> int:
        """Tokens one :meth:`propose` call drafts after the last item (the rows it returns): ParallelSpec
        K + 1, Medusa K (heads), EAGLE D (autoregressive steps). Proposers size their default chain by it."""
        raise NotImplementedError

    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
                      objective: Objective | None = None) -> LossOutput:  # fmt: skip
        raise NotImplementedError

    def forward(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
                objective: Objective | None = None) -> LossOutput:  # fmt: skip
        """The training loss; called through ``forward`` so DDP/DeepSpeed wrappers see the call. ``objective``
        (None = the recipe's offline objective) is passed on only when given, so a drafter whose
        ``training_loss`` takes no objective still trains offline."""
        if objective is None:
            return self.training_loss(batch, generator)
        return self.training_loss(batch, generator, objective)

    # -- draft vocabulary -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """v, the target's vocabulary size (rows of its LM head)."""
        return self.shared.lm_head.weight.shape[0]

    def _init_draft_vocab(self, draft_vocab_size: int) -> None:
        """Register ``d2t`` = zeros(N) (offsets: the identity, N = ``draft_vocab_size``, 0 = v) and ``t2d``
        (True on the first N ids); set real ids with :meth:`set_draft_vocab`.

        Raises:
            ValueError: N > v.
        """
        v = self.vocab_size
        n = int(draft_vocab_size) or v
        if n > v:
            raise ValueError(f"draft_vocab_size {n} exceeds the target vocabulary {v}")
        self.register_buffer("d2t", torch.zeros(n, dtype=torch.long), persistent=True)  # target id = i + d2t[i]
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[:n] = True
        self.register_buffer("t2d", t2d, persistent=True)  # target id -> in the draft vocabulary

    @property
    def restricted_vocab(self) -> bool:
        return self.d2t.numel() < self.vocab_size

    @property
    def draft_token_ids(self) -> torch.Tensor:
        """[N] int64 target id of every draft id: ``arange(N) + d2t`` (the engines' offset convention)."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Use the given target token ids ([N] int64, distinct, N = draft_vocab_size) as the draft vocabulary:
        draft id i is ``token_ids[i]`` (stored as the offset ``d2t[i] = token_ids[i] - i``, and ``t2d``).

        Raises:
            ValueError: wrong count, repeated ids or ids outside [0, v).
        """
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).to(self.d2t.device)
        if token_ids.numel() != self.d2t.numel() or token_ids.unique().numel() != token_ids.numel():
            raise ValueError(f"need {self.d2t.numel()} distinct token ids, got {token_ids.numel()}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab_size):
            raise ValueError(f"draft token ids must lie in [0, {self.vocab_size})")
        self.d2t.copy_(token_ids - torch.arange(token_ids.numel(), device=token_ids.device))
        self.t2d.zero_()
        self.t2d[token_ids] = True

    def target_to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Map target token ids [...] to draft ids (-1 where the id is outside the draft vocabulary or < 0)."""
        if not self.restricted_vocab:
            return ids
        t2d = torch.full((self.vocab_size,), -1, dtype=torch.long, device=ids.device)
        t2d[self.draft_token_ids.to(ids.device)] = torch.arange(self.d2t.numel(), device=ids.device)
        return t2d[ids.clamp_min(0)].masked_fill(ids < 0, -1)

    def vocab_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The frozen LM head's draft-vocabulary rows applied to (post-norm) features: [..., d] -> [..., N] float32.

        Gradients flow into ``features`` (never into the frozen head).
        """
        head = self.shared.lm_head
        if not self.restricted_vocab:
            return head(features).float()
        w, b = self.draft_head_rows()
        if self.__dict__.get("_packed_inference") and features.dtype == w.dtype:  # :meth:`pack_for_inference`
            packed = self.__dict__.get("_head_rows_packed")
            if packed is None or packed[0] is not w:
                lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
                lin.weight = nn.Parameter(w, requires_grad=False)
                lin.bias = None if b is None else nn.Parameter(b, requires_grad=False)
                backend = getattr(self.shared.lm_head, "backend", None)  # the target's (pack_for_inference)
                packed = (w, fastlinear.PackedLinear.from_linear(lin, backend))  # F.linear under autograd
                self.__dict__["_head_rows_packed"] = packed
            return packed[1](features).float()
        return torch.nn.functional.linear(features, w.to(features.dtype), None if b is None else b.to(features.dtype)).float()

    def pack_for_inference(self) -> int:
        """Run the drafter's own linear layers and its draft-vocabulary head on prepacked weights
        (:mod:`drafttrain.target.fastlinear`, the target's backend) when the target's are (``target.fast_linear``). A drafting step at
        batch 1 spends much of its time in these small-M matmuls (docs/benchmarks/draft_cost.md).
        Parameters and ``state_dict`` are unchanged and autograd falls back to ``F.linear``, but the
        packed copies only follow in-place updates that bump a parameter's version (DeepSpeed writes
        ``param.data``): call it on a drafter that is done training (the evaluation entry points and the
        final evaluation of a run do), never in the middle of a run. Idempotent.

        Returns:
            the number of layers packed now (0 when the target is not packed).
        """
        if not isinstance(self.shared.lm_head, fastlinear.PackedLinear):
            return 0
        self.__dict__["_packed_inference"] = True
        return fastlinear.pack_linears(self, self.shared.lm_head.backend)

    def draft_head_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The frozen LM head's rows (and bias) of the draft vocabulary: ([N, d], [N] or None).

        Gathered once and kept until the head's or ``d2t``'s storage or version changes (a new draft
        vocabulary, a move to another device or dtype): re-gathering an [N, d] slice on every drafter
        call was ~8% of EAGLE's decoding time on CPU (N = 8192, d = 576; scripts/bench_drafting.py's profile).
        The head is frozen, so the cached copy never needs gradients.
        """
        head = self.shared.lm_head
        bias = getattr(head, "bias", None)
        wt = head.weight
        key = (wt.data_ptr(), wt._version, wt.dtype, self.d2t.data_ptr(), self.d2t._version,
               None if bias is None else (bias.data_ptr(), bias._version))  # fmt: skip
        cached = self.__dict__.get("_head_rows_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                idx = self.draft_token_ids.to(wt.device)
                rows = (wt[idx].detach(), None if bias is None else bias[idx].detach())
            self.__dict__["_head_rows_cache"] = cached = (key, rows)
        return cached[1]

    @torch.no_grad()
    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's own logits over the draft vocabulary from its (post-norm) features: [m, d] -> [m, N].

        The target's logits for token x_{j+1} are LM head(f_j): read from stored features, they cost no
        target forward (used for the knowledge-distillation term, ``kd_weight``).
        """
        head = self.shared.lm_head
        w, b = (head.weight, getattr(head, "bias", None)) if not self.restricted_vocab else self.draft_head_rows()
        logits = torch.nn.functional.linear(features.to(w.dtype), w, b).float()
        cap = getattr(head, "cap", None)  # a target that soft-caps its logits (SoftcappedHead): the same cap here
        return torch.tanh(logits / cap) * cap if cap else logits

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocabulary logits [..., N] into the target vocabulary [..., v] (-inf elsewhere)."""
        if not self.restricted_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_token_ids.to(logits.device)] = logits
        return full

    # -- checkpoint format ----------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``drafter.safetensors`` (trainable weights + ``d2t`` / ``t2d``) and ``drafter_config.json``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / DRAFTER_WEIGHTS))
        (directory / DRAFTER_CONFIG).write_text(json.dumps({"name": self.name, **self.config}, indent=1))

    @staticmethod
    def from_pretrained(directory: str | Path, target) -> "Drafter":
        """Load any drafter saved by :meth:`save_pretrained`, bound to ``target``'s shared modules.

        Raises:
            FileNotFoundError: no drafter checkpoint in ``directory``.
            ValueError: the checkpoint names an unknown drafter or does not fit the target.
            FatalError: (one line naming the file) a truncated / corrupt ``drafter.safetensors`` or config, or
                weights that do not match the config (missing, unknown or other-shaped tensors).
        """
        from safetensors.torch import load_file

        from drafttrain.cliconfig import FatalError

        directory = Path(directory)
        cfg_path = directory / DRAFTER_CONFIG
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no {DRAFTER_CONFIG} in {directory}")
        try:
            config = json.loads(cfg_path.read_text())
            name = config.pop("name")
        except (ValueError, KeyError, AttributeError) as e:  # truncated or hand-edited JSON
            raise FatalError(f"{cfg_path}: not a drafter config ({type(e).__name__}: {e}); the folder was not written "
                             "whole: save or export the drafter again") from None  # fmt: skip
        if name not in DRAFTERS:
            raise ValueError(f"unknown drafter '{name}' in {cfg_path}; known: {sorted(DRAFTERS)}")
        if "draft_layer" in DRAFTERS[name].defaults and "draft_layer" not in config:
            config["draft_layer"] = "target"  # written before draft_layer existed: the target's own layer class
        drafter = DRAFTERS[name](config, SharedTargetModules.from_target(target), init_weights=False)
        weights = directory / DRAFTER_WEIGHTS
        try:
            state = load_file(str(weights))
        except FileNotFoundError:
            raise FatalError(f"{weights}: missing (the drafter folder has its config but no weights)") from None
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError: a truncated or corrupt file
            raise FatalError(f"{weights}: cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:160]}; "
                             f"{weights.stat().st_size} bytes): a truncated or corrupt drafter file, not written "
                             "whole: save or export the drafter again") from None  # fmt: skip
        if "d2t" in state and "t2d" not in state:  # written before the offset convention: d2t held absolute ids
            ids = state.pop("d2t")
            state["d2t"] = ids - torch.arange(ids.numel())
            state["t2d"] = torch.zeros(drafter.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        want = drafter.state_dict()
        missing = sorted(set(want) - set(state))
        extra = sorted(set(state) - set(want))
        shapes = [k for k in set(want) & set(state) if tuple(want[k].shape) != tuple(state[k].shape)]
        if missing or extra or shapes:
            what = "; ".join(x for x in (
                f"missing tensors {missing[:4]}" if missing else "", f"tensors it does not know {extra[:4]}" if extra else "",
                (f"tensors of other shapes than {cfg_path.name} says: "
                 + ", ".join(f"{k} {tuple(state[k].shape)} vs {tuple(want[k].shape)}" for k in sorted(shapes)[:3]))
                if shapes else "") if x)  # fmt: skip
            raise FatalError(f"{weights}: does not match {cfg_path.name} ({name}): {what}")
        drafter.load_state_dict(state)
        return drafter.to(target.device)
