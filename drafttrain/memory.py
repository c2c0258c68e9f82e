"""Memory a training run certainly needs, against what this host can give: a run that cannot fit fails before
the optimizer is allocated, with both numbers in one line, instead of being killed by the OOM killer minutes in.

The estimate is a LOWER bound for a micro-batch of full-length sequences (what the run must hold at once when
a batch reaches ``data.max_length``), so a run it lets through may still need more (activations, the target's
weights, the allocator's slack); it counts one set of logits per token, the losses' fp32 copy:

* the drafter's logits and their gradient over ``trainer.micro_batch_size x data.max_length x`` draft vocabulary
  (fp32, 4 bytes each, two tensors);
* the target features the batch carries: ``micro_batch_size x max_length x hidden_size x`` feature layers
  (2 bytes each: the smallest dtype they are kept in);
* the drafter's trainable parameters, their gradients and AdamW's two moments (fp32: 16 bytes a parameter).

The limit is the smallest of ``MemAvailable`` (``/proc/meminfo``) and a cgroup's limit minus its usage (v2
``memory.max - memory.current``, v1 ``memory.limit_in_bytes - memory.usage_in_bytes``), where readable;
``DRAFTTRAIN_MEMORY_LIMIT_GIB`` forces it (tests, or a host whose files say nothing). Imports nothing of
drafttrain's above the CLI helpers.
"""

from __future__ import annotations

import os
from pathlib import Path

from drafttrain.cliconfig import ConfigError

GIB = 1024**3
LIMIT_ENV = "DRAFTTRAIN_MEMORY_LIMIT_GIB"
_NO_LIMIT = 1 << 60  # cgroup v1 writes ~2^63 for "no limit"


def training_lower_bound(micro_batch_size: int, max_length: int, vocab_size: int, hidden_size: int,
                         n_feature_layers: int, n_params: int) -> int:
    """Bytes one training process certainly holds at once (see the module's list).

    Args:
        micro_batch_size: sequences per forward (``trainer.micro_batch_size``).
        max_length: tokens per sequence (``data.max_length``).
        vocab_size: the drafter's output vocabulary (its draft vocabulary, else the target's).
        hidden_size: the target's hidden size.
        n_feature_layers: target layers whose hidden states every batch carries.
        n_params: the drafter's trainable parameters.

    Returns:
        int, bytes (a lower bound).
    """
    tokens = micro_batch_size * max_length
    logits = 2 * tokens * vocab_size * 4  # logits + their gradient, fp32
    features = tokens * hidden_size * max(n_feature_layers, 1) * 2
    optimizer = n_params * 4 * 4  # params, grads, AdamW exp_avg and exp_avg_sq
    return logits + features + optimizer


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2 without limit) -> None


def available_memory(root: Path = Path("/")) -> tuple[int | None, str]:
    """The memory this process may still take: ``(bytes or None when nothing is readable, where it came from)``.

    ``root`` replaces ``/`` in the paths read (tests). ``DRAFTTRAIN_MEMORY_LIMIT_GIB`` (a float) wins.

    Raises:
        ConfigError: ``DRAFTTRAIN_MEMORY_LIMIT_GIB`` is not a positive number.
    """
    forced = os.environ.get(LIMIT_ENV)
    if forced:
        try:
            gib = float(forced)
            assert gib > 0
        except (ValueError, AssertionError):
            raise ConfigError(f"{LIMIT_ENV}={forced!r} is not a positive number of GiB; set it to e.g. 24 or unset it") from None
        return int(gib * GIB), LIMIT_ENV
    found: list[tuple[int, str]] = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
                break
    except (OSError, ValueError, IndexError):
        pass
    cg = root / "sys/fs/cgroup"
    for limit_file, usage_file, name in (("memory.max", "memory.current", "cgroup memory.max"),
                                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                          "cgroup memory.limit_in_bytes")):
        limit, usage = _read_int(cg / limit_file), _read_int(cg / usage_file)
        if limit is not None and limit < _NO_LIMIT:
            found.append((max(limit - (usage or 0), 0), f"{name} minus usage"))
    if not found:
        return None, "nothing readable"
    return min(found)


def check_training_fits(micro_batch_size: int, max_length: int, vocab_size: int, hidden_size: int,
                        n_feature_layers: int, n_params: int) -> None:
    """Refuse a run whose :func:`training_lower_bound` exceeds :func:`available_memory` (no refusal when nothing
    is readable). Arguments as :func:`training_lower_bound`.

    Raises:
        ConfigError: one line with the estimate, the limit and its source, and what to lower.
    """
    need = training_lower_bound(micro_batch_size, max_length, vocab_size, hidden_size, n_feature_layers, n_params)
    have, source = available_memory()
    if have is not None and need > have:
        raise ConfigError(
            f"trainer.micro_batch_size={micro_batch_size} x data.max_length={max_length} needs at least "
            f"~{need / GIB:.2f} GiB (drafter logits + grads over the {vocab_size}-token draft vocabulary, target "
            f"features, AdamW state for {n_params} parameters); this host has {have / GIB:.2f} GiB available "
            f"({source}); lower trainer.micro_batch_size or data.max_length")
