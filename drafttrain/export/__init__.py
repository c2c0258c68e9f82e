"""Export a trained drafter to the folders serving engines load (docs/design.md, "Serving formats").

Split by concern: :mod:`~drafttrain.export.formats` (the formats, what each engine's folder is; which drafters
write one is each drafter's own declaration, ``Drafter.serving_formats``), one module per format (``export``,
``load``, ``layout``), :mod:`~drafttrain.export.commands` (the serve lines), :mod:`~drafttrain.export.run`
(exporting a run: K, the lines, ``export_info.json``), :mod:`~drafttrain.export.verify` (an exported folder
checked before it is read), :mod:`~drafttrain.export.speculation` and :mod:`~drafttrain.export.vllm_profile` (K
from the cost model or from vLLM's measured speedups). This module re-exports the public names.

ParallelSpec's Medusa and EAGLE integrations (``parallelspec``, ``parallelspec_eagle``) declare no format: no
engine runs their mask-token drafting over a fc([e; f]) item layer.
"""

from __future__ import annotations

from drafttrain.export.commands import (CPU_KV_CACHE_GB, CPU_MAX_MODEL_LEN, CPU_MEMORY_UTILIZATION, alternative_label,
                                        concurrency_note, serve_alternatives, serve_commands, shell_line,
                                        vllm_cpu_command, vllm_speculative_config)  # fmt: skip
from drafttrain.export.common import ExportError
from drafttrain.export.formats import FORMATS, VLLM_METHOD, Format, format_table, formats_for, module, resolve_format
from drafttrain.export.run import export_drafter, export_run, load_exported, vllm_cpu_refusal, vllm_profile_for

__all__ = ["CPU_KV_CACHE_GB", "CPU_MAX_MODEL_LEN", "CPU_MEMORY_UTILIZATION", "FORMATS", "VLLM_METHOD", "ExportError",
           "Format", "alternative_label", "concurrency_note", "export_drafter", "export_run", "format_table",
           "formats_for", "load_exported", "module", "resolve_format", "serve_alternatives", "serve_commands",
           "shell_line", "vllm_cpu_command", "vllm_cpu_refusal", "vllm_profile_for", "vllm_speculative_config"]
