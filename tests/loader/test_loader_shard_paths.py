"""Issue 21, case 7: shard paths in model.safetensors.index.json stay inside the model directory."""

from __future__ import annotations

import json
import shutil

import pytest

from deepinfer.engine.loader.hf_dir import INDEX_FILE, read_weights
from deepinfer.errors import ModelLoadError
from model_factory import make_tiny_model


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sharded") / "m", "llama", shard=True)


def _with_index(tmp_path, src, rewrite):
    d = tmp_path / "model"
    shutil.copytree(src, d)
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"] = {k: rewrite(v, d) for k, v in index["weight_map"].items()}
    (d / INDEX_FILE).write_text(json.dumps(index))
    return d


def test_sharded_directory_loads(sharded):
    assert len(set(json.loads((sharded / INDEX_FILE).read_text())["weight_map"].values())) > 1
    assert read_weights(sharded)


@pytest.mark.parametrize("name", ["outside", "absolute", "dotdot_inside", "backslash", "number"])
def test_shards_outside_the_directory_are_refused(tmp_path, sharded, name):
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def rewrite(shard, d):
        # a real, loadable shard placed outside the directory: before the fix these loaded
        shutil.copy(d / shard, outside / shard)
        return {
            "outside": f"../elsewhere/{shard}",
            "absolute": str(outside / shard),
            "dotdot_inside": f"sub/../{shard}",
            "backslash": f"..\\elsewhere\\{shard}",
            "number": 7,
        }[name]

    d = _with_index(tmp_path, sharded, rewrite)
    with pytest.raises(ModelLoadError, match="not a file inside the model directory|must be strings"):
        read_weights(d)


def test_shards_in_a_subdirectory_are_fine(tmp_path, sharded):
    def rewrite(shard, d):
        (d / "parts").mkdir(exist_ok=True)
        if (d / shard).exists():
            shutil.move(d / shard, d / "parts" / shard)
        return f"parts/{shard}"

    assert read_weights(_with_index(tmp_path, sharded, rewrite))
