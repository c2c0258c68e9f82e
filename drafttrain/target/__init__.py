"""The frozen target, what its model family needs, and the CPU kernels its forward runs on: one package.

- :mod:`drafttrain.target.model`: :class:`Target` (a frozen Hugging Face causal LM driven only through its
  public forward: hidden states of the feature layers, a custom KV cache object, 4D masks, position ids)
  and :func:`load_target`. Its names are re-exported here: ``from drafttrain.target import load_target``.
- :mod:`drafttrain.target.families`: the one place that says what each model family needs (rotary call,
  embedding scale, norm offset, fused projections, MoE, sliding window, attention sinks, logit scaling).
- :mod:`drafttrain.target.fastlinear`: the target's linear layers on prepacked weights (drafttrain's C++
  small-M GEMM kernel, ``csrc/small_m_linear.cpp``, built on first use), cheap verification forwards.
- :mod:`drafttrain.target.fastattention`: decode attention against the KV cache (``csrc/decode_attention.cpp``).

Rule: this package sits under the drafters, the verifier and everything above them, and over the schemas
(:mod:`drafttrain.config`) and the pure helpers (assets, sampling, host); it imports nothing above it
(``tests/test_import_graph.py``).
"""

from drafttrain.target.model import Target, TargetOutput, load_target, resolve_feature_layers, resolve_target_dir

__all__ = ["Target", "TargetOutput", "load_target", "resolve_feature_layers", "resolve_target_dir"]
