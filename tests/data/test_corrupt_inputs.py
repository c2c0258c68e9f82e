"""Corrupt inputs get a clear error, or are skipped and counted.

Why: a truncated shard, manifest or feature-cache file used to surface as a pyarrow / json traceback
naming neither the file nor what to do, and one undecodable ShareGPT record in the middle of the
file silently ended the read there (every later conversation was lost without a count).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import datasets
import pytest

from drafttrain.data.feature_cache import build_feature_cache, load_feature_cache
from drafttrain.data.selfdistill import load_generated
from drafttrain.data.shards import CorruptFileError, ShardStore
from drafttrain.data.sources import LoadStats, load_sharegpt


def _conv(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}


def _truncate(folder: Path) -> Path:
    arrow = sorted(folder.glob("*.arrow"))[0]
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    return arrow


@pytest.mark.parametrize("bad", ['{"id": "bad", "conversations": [{"from": "human" "value": "x"}]}',  # missing comma
                                 '{"id": "bad", "conversations": "\\q"}',  # invalid escape
                                 'nonsense'])  # fmt: skip
def test_undecodable_sharegpt_record_mid_file_is_skipped_and_counted(tmp_path, bad):
    good = [json.dumps(_conv(i)) for i in range(4)]
    path = tmp_path / "sg.json"
    path.write_text("[" + ", ".join(good[:2] + [bad] + good[2:]) + "]")
    stats = LoadStats(name="sharegpt")
    convs = load_sharegpt(path, stats=stats)
    assert [c["id"] for c in convs] == ["c0", "c1", "c2", "c3"]  # reading resumed after the bad record
    assert stats.skipped == collections.Counter({"malformed record": 1})
    assert (stats.read, stats.kept) == (5, 4)


def test_truncated_sharegpt_tail_still_ends_the_read(tmp_path):
    text = "[" + ", ".join(json.dumps(_conv(i)) for i in range(3)) + "]"
    path = tmp_path / "sg.json"
    path.write_text(text[: len(text) - 20])  # cut inside the last record
    stats = LoadStats(name="sharegpt")
    assert [c["id"] for c in load_sharegpt(path, stats=stats)] == ["c0", "c1"]
    assert stats.skipped == collections.Counter({"truncated record": 1})


def _store(tmp_path) -> ShardStore:
    store = ShardStore(tmp_path / "job", {"fingerprint": "f1"})
    store.write(0, datasets.Dataset.from_dict({"input_ids": [[1, 2, 3] * 50] * 20}), {"rows": 20})
    return store


def test_corrupt_manifest_names_the_file_and_what_to_do(tmp_path):
    store = _store(tmp_path)
    store.path.write_text('{"job": {"fingerprint": "f1"}, "shar')  # truncated
    with pytest.raises(CorruptFileError, match=r"manifest\.json is corrupt .*delete the folder .*job and rerun"):
        ShardStore(tmp_path / "job", {"fingerprint": "f1"})


def test_truncated_shard_names_it_and_is_made_again_once_deleted(tmp_path):
    store = _store(tmp_path)
    _truncate(store.shard_dir(0))
    with pytest.raises(CorruptFileError, match=r"shard_00000 cannot be read .*delete .*shard_00000 and rerun"):
        store.load(0)
    import shutil

    shutil.rmtree(store.shard_dir(0))  # what the message says to do
    assert not ShardStore(tmp_path / "job", {"fingerprint": "f1"}).is_done(0)  # -> the rerun makes it again


@pytest.fixture()
def feature_cache(tiny_target, tmp_path):
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]})
    out = tmp_path / "fc"
    build_feature_cache(tiny_target, ds, out, shard_size=2, progress=False)
    return ds, out


def test_corrupt_feature_cache_files_name_the_file(feature_cache):
    ds, out = feature_cache
    assert len(load_feature_cache(out, ds)) == 3
    _truncate(out / "shard_00001")
    with pytest.raises(CorruptFileError, match=r"shard_00001 cannot be read .*delete .*shard_00001 and rerun `python -m scripts.cache_features`"):
        load_feature_cache(out, ds)
    (out / "feature_cache.json").write_text("{not json")
    with pytest.raises(CorruptFileError, match=r"feature_cache\.json is corrupt .*delete it and rerun"):
        load_feature_cache(out, ds)


def test_corrupt_generated_dataset_names_the_folder(tmp_path):
    folder = tmp_path / "gen" / "dataset"
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3] * 50] * 20}).save_to_disk(str(folder))
    _truncate(folder)
    with pytest.raises(CorruptFileError, match=r"dataset cannot be read .*delete .*dataset and rerun"):
        load_generated(tmp_path / "gen")
