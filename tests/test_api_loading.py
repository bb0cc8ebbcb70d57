"""The API's seams on a tiny offline pair: loading and pairing errors, the wrapper built once, `acceptor=`, the
verify widths it reports and the collapse warning."""

import json
import logging
import shutil

import pytest

from dflash_mlx import api
from dflash_mlx.models import loading
from dflash_mlx.decode.acceptance import GreedyAcceptor
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.errors import DFlashError
from dflash_mlx.decode.width import WidthPolicy, nominal_cost


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


def test_widths_are_chosen_by_default_and_reported(pair):
    _, (model, tokenizer, drafter) = pair
    ids = tokenizer.encode("Hello there")
    adaptive = list(api.stream_generate(model, tokenizer, ids, drafter, max_tokens=12))
    fixed = list(api.stream_generate(model, tokenizer, ids, drafter, max_tokens=12, width=3))
    assert [r.token for r in adaptive] == [r.token for r in fixed]
    last = adaptive[-1]
    assert last.stats.adaptive and sum(last.widths.values()) == last.stats.cycles
    assert set(fixed[-1].widths) <= {1, 2, 3} and fixed[-1].widths.get(3, 0) >= 3 and not fixed[-1].stats.adaptive
    assert "verify widths (chosen per pass): " in last.stats.format_histogram()


@pytest.mark.parametrize("block_size, action", [(None, "falling back to plain decoding; verify widths used: 1 x "),
                                                (4, "leave --width out")])
def test_collapse_warning_says_what_the_engine_did(pair, caplog, block_size, action):
    _, (model, tokenizer, drafter) = pair  # the demo drafter has random weights: its drafts are never accepted
    # The adaptive policy runs on the nominal cost model, not the clock: on a loaded machine measured costs can
    # make a narrow width look as cheap as plain decoding, and this test is about the warning's wording.
    # Chains only: this is the width policy's fallback (auto trees re-measure theirs: test_trees_lossless.py).
    width = WidthPolicy(drafter.block_size, cost=nominal_cost) if block_size is None else None
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        responses = list(api.stream_generate(model, tokenizer, "hello", drafter, max_tokens=80,
                                             width=block_size, planner=width, tree_budget=None))
    messages = [r.getMessage() for r in caplog.records if "acceptance collapsed" in r.getMessage()]
    assert len(messages) == 1 and action in messages[0], messages
    if block_size is None:
        widths = responses[-1].widths
        assert widths[1] > 0.8 * sum(widths.values())  # it did fall back
