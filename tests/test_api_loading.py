"""The API's seams on a tiny offline pair: loading and pairing errors, the wrapper built once, `acceptor=`."""

import json
import shutil

import pytest

from dflash_mlx import api, loading
from dflash_mlx.acceptance import GreedyAcceptor
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.errors import DFlashError


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = make_tiny_pair(tmp_path_factory.mktemp("pair"))
    return (target_dir, drafter_dir), api.load(str(target_dir), str(drafter_dir))


def test_drafter_without_mask_token_fails_at_pairing(pair, tmp_path):
    (target_dir, drafter_dir), _ = pair
    broken = tmp_path / "drafter"
    shutil.copytree(drafter_dir, broken)
    raw = json.loads((broken / "config.json").read_text())
    raw.pop("mask_token_id", None)
    raw.get("dflash_config", {}).pop("mask_token_id", None)
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match="mask_token_id"):
        api.load(str(target_dir), str(broken))


def test_target_wrapper_is_built_once_per_model(pair):
    _, (model, _, drafter) = pair
    first = api.prepare(model, drafter)
    assert api.prepare(model, drafter) is first
    plain = api.prepare(model, None)
    assert plain is not first and plain.tap_layer_ids == [] and first.tap_layer_ids
    assert api.load is loading.load


def test_ready_acceptor_and_sampling_keywords(pair):
    _, (model, tokenizer, drafter) = pair
    ids = tokenizer.encode("Hello there")
    greedy = [r.token for r in api.stream_generate(model, tokenizer, ids, drafter, max_tokens=6)]
    ready = [r.token for r in api.stream_generate(model, tokenizer, ids, drafter, max_tokens=6,
                                                  acceptor=GreedyAcceptor())]
    assert ready == greedy
    with pytest.raises(DFlashError, match="not both"):
        next(api.stream_generate(model, tokenizer, ids, drafter, acceptor=GreedyAcceptor(), temp=0.5))
    with pytest.raises(DFlashError, match="tempurature"):
        next(api.stream_generate(model, tokenizer, ids, drafter, tempurature=0.5))


def test_names_resolve_one_way(tmp_path):
    assert loading.resolve_target(str(tmp_path)) == str(tmp_path)  # a path stays a path
    assert loading.shipped_drafter_for(str(tmp_path)) is None
    assert loading.dtype_name("bf16") == "bfloat16"
    with pytest.raises(DFlashError, match="--dtype 'int3'"):
        loading.dtype_name("int3")
