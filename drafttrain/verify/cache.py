"""The verifier's KV cache: one preallocated buffer, each row written at its own offset (EMS-SD "unpad KV cache").

:class:`RaggedKVCache` is a transformers :class:`~transformers.Cache` whose layers hold
``keys/values: [b, h_kv, cap, hd]`` and whose rows are independent sequences. Before every target
forward the engine gives it a :class:`WritePlan`: for each input token, the cache row and slot its
keys/values go to (EMS-SD Section 3.2: "we specify the start location of the KV cache for each
sample individually ... for each input token, we initially compute its KV cache and subsequently
write it to memory based on the specified position for each sample"). ``valid [b, cap]`` marks the
slots that hold committed tokens; masks are built from it, so slots may hold garbage (rejected
drafts, padding) that nobody attends to.

Two ways to read the cache back for attention:

- **batched** (``[B, q]`` inputs): the attention gets ``keys[rows, :, lo:hi]`` and a ``[B, 1, q, hi - lo]``
  additive mask; any transformers attention (sdpa, eager) works.
- **packed** (``[1, N]`` inputs, EMS-SD "unpad input tokens", Appendix D Algorithm 1): all sequences'
  tokens are concatenated; :func:`ragged_attention` (registered with transformers'
  ``AttentionInterface`` as ``"drafttrain_ragged"``) restores each token's sequence (Appendix D
  Algorithm 2) from :class:`RaggedSegments` and runs attention of each sequence's queries against
  its own cache row only. Nothing is padded and no attention is spent across sequences.

Shape letters: b cache rows, B batch rows of a forward, q queries per row, N packed tokens,
h_kv key/value heads, hd head dim, cap slots per row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, LinearAttentionLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from drafttrain.target import fastattention

RAGGED_ATTENTION = "drafttrain_ragged"


@dataclass
class WritePlan:
    """Where one forward's keys/values go and what attention reads back.

    Attributes:
        rows: [B, q] int64 cache row of every input token (packed: B = 1, q = N).
        slots: [B, q] int64 slot of every input token within its row.
        read_rows: [B] int64 cache rows the batched attention reads (None: all rows in order);
            ignored when ``packed``.
        lo, hi: slot range read back (``keys[..., lo:hi, :]``).
        packed: the forward is packed ([1, N]); attention reads every row (a view, no copy).
    """

    rows: torch.Tensor
    slots: torch.Tensor
    read_rows: torch.Tensor | None
    lo: int
    hi: int
    packed: bool = False


@dataclass
class RaggedSegments:
    """Packed-forward metadata (EMS-SD Appendix D): token range [start, end) of each sequence, its cache row
    and how many cache slots (``kv_len``) its attention needs to read.

    ``batched`` chooses how :func:`ragged_attention` runs: True (default) gathers the sequences' queries
    into one ``[B, h, q_max, hd]`` call (the gather plan is built once per forward and shared by every
    layer); False runs one attention call per sequence (EMS-SD Algorithm 2 literally).
    """

    starts: list[int]
    ends: list[int]
    rows: list[int]
    kv_lens: list[int]
    batched: bool = True
    _plan: dict | None = None  # built on the first layer's call, reused by the others

    def gather_plan(self, attention_mask: torch.Tensor) -> dict:
        """Index tensors of the one-call attention (cached for the forward; every layer gets the same mask).

        Returns a dict with ``q_idx`` [B, q_max] int64 packed-token index of each (sequence, query slot)
        (slots past a sequence's end repeat its last token: their outputs are dropped, and no query row is
        fully masked), ``out_idx`` [N] int64 index of each packed token in the flattened [B * q_max]
        output, ``mask`` [B, 1, q_max, kv_max] the additive mask rows of those tokens, ``kv_max``,
        ``rows`` (a ``slice`` when the sequences are the cache rows r0, r0 + 1, ... in order: the keys
        are then a view, else an int64 tensor to gather them with) and ``causal``: True when every
        sequence's inputs are its whole row (``kv_len`` = its input count, a prefill) and the mask is
        plain causal over them, so attention can run as sdpa's ``is_causal`` kernel without the mask."""
        if self._plan is not None and self._plan["mask_id"] is attention_mask:
            return self._plan
        dev = attention_mask.device
        q = [e - s for s, e in zip(self.starts, self.ends)]
        q_max, kv_max, b = max(q), max(self.kv_lens), len(q)
        j = torch.arange(q_max, device=dev)
        starts = torch.tensor(self.starts, device=dev)[:, None]
        ends = torch.tensor(self.ends, device=dev)[:, None]
        q_idx = torch.minimum(starts + j, ends - 1)  # [B, q_max]
        out_idx = (torch.arange(b, device=dev)[:, None] * q_max + j)[j < (ends - starts)]  # row-major = packed order
        mask = attention_mask[0, 0, :, :kv_max][q_idx][:, None]  # [B, 1, q_max, kv_max]
        r0 = self.rows[0]
        rows = slice(r0, r0 + b) if self.rows == list(range(r0, r0 + b)) else torch.tensor(self.rows, device=dev)
        causal = False
        if q == list(self.kv_lens) and q_max > 1:  # every sequence starts from an empty row: a prefill?
            real = j[None, :] < (ends - starts)  # [B, q_max] the real queries
            tril = torch.ones(q_max, kv_max, dtype=torch.bool, device=dev).tril()  # query j sees keys 0..j
            causal = bool((((mask[:, 0] == 0) == tril) | ~real[:, :, None]).all())
        self._plan = {"mask_id": attention_mask, "q_idx": q_idx, "out_idx": out_idx, "mask": mask,
                      "kv_max": kv_max, "rows": rows, "causal": causal}  # fmt: skip
        return self._plan


class _RaggedLayer(CacheLayerMixin):
    """One attention layer's key/value buffers (``[b, h_kv, cap, hd_k]`` and ``[b, h_kv, cap, hd_v]``: MLA's keys
    and values may differ in size, as may two layers of one model); writes/reads follow the parent cache's current
    :class:`WritePlan`. A sparse-attention indexer's keys (``[b, cap, d_idx]``, DeepSeek-V3.2's DSA) are held the
    same way where the layer has one (:meth:`update_indexer`)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "RaggedKVCache", keys: torch.Tensor, values: torch.Tensor,
                 indexer: torch.Tensor | None = None):  # fmt: skip
        super().__init__()
        self._init_kv(owner, keys, values, indexer)

    def _init_kv(self, owner, keys, values, indexer=None) -> None:
        self.owner = owner
        self.keys, self.values, self.indexer_keys = keys, values, indexer
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are allocated up front
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write key/value states [B, h_kv, q, hd] at the plan's (row, slot) pairs; return what attention reads."""
        plan = self.owner.plan
        if plan is None:
            raise RuntimeError("RaggedKVCache: the engine must set_plan() before each forward")
        # buffer[row, :, slot] = state[b, :, j] for every input token (b, j)
        self.keys[plan.rows, :, plan.slots] = key_states.transpose(1, 2).to(self.dtype)  # [B, q, h_kv, hd]
        self.values[plan.rows, :, plan.slots] = value_states.transpose(1, 2).to(self.dtype)
        if plan.packed or plan.read_rows is None:
            return self.keys[:, :, plan.lo : plan.hi], self.values[:, :, plan.lo : plan.hi]  # views
        return self.keys[plan.read_rows, :, plan.lo : plan.hi], self.values[plan.read_rows, :, plan.lo : plan.hi]

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Write indexer keys [B, q, d_idx] at the plan's (row, slot) pairs; return the read window [B, kv, d_idx]."""
        plan = self.owner.plan
        if plan is None or self.indexer_keys is None:
            raise RuntimeError("RaggedKVCache: this layer holds no indexer keys (or no plan is set)")
        self.indexer_keys[plan.rows, plan.slots] = indexer_key_states.to(self.indexer_keys.dtype)
        if plan.packed or plan.read_rows is None:
            return self.indexer_keys[:, plan.lo : plan.hi]
        return self.indexer_keys[plan.read_rows, plan.lo : plan.hi]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        plan = self.owner.plan
        return (plan.hi - plan.lo, plan.lo) if plan is not None else (query_length, 0)

    def get_seq_length(self) -> int:
        return int(self.owner.lengths.max()) if self.owner.lengths.numel() else 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def buffers(self) -> list[tuple[str, int]]:
        """(attribute, slot axis) of every per-token buffer."""
        out = [("keys", 2), ("values", 2)]
        return out + [("indexer_keys", 1)] if self.indexer_keys is not None else out


class _StateLayer(LinearAttentionLayer):
    """One recurrent layer's conv and recurrent states (gated delta-net, Mamba, short convolutions), one per cache
    row, held in ``store_conv`` / ``store_rec`` (``[b, ...]``; the shapes transformers' own cache holds for one
    sequence, read by :func:`drafttrain.target.families.cache_layout`).

    The model reads and writes ``conv_states`` / ``recurrent_states`` through transformers' ``Cache`` API (in place
    for a one-token step). Those are the *working* states of the current forward's rows: :meth:`begin` makes them
    (the stores themselves when the forward covers every row in order and nothing may need undoing, else a copy
    of the forward's rows), :meth:`end` writes back the rows whose states are exact after the forward. Until then
    the store still holds every row's state from before the forward: that is the snapshot a rejected draft is
    rolled back to.

    A fresh row starts from zero states with ``has_previous_state`` set: a zero conv window and a zero recurrent
    state are exactly what transformers starts a prompt from.
    """

    is_sliding = False

    def __init__(self, owner: "RaggedKVCache", spec, batch_size: int, dtype: torch.dtype, device):
        n = max(len(spec.conv_shapes), len(spec.recurrent_shapes), 1)
        LinearAttentionLayer.__init__(self, number_of_states=n)
        self._init_states(owner, spec, batch_size, dtype, device)

    def _init_states(self, owner, spec, batch_size, dtype, device) -> None:
        self.owner = owner
        self.dtype, self.device = dtype, device
        self.store_conv: dict[int, torch.Tensor] = {}
        self.store_rec: dict[int, torch.Tensor] = {}
        for i, shape in enumerate(spec.conv_shapes):
            if shape:
                self.store_conv[i] = torch.zeros(batch_size, *shape, dtype=spec.state_dtype("conv", i, dtype), device=device)
                self.conv_kernel_size[i] = int(shape[-1])
                self.is_conv_states_initialized[i] = True
        for i, shape in enumerate(spec.recurrent_shapes):
            if shape:
                self.store_rec[i] = torch.zeros(batch_size, *shape, dtype=spec.state_dtype("rec", i, dtype), device=device)
                self.is_recurrent_states_initialized[i] = True
        for i in range(self.number_of_states):
            self.has_previous_state[i] = True
        self._rows: torch.Tensor | None = None
        self._views = True
        self.conv_states.update(self.store_conv)
        self.recurrent_states.update(self.store_rec)

    # -- transformers' Cache API (the model calls these) ---------------------------------------
    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, conv_kernel_size=None):
        raise RuntimeError(f"RaggedKVCache: state {state_idx} of this layer was not in the layout read before the "
                           "first forward (drafttrain.target.families.cache_layout)")  # fmt: skip

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        """The conv window of the forward's rows followed by the new inputs [B, C, k + q] (what the model's causal
        conv reads); keeps the last k columns as the rows' working conv state."""
        if state_idx not in self.store_conv:
            self.lazy_initialization(state_idx=state_idx)
        cur = self.conv_states[state_idx]
        full = torch.cat([cur, conv_states.to(cur.dtype)], dim=-1)
        cur.copy_(full[..., -self.conv_kernel_size[state_idx] :])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs):
        if state_idx not in self.store_rec:
            self.lazy_initialization(state_idx=state_idx)
        cur = self.recurrent_states[state_idx]
        cur.copy_(recurrent_states)
        return cur

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("RaggedKVCache rolls recurrent states back by snapshot (RaggedKVCache.end_states)")

    # -- engine API ---------------------------------------------------------------------------
    def begin(self, rows: torch.Tensor | None, snapshot: bool) -> None:
        """Working states for a forward over cache rows ``rows`` [B] (None: every row in order)."""
        if rows is None and not snapshot:
            self._rows, self._views = None, True
            self.conv_states.update(self.store_conv)
            self.recurrent_states.update(self.store_rec)
            return
        idx = rows if rows is not None else torch.arange(self.owner.batch_size, device=self.device)
        self._rows, self._views = idx, False
        self.conv_states.update({i: t.index_select(0, idx) for i, t in self.store_conv.items()})
        self.recurrent_states.update({i: t.index_select(0, idx) for i, t in self.store_rec.items()})

    def end(self, exact: torch.Tensor | None) -> None:
        """Write back the working states of the forward's rows where ``exact`` [B] bool (None: all of them)."""
        if not self._views:
            keep = torch.arange(self._rows.numel(), device=self.device) if exact is None else exact.nonzero().squeeze(-1)
            if keep.numel():
                rows = self._rows[keep]
                for i, t in self.store_conv.items():
                    t[rows] = self.conv_states[i][keep]
                for i, t in self.store_rec.items():
                    t[rows] = self.recurrent_states[i][keep]
        elif exact is not None and not bool(exact.all()):
            raise RuntimeError("RaggedKVCache: a forward that wrote the states in place cannot be undone")
        self.begin(None, snapshot=False)

    def state_tensors(self) -> list[tuple[dict, int]]:
        return [(self.store_conv, 0), (self.store_rec, 0)]


class _HybridLayer(_StateLayer, _RaggedLayer):
    """A layer that keeps both attention keys/values and recurrent states (Falcon-H1's parallel blocks, Zamba's
    shared attention on a Mamba layer): :class:`_RaggedLayer` and :class:`_StateLayer` in one."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner, spec, batch_size, dtype, device, keys, values, indexer=None):
        n = max(len(spec.conv_shapes), len(spec.recurrent_shapes), 1)
        LinearAttentionLayer.__init__(self, number_of_states=n)
        self._init_states(owner, spec, batch_size, dtype, device)
        self._init_kv(owner, keys, values, indexer)

    def lazy_initialization(self, *args, **kwargs) -> None:  # both parts are allocated up front
        pass

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class RaggedKVCache(Cache):
    """Preallocated cache whose rows are independent sequences with their own lengths, with one layer kind per
    decoder layer.

    The kinds (:class:`drafttrain.target.families.LayerCache`, read from the model by
    :func:`drafttrain.target.families.cache_layout`): attention keys/values (full, sliding or chunked windows, MLA's
    latent keys and values of other sizes, a sparse-attention indexer's keys), recurrent states (conv and recurrent
    states per row: gated delta-net, Mamba-2, short convolutions) and both. Without a layout every layer holds
    keys/values of the config's ``num_key_value_heads`` x ``head_dim`` (a plain transformer).

    Recurrent states have no slot axis: a rejected draft cannot be overwritten later, so a forward's states are
    written back only for the rows where they are exact (:meth:`begin_states` / :meth:`end_states`), and the engine
    replays the committed tokens of the others (:class:`drafttrain.verify.engine.SpecEngine`).

    Args:
        config: the target's transformers config (num_hidden_layers, num_key_value_heads, head_dim).
        batch_size: rows b.
        capacity: slots per row (grown on demand by :meth:`ensure_capacity`).
        dtype, device: of the buffers (the model's).
        layout: one :class:`~drafttrain.target.families.LayerCache` per decoder layer (None: plain attention).

    Attributes:
        valid: [b, cap] bool, slots holding committed tokens.
        lengths: [b] int64, committed tokens per row (= the position id of the row's next token).
        plan: the current :class:`WritePlan` (set by the engine before each forward).
        recurrent: some layer keeps recurrent states (the engine then verifies chains, batched, never packed).
        packable: every layer is plain attention (no indexer, no state): packed ``[1, N]`` forwards are exact.
    """

    def __init__(self, config, batch_size: int, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 layout=None):  # fmt: skip
        from drafttrain.target.families import default_layout, text_config

        config = text_config(config)
        self.layout = tuple(layout) if layout is not None else default_layout(config)
        layers = []
        for spec in self.layout:
            kv = None
            if spec.key_shape is not None:
                (hk, dk), (hv, dv) = spec.key_shape, spec.value_shape
                k = torch.zeros(batch_size, hk, capacity, dk, dtype=dtype, device=device)  # [b, h_kv, cap, hd_k]
                v = torch.zeros(batch_size, hv, capacity, dv, dtype=dtype, device=device)  # [b, h_kv, cap, hd_v]
                idx = (torch.zeros(batch_size, capacity, spec.indexer_dim, dtype=dtype, device=device)
                       if spec.indexer_dim else None)  # fmt: skip
                kv = (k, v, idx)
            if spec.kind == "attention":
                layers.append(_RaggedLayer(self, *kv))
            elif spec.kind == "recurrent":
                layers.append(_StateLayer(self, spec, batch_size, dtype, device))
            elif spec.kind == "hybrid":
                layers.append(_HybridLayer(self, spec, batch_size, dtype, device, *kv))
            elif spec.kind == "none":
                layers.append(DummyLayer())
            else:
                raise ValueError(f"RaggedKVCache: layer kind {spec.kind!r} is not one the engine holds")
        super().__init__(layers=layers)
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.plan: WritePlan | None = None
        self.recurrent = any(isinstance(layer, _StateLayer) for layer in layers)
        self.packable = all(spec.kind in ("attention", "none") and not spec.indexer_dim for spec in self.layout)

    # -- shape ----------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        plan = self.plan
        return (plan.hi - plan.lo, plan.lo) if plan is not None else (query_length, 0)

    def _kv_layers(self) -> list[_RaggedLayer]:
        return [layer for layer in self.layers if isinstance(layer, _RaggedLayer)]

    def _state_layers(self) -> list[_StateLayer]:
        return [layer for layer in self.layers if isinstance(layer, _StateLayer)]

    # -- engine API -----------------------------------------------------------------------------
    def set_plan(self, plan: WritePlan | None) -> None:
        self.plan = plan

    def begin_states(self, rows: list[int] | None, snapshot: bool) -> None:
        """Before a forward over cache rows ``rows`` (None: every row in order): the recurrent layers' working
        states. ``snapshot``: some row's states may have to be undone after the forward (kept out of place)."""
        if not self.recurrent:
            return
        idx = None if rows is None else torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        if idx is not None and not snapshot and rows == list(range(self.batch_size)):
            idx = None
        for layer in self._state_layers():
            layer.begin(idx, snapshot)

    def end_states(self, exact: list[bool] | None = None) -> None:
        """After the forward: keep the recurrent states of the rows where ``exact`` (None: all), so that every
        other row's state stays as it was before the forward (its snapshot)."""
        if not self.recurrent:
            return
        mask = None if exact is None else torch.tensor(exact, dtype=torch.bool, device=self.valid.device)
        for layer in self._state_layers():
            layer.end(mask)

    def reset_rows(self, rows: list[int]) -> None:
        """Zero the recurrent states of ``rows`` (a new sequence starts there)."""
        if not self.recurrent or not rows:
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        for layer in self._state_layers():
            for store in (layer.store_conv, layer.store_rec):
                for t in store.values():
                    t[idx] = 0

    def row_states(self, row: int) -> dict[str, torch.Tensor]:
        """Copies of one row's recurrent states, ``"L.conv.i"`` / ``"L.rec.i"`` -> tensor (tests, debugging)."""
        out = {}
        for li, layer in enumerate(self.layers):
            if isinstance(layer, _StateLayer):
                for i, t in layer.store_conv.items():
                    out[f"{li}.conv.{i}"] = t[row].clone()
                for i, t in layer.store_rec.items():
                    out[f"{li}.rec.{i}"] = t[row].clone()
        return out

    def ensure_capacity(self, slots: int) -> None:
        """Grow every row to at least ``slots`` slots (copies the buffers; contents are kept)."""
        cap = self.capacity
        if slots <= cap:
            return
        new_cap = max(slots, cap + cap // 2 + 16)
        for layer in self._kv_layers():
            for name, axis in layer.buffers():
                old = getattr(layer, name)
                shape = list(old.shape)
                shape[axis] = new_cap
                new = old.new_zeros(shape)
                new.narrow(axis, 0, cap).copy_(old)
                setattr(layer, name, new)
        valid = self.valid.new_zeros(self.batch_size, new_cap)
        valid[:, :cap] = self.valid
        self.valid = valid

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys/values of (rows[i], src[i]) to (rows[i], dst[i]) in every layer (gather, then scatter).

        This is how an accepted path's keys/values are made contiguous after verification.

        Args:
            rows, src, dst: [m] int64.
        """
        if rows.numel() == 0:
            return
        for layer in self._kv_layers():
            for name, axis in layer.buffers():
                buf = getattr(layer, name)
                if axis == 2:
                    buf[rows, :, dst] = buf[rows, :, src]  # [m, h_kv, hd] (a copy: safe if src and dst overlap)
                else:
                    buf[rows, dst] = buf[rows, src]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` ([b'] int64), in that order (drops finished sequences from the batch)."""
        for layer in self._kv_layers():
            for name, _ in layer.buffers():
                setattr(layer, name, getattr(layer, name).index_select(0, rows))
        for layer in self._state_layers():
            for store in (layer.store_conv, layer.store_rec):
                for i in list(store):
                    store[i] = store[i].index_select(0, rows)
            layer.begin(None, snapshot=False)
        self.valid = self.valid.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)

    def add_rows(self, n: int) -> None:
        """Append ``n`` empty rows."""
        if n <= 0:
            return
        for layer in self._kv_layers():
            for name, _ in layer.buffers():
                old = getattr(layer, name)
                setattr(layer, name, torch.cat([old, old.new_zeros(n, *old.shape[1:])], dim=0))
        for layer in self._state_layers():
            for store in (layer.store_conv, layer.store_rec):
                for i in list(store):
                    store[i] = torch.cat([store[i], store[i].new_zeros(n, *store[i].shape[1:])], dim=0)
            layer.begin(None, snapshot=False)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(n, self.capacity)], dim=0)
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(n)], dim=0)

    def shift_left(self, offset: int) -> None:
        """Move every row's slots [offset, cap) to [0, cap - offset) (padded mode: drop common leading padding)."""
        if offset <= 0:
            return
        cap = self.capacity
        for layer in self._kv_layers():
            for name, axis in layer.buffers():
                buf = getattr(layer, name)
                buf.narrow(axis, 0, cap - offset).copy_(buf.narrow(axis, offset, cap - offset).clone())
        self.valid[:, : cap - offset] = self.valid[:, offset:].clone()
        self.valid[:, cap - offset :] = False

    def row_kv(self, row: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed keys/values of one row, in slot order: ([h_kv, L, hd_k], [h_kv, L, hd_v]) (tests, debugging)."""
        idx = self.valid[row].nonzero().squeeze(-1)
        layer = self.layers[layer_idx]
        return layer.keys[row][:, idx], layer.values[row][:, idx]


# ---------------------------------------------------------------------------------------------
# Batched [B, q_max] layout over a RaggedKVCache
# ---------------------------------------------------------------------------------------------


@dataclass
class BatchedLayout:
    """Per-row inputs laid out as ``[B, q_max]`` over a :class:`RaggedKVCache`.

    Attributes:
        real: per row, [q_i] int64 window positions of its real inputs (the rest is padding).
        mask: [B, 1, q_max, hi - lo] additive float mask (committed slots + the inputs' own mask).
        plan: the :class:`WritePlan` to set on the cache for the forward.
    """

    real: list[torch.Tensor]
    mask: torch.Tensor
    plan: WritePlan
    q_max: int

    def scatter(self, values: list[torch.Tensor], fill=0) -> torch.Tensor:
        """Per-row values [q_i, ...] -> [B, q_max, ...] with ``fill`` at the padding."""
        v0 = values[0]
        out = v0.new_full((len(values), self.q_max, *v0.shape[1:]), fill)
        for i, (v, j) in enumerate(zip(values, self.real)):
            out[i, j.to(out.device)] = v
        return out

    def gather(self, batched: torch.Tensor) -> list[torch.Tensor]:
        """[B, q_max, ...] -> per-row values at the real inputs."""
        return [batched[i, j.to(batched.device)] for i, j in enumerate(self.real)]


def batched_layout(
    cache: "RaggedKVCache",
    rows: list[int],
    masks: list[torch.Tensor],
    slots: list[torch.Tensor],
    dtype: torch.dtype,
    left_pad: bool = False,
    lo: int = 0,
) -> BatchedLayout:
    """Lay per-row inputs out as ``[B, q_max]`` (padding on the right, or the left for aligned prefills).

    Row i's real inputs write their keys/values to ``slots[i]`` and see each other through ``masks[i]``
    ([q_i, q_i] bool, query x key) plus the row's committed slots (``cache.valid``). Padding inputs
    continue the row's slots on the padding side and see only themselves.

    Args:
        cache: the cache (rows, ``valid``).
        rows: cache row of each batch row.
        masks: [q_i, q_i] bool per row.
        slots: [q_i] int64 per row.
        dtype: mask dtype (the model's).
        left_pad: pad on the left (real inputs end the window).
        lo: first slot attention reads.
    """
    device = cache.valid.device
    b = len(rows)
    q_max = max(s.numel() for s in slots)
    slot = torch.zeros(b, q_max, dtype=torch.long, device=device)
    own = torch.eye(q_max, dtype=torch.bool, device=device).repeat(b, 1, 1)  # pads see only themselves
    real = []
    for i, (m, s) in enumerate(zip(masks, slots)):
        k, pad = s.numel(), q_max - s.numel()
        # window positions of the real inputs, kept on the host (BatchedLayout.real: read as ints, moved to index)
        j = torch.arange(pad, q_max, device="cpu") if left_pad else torch.arange(k, device="cpu")
        real.append(j)
        own[i, j[:, None], j[None, :]] = m.to(device)
        pad_slots = s[0] - pad + torch.arange(pad, device=device) if left_pad else s[-1] + 1 + torch.arange(pad, device=device)
        slot[i] = torch.cat([pad_slots, s]) if left_pad else torch.cat([s, pad_slots])
    hi = int(slot.max()) + 1
    row_t = torch.tensor(rows, dtype=torch.long, device=device)
    allowed = cache.valid[row_t, lo:hi][:, None, :].expand(b, q_max, hi - lo).clone()  # [B, q, kv] committed
    allowed.scatter_(2, (slot - lo)[:, None, :].expand(b, q_max, q_max), own)  # the inputs' own slots
    mask = torch.zeros(b, 1, q_max, hi - lo, dtype=dtype, device=device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    all_rows = list(rows) == list(range(cache.batch_size))
    plan = WritePlan(row_t[:, None].expand(b, q_max), slot, None if all_rows else row_t, lo, hi)
    return BatchedLayout(real, mask, plan, q_max)


# ---------------------------------------------------------------------------------------------
# Packed ("unpad input tokens") attention
# ---------------------------------------------------------------------------------------------


def grouped_attention(query, key, value, mask, scale: float | None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with grouped-query heads folded into the query axis (two batched
    matmuls, no key/value repeat).

    Args:
        query: [B, h, q, hd]; key, value: [B, h_kv, kv, hd] (h a multiple of h_kv);
        mask: [B, 1, q, kv] additive float mask (no query row fully masked).

    Returns:
        [B, h, q, hd]. Measured on the 2-core CPU (h 9, h_kv 3, hd 64, kv 210) against sdpa's fused CPU
        kernel: B 16, q 2: 0.50 vs 1.10 ms per call; q 5: 0.82 vs 1.48; q 1: 0.47 vs 0.42 (so q = 1 keeps sdpa).
    """
    b, h, q, hd = query.shape
    h_kv, kv = key.shape[1], key.shape[2]
    g = h // h_kv
    scale = hd**-0.5 if scale is None else scale
    scores = torch.matmul(query.reshape(b, h_kv, g * q, hd), key.transpose(-1, -2)).view(b, h_kv, g, q, kv)
    scores = scores.mul_(scale).add_(mask[:, :, None])  # [B, h_kv, g, q, kv] + [B, 1, 1, q, kv]
    probs = torch.softmax(scores, dim=-1).view(b, h_kv, g * q, kv)
    return torch.matmul(probs, value).view(b, h, q, value.shape[-1])  # MLA: values of their own size


def exact_attention(query, key, value, mask, scale: float | None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(softcap(q k^T * scale) + mask) v, with learned attention sinks where given: the eager attention of the
    families that have them (Gemma-2's logit soft-capping ``c * tanh(x / c)``; gpt-oss's per-head sink logit, one
    more softmax column that takes probability mass and is dropped), grouped-query heads folded as in
    :func:`grouped_attention`.

    Args:
        query: [B, h, q, hd_k]; key: [B, h_kv, kv, hd_k]; value: [B, h_kv, kv, hd_v]; mask: [B or 1, 1, q, kv]
            additive float mask or None; softcap: the cap c (None: none); sinks: [h] logits (None: none).

    Returns:
        [B, h, q, hd_v] in the query's dtype (computed in float32).
    """
    b, h, q, hd = query.shape
    h_kv, kv = key.shape[1], key.shape[2]
    g = h // h_kv
    scale = hd**-0.5 if scale is None else scale
    scores = torch.matmul(query.float().reshape(b, h_kv, g * q, hd), key.float().transpose(-1, -2)) * scale
    scores = scores.view(b, h_kv, g, q, kv)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.float()[:, :, None]  # [B, 1, 1, q, kv]
    if sinks is not None:
        sink = sinks.float().reshape(1, h_kv, g, 1, 1).expand(b, h_kv, g, q, 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.reshape(b, h_kv, g * q, kv), value.float())
    return out.view(b, h, q, value.shape[-1]).to(query.dtype)


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    ragged_segments: RaggedSegments | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of packed sequences against their own cache rows (EMS-SD Appendix D, Algorithm 2).

    A decoding step, a batched verification step of up to ``fastattention.MAX_QUERIES`` queries per
    sequence, or one sequence's tree of up to ``fastattention.MAX_QUERIES_ONE`` (not a packed prefill)
    goes to drafttrain's decode-attention kernel where
    :func:`drafttrain.target.fastattention.usable` says it applies (each key/value head read once for its group
    of query heads; 2-3x less time than sdpa at batch 16-64, docs/benchmarks/decode_attention.md).
    Otherwise, without ``ragged_segments`` it is transformers' sdpa attention, unchanged. With them, each
    sequence's queries attend to its own cache row only. ``ragged_segments.batched`` (default) runs
    that as ONE attention call per layer (sdpa's causal kernel for a packed prefill, else the decode
    kernel where it applies, else sdpa for one query per sequence or :func:`grouped_attention`):
    the queries are gathered into ``[B, h, q_max, hd]`` (a sequence with fewer
    than q_max inputs repeats its last query; those outputs are dropped) against ``keys[rows, :, :kv_max]``
    with each token's own mask row, so a step of 16 sequences costs one attention call per layer
    instead of 16 (measured at batch 16, one 2-token tree among 1-token rows: 195 -> ~158 ms per
    forward, against 144 ms for a plain [16, 1] step). Only the attention kernel sees the repeated
    queries; the linear layers, the cache and the outputs stay unpadded. Otherwise one call per
    sequence (EMS-SD Algorithm 2 as written).

    Args:
        query: [1, h, N, hd] packed queries.
        key, value: [b, h_kv, kv, hd] every cache row (views of the :class:`RaggedKVCache` buffers).
        attention_mask: [1, 1, N, kv] additive float mask; token t's row is in *its own* sequence's
            slot coordinates.
        ragged_segments: token ranges, cache rows and read lengths of the sequences.

    Returns:
        ([1, N, h, hd] attention output, None).
    """
    if kwargs.get("drafttrain_probe") is not None:  # attention_kwargs_reach(): the kwarg made it down here
        kwargs.pop("drafttrain_probe").append(True)
    sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
    exact = sinks is not None or bool(softcap)  # a family's own softmax (sinks, soft-capping): exact_attention
    if ragged_segments is None and exact:
        mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
        return exact_attention(query, key, value, mask, scaling, softcap, sinks).transpose(1, 2), None
    if ragged_segments is None:
        # decoding / verification (usable: up to MAX_QUERIES per row): drafttrain's kernel; several queries
        # only with an explicit mask (without one sdpa would be causal)
        if not dropout and (attention_mask is not None or query.shape[2] == 1):
            mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
            if fastattention.usable(query, key, value, mask):
                return fastattention.decode_attention(query, key, value, mask, scaling).transpose(1, 2), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    seg = ragged_segments
    if seg.batched and len(seg.starts) > 1:  # one call for the whole batch (plan built once per forward)
        plan = seg.gather_plan(attention_mask)
        kv, rows = plan["kv_max"], plan["rows"]
        k = key[rows, :, :kv] if isinstance(rows, slice) else key.index_select(0, rows)[:, :, :kv]
        v = value[rows, :, :kv] if isinstance(rows, slice) else value.index_select(0, rows)[:, :, :kv]
        qb = query[0][:, plan["q_idx"]].transpose(0, 1)  # [h, B, q_max, hd] -> [B, h, q_max, hd]
        if exact:
            out = exact_attention(qb, k, v, plan["mask"], scaling, softcap, sinks)
        elif plan["causal"]:  # a packed prefill: sdpa's causal kernel, no mask, no masked-out work
            # Real query j of a sequence sees its keys 0..j (< its length); the repeated queries past
            # its end see other slots, and their outputs are dropped. Measured on the 2-core CPU, the
            # engine prefilling 47 ShareGPT prompts (up to 218 tokens) at once: 12.4 / 11.4 -> 9.1 / 8.5 s
            # against grouped_attention with the materialised mask (64 x 200 tokens: 69 vs 177 ms a layer).
            out = torch.nn.functional.scaled_dot_product_attention(
                qb, k, v, is_causal=True, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
            )
        elif fastattention.usable(qb, k, v, plan["mask"]):  # a decoding / verification step: drafttrain's kernel
            out = fastattention.decode_attention(qb, k, v, plan["mask"], scaling)  # [B, h, q_max, hd]
        elif qb.shape[2] == 1:  # one query per sequence: sdpa's fused kernel
            out = torch.nn.functional.scaled_dot_product_attention(
                qb, k, v, attn_mask=plan["mask"], scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
            )  # [B, h, q_max, hd]
        else:
            out = grouped_attention(qb, k, v, plan["mask"], scaling)
        out = out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])[plan["out_idx"]]  # [N, h, hd]
        return out[None], None
    outs = []
    for s, e, row, kv in zip(seg.starts, seg.ends, seg.rows, seg.kv_lens):
        args = (query[:, :, s:e], key[row : row + 1, :, :kv], value[row : row + 1, :, :kv])  # [1, h, q_i, hd], [1, h_kv, kv_i, hd] x 2
        mask = attention_mask[:, :, s:e, :kv]  # [1, 1, q_i, kv_i]
        if exact:
            outs.append(exact_attention(*args, mask, scaling, softcap, sinks))
        elif fastattention.usable(*args, mask, max_queries=fastattention.MAX_QUERIES_ONE):  # one sequence's tree
            outs.append(fastattention.decode_attention(*args, mask, scaling))
        else:
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                *args, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]))  # fmt: skip
    out = torch.cat(outs, dim=2)  # [1, h, N, hd]
    return out.transpose(1, 2).contiguous(), None  # [1, N, h, hd]


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)


@torch.no_grad()
def attention_kwargs_reach(target) -> bool:
    """Whether keyword arguments of the backbone's forward reach its attention function (a 2-token probe, read once
    per target): the packed forward hands its :class:`RaggedSegments` down that way, so a model whose layers drop
    them (StableLM) runs the engine's batched layout instead, which needs nothing but the mask and the cache."""
    cached = getattr(target, "_attention_kwargs_reach", None)
    if cached is not None:
        return cached
    seen: list[bool] = []
    backbone = target.backbone  # (its structure is read first, outside the probe's attention implementation)
    ids = torch.zeros(1, 2, dtype=torch.long, device=target.device)
    dtype = next(target.model.parameters()).dtype
    mask = torch.zeros(1, 1, 2, 2, dtype=dtype, device=target.device)
    mask[..., 0, 1] = torch.finfo(dtype).min  # causal, as the engine's own masks
    try:
        with attention_implementation(target.model, RAGGED_ATTENTION):
            backbone(input_ids=ids, attention_mask=mask, use_cache=False, drafttrain_probe=seen)
    except Exception:  # noqa: BLE001 - a forward that refuses unknown keywords: they do not reach it
        seen.clear()
    target._attention_kwargs_reach = bool(seen)
    return target._attention_kwargs_reach


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str):
    """Run ``model`` with attention implementation ``name`` inside the block, then restore the previous one.

    transformers' attention modules look ``config._attn_implementation`` up at every call, so the
    switch is per forward and leaves the model as it was (other users of the target are unaffected).
    """
    config = model.config
    old = config._attn_implementation
    if old == name:
        yield
        return
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old
