"""An exported folder is checked when it is read back (drafttrain.export.verify): each tampering is refused
with its own named message before any model or engine starts, and the clean folder passes.

Why: ``load_exported`` and ``scripts.serve_check`` used to load whatever the folder held: a truncated or
edited weight file, a d2t removed from a restricted-vocabulary EAGLE-3 folder (the engine then drafts the
wrong tokens), a config.json whose sizes no longer match the weights, or a drafter served with another target.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drafttrain.drafters import build_drafter
from drafttrain.export import ExportError, export_run, load_exported
from drafttrain.export.verify import sha256_file, verify_export

WEIGHTS = "model.safetensors"


def _tiny(seed: int = 0):
    """A tiny random target with 8 layers: EAGLE-3's default layer ids (2, 4, 5) are distinct there."""
    from drafttrain.config import TargetConfig
    from drafttrain.target import load_target
    from helpers import need_input

    return need_input(lambda: load_target(TargetConfig(random_init=True, num_hidden_layers=8, seed=seed)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A restricted-vocabulary EAGLE-3 drafter of a tiny target saved to disk, exported by scripts.export's
    path (:func:`export_run`) to the speculators format."""
    base = tmp_path_factory.mktemp("verify")
    target = _tiny()
    tdir = base / "target"
    target.model.save_pretrained(tdir)
    target.tokenizer.save_pretrained(tdir)
    torch.manual_seed(0)
    drafter = build_drafter("eagle3", {"draft_vocab_size": 300}, target)
    drafter.set_draft_vocab(torch.randperm(drafter.vocab_size, generator=torch.Generator().manual_seed(0))[:300])
    run = base / "run"
    drafter.save_pretrained(run / "drafter")
    (run / "config.json").write_text(json.dumps({"target": {"name": "tiny8", "path": str(tdir)}}))
    out = export_run(run, "speculators", base / "export", target=target)
    return SimpleNamespace(target=target, target_dir=tdir, out=out, base=base)


@pytest.fixture
def copy(exported, tmp_path):
    """A fresh copy of the clean exported folder, to tamper with."""
    return Path(shutil.copytree(exported.out, tmp_path / "export"))


def _info(folder: Path) -> dict:
    return json.loads((folder / "export_info.json").read_text())


def _set_info(folder: Path, info: dict) -> None:
    (folder / "export_info.json").write_text(json.dumps(info, indent=2))


def test_every_format_is_checked():
    """Every format's module states its layout (the sizes verify_export checks) and writes the checked weight file."""
    from drafttrain.export import FORMATS, module
    from drafttrain.export.verify import CHECKED_FORMATS, WEIGHTS as CHECKED_WEIGHTS

    assert set(CHECKED_FORMATS) == set(FORMATS)
    assert all(module(f).WEIGHTS == CHECKED_WEIGHTS and callable(module(f).layout) for f in FORMATS)


def test_clean_export_records_digests_and_passes(exported):
    from drafttrain.fingerprint import folder_fingerprint

    info = _info(exported.out)
    rec = info["files"][WEIGHTS]
    assert rec == {"sha256": sha256_file(exported.out / WEIGHTS), "bytes": (exported.out / WEIGHTS).stat().st_size}
    assert info["draft_vocab_size"] == 300 and info["format"] == "speculators"
    assert info["target"]["hidden_size"] == exported.target.config.hidden_size
    assert info["target"]["vocab_size"] == exported.target.lm_head.weight.shape[0]
    assert info["target"]["fingerprint"] == folder_fingerprint(exported.target_dir)
    assert "commands" in info and info["target_path"] == str(exported.target_dir.resolve())  # export_run's keys kept
    for target in (None, exported.target_dir, exported.target, exported.target.config):
        assert verify_export(exported.out, target)["files"] == info["files"]
    back = load_exported(exported.out, "speculators", exported.target)
    assert back.d2t.numel() == 300


def test_flipped_byte_is_refused_by_digest(exported, copy):
    data = bytearray((copy / WEIGHTS).read_bytes())
    data[-5] ^= 0x01  # inside the tensor data: the header still parses, the size is the same
    (copy / WEIGHTS).write_bytes(bytes(data))
    msg = "model.safetensors does not match export_info.json's sha256: the folder was modified or truncated after export"
    with pytest.raises(ExportError, match=msg):
        verify_export(copy)
    with pytest.raises(ExportError, match=msg):  # the reader refuses before building a drafter
        load_exported(copy, "speculators", exported.target)


def test_truncated_weights_are_refused(copy):
    data = (copy / WEIGHTS).read_bytes()
    (copy / WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match=rf"model.safetensors is {len(data) // 2} bytes, export_info.json recorded "
                                          rf"{len(data)}: the file was truncated"):  # fmt: skip
        verify_export(copy)


def test_missing_files_are_refused(copy):
    (copy / WEIGHTS).unlink()
    with pytest.raises(ExportError, match="has no model.safetensors"):
        verify_export(copy)
    (copy / "export_info.json").unlink()
    with pytest.raises(ExportError, match="has no export_info.json: not a folder written by scripts.export"):
        verify_export(copy)


def test_restricted_vocabulary_without_d2t_is_refused(copy):
    """d2t removed and the digest fixed: only the vocabulary-map check can catch it."""
    from safetensors.torch import load_file, save_file

    w = load_file(str(copy / WEIGHTS))
    assert w["d2t"].shape == (300,)
    del w["d2t"]
    save_file(w, str(copy / WEIGHTS), metadata={"format": "pt"})
    info = _info(copy)
    info["files"][WEIGHTS] = {"sha256": sha256_file(copy / WEIGHTS), "bytes": (copy / WEIGHTS).stat().st_size}
    _set_info(copy, info)
    with pytest.raises(ExportError, match=r"model.safetensors has no d2t: a draft vocabulary of 300 < the target's "
                                          r"\d+ tokens needs d2t/t2d"):  # fmt: skip
        verify_export(copy)


def test_config_hidden_size_inconsistent_with_weights_is_refused(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["target_hidden_size"] = 2 * cfg["target_hidden_size"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"config.json is inconsistent with model.safetensors: its sizes give "
                                          r"fc.weight \[64, 384\], the file holds \[64, 192\]"):  # fmt: skip
        verify_export(copy)


def test_another_target_is_refused(exported, tmp_path):
    """Same sizes, other weights: the fingerprint tells them apart; another hidden size: the sizes do."""
    other = _tiny(seed=1)
    odir = tmp_path / "other"
    other.model.save_pretrained(odir)
    with pytest.raises(ExportError, match=r"was exported for target .* \(fingerprint \w+\); .* is another model"):
        verify_export(exported.out, odir)
    wide = exported.target.config.to_dict() | {"hidden_size": 128}
    with pytest.raises(ExportError, match="was exported for a target with hidden size 64; the given target config has 128"):
        verify_export(exported.out, wide)


def test_old_export_without_digests_warns_once_and_checks_the_rest(copy, caplog):
    info = _info(copy)
    del info["files"]
    _set_info(copy, info)
    with caplog.at_level(logging.WARNING, logger="drafttrain.export.verify"):
        verify_export(copy)
        verify_export(copy)
    assert sum("no weight digests" in r.getMessage() for r in caplog.records) == 1
    data = (copy / WEIGHTS).read_bytes()
    (copy / WEIGHTS).write_bytes(data[: len(data) // 2])  # no size or digest recorded: the header catches it
    with pytest.raises(ExportError, match="model.safetensors in .* is not a readable safetensors file"):
        verify_export(copy)


def test_serve_check_refuses_before_any_engine_or_model_starts(exported, copy, tmp_path, monkeypatch):
    import drafttrain.target as dt
    import scripts.serve_check as sc

    def must_not_run(*_a, **_k):
        raise AssertionError("started before the folder was checked")

    monkeypatch.setattr(sc, "run_vllm", must_not_run)
    monkeypatch.setattr(dt, "load_target", must_not_run)
    data = bytearray((copy / WEIGHTS).read_bytes())
    data[-5] ^= 0x01
    (copy / WEIGHTS).write_bytes(bytes(data))
    c = sc.ServeCheckConfig(export_dir=str(copy), vllm_python=sys.executable, output_dir=str(tmp_path / "sc"))
    with pytest.raises(ExportError, match="does not match export_info.json's sha256"):
        sc.run(c)


def test_medusa_without_token_map_is_refused(tiny_target, tmp_path):
    """The same vocabulary-map check for vLLM's Medusa layout: a truncated head needs token_map."""
    from safetensors.torch import load_file, save_file

    from drafttrain.export import export_drafter

    torch.manual_seed(0)
    drafter = build_drafter("medusa", {"num_heads": 2, "draft_vocab_size": 200}, tiny_target)
    drafter.set_draft_vocab(torch.arange(200))
    export_drafter(drafter, "vllm_medusa", tmp_path)
    assert verify_export(tmp_path, tiny_target)["draft_vocab_size"] == 200
    w = load_file(str(tmp_path / WEIGHTS))
    del w["token_map"]
    save_file(w, str(tmp_path / WEIGHTS), metadata={"format": "pt"})
    info = _info(tmp_path)
    info["files"][WEIGHTS] = {"sha256": sha256_file(tmp_path / WEIGHTS), "bytes": (tmp_path / WEIGHTS).stat().st_size}
    _set_info(tmp_path, info)
    with pytest.raises(ExportError, match=r"model.safetensors has no token_map: a draft vocabulary of 200 < the target's"):
        load_exported(tmp_path, "vllm_medusa", tiny_target)


def _fake_runner(calls):
    """run_vllm's stand-in: records the job, answers each run with the same outputs; the speculative run is
    twice as fast at one request in flight and as fast at eight (tokens/s from ``seconds``)."""

    def run_vllm(_py, job, **_kw):
        calls.append(job)
        out = []
        for r in job["runs"]:
            spec = r["speculative_config"] is not None
            passes = [{"concurrency": n, "outputs": [[1, 2, 3]] * len(job["prompts"]), "generated": 30,
                       "seconds": (0.5 if spec and n == 1 else 1.0), "metrics": {},
                       "acceptance": {"mean_acceptance_length": 1.5, "per_position": [0.5]} if spec else None}
                      for n in job["concurrency"]]  # fmt: skip
            out.append({**passes[0], "by_concurrency": passes, "vllm_version": "fake"})
        return out

    return run_vllm


@pytest.mark.parametrize("pays", [True, False])
def test_serve_check_times_the_printed_line_at_each_concurrency(exported, copy, tmp_path, monkeypatch, pays):
    """Unset num_speculative_tokens = the serve line the export printed: its K and speculative config go to vLLM,
    each concurrency is timed against plain; where the export said no K pays, that line serves the target
    alone, so only the plain engine runs and its speedup is 1.0 by construction."""
    import scripts.serve_check as sc
    from drafttrain.export.verify import read_export_info

    info = json.loads((copy / "export_info.json").read_text())
    info["speculation"] = {**(info.get("speculation") or {}), "pays": pays, "num_speculative_tokens": 2,
                           "expected_speedup": 1.2 if pays else 0.9, "schedule": [[1, 4, 2], [5, 256, 1]]}  # fmt: skip
    info["num_speculative_tokens"] = 2
    (copy / "export_info.json").write_text(json.dumps(info))
    assert read_export_info(copy)["speculation"]["pays"] is pays
    calls = []
    monkeypatch.setattr(sc, "run_vllm", _fake_runner(calls))
    c = sc.ServeCheckConfig(export_dir=str(copy), vllm_python=sys.executable, output_dir=str(tmp_path / "sc"),
                            target_path=str(exported.target_dir), num_prompts=2, max_new_tokens=4, ours=False,
                            concurrency=[1, 8])  # fmt: skip
    r = sc.run(c)
    (job,) = calls
    assert job["concurrency"] == [1, 8]
    assert [b["concurrency"] for b in r["by_concurrency"]] == [1, 8]
    if pays:
        spec = job["runs"][1]["speculative_config"]
        assert spec["num_speculative_tokens"] == 2 and spec["method"] == "eagle3"
        assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 2], [5, 256, 1]]
        assert [round(b["speedup"], 3) for b in r["by_concurrency"]] == [2.0, 1.0]
    else:
        assert [x["speculative_config"] for x in job["runs"]] == [None]
        assert r["printed_line_serves_plain"] and [b["speedup"] for b in r["by_concurrency"]] == [1.0, 1.0]
    assert "| 8 |" in (tmp_path / "sc" / "report.md").read_text()


def test_serve_check_refuses_a_bad_concurrency(exported, tmp_path):
    import scripts.serve_check as sc
    from drafttrain.config import ConfigError

    c = sc.ServeCheckConfig(export_dir=str(exported.out), vllm_python=sys.executable, concurrency=[1, 0],
                            output_dir=str(tmp_path / "sc"))  # fmt: skip
    with pytest.raises(ConfigError, match="concurrency"):
        sc.run(c)
