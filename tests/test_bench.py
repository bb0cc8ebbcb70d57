"""`dflash-mlx bench` on the tiny demo pair: every method runs, the report has its fields, the oracle fills blocks."""

import importlib.util
import json
import math

import mlx.core as mx
import pytest

from dflash_mlx.bench.prompts import encode_prompt, load_prompts
from dflash_mlx.cli import main
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.errors import DFlashError

BLOCK = 4
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair"), block_size=BLOCK)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [{"id": "hello", "prompt": "Hello there, how are you?"}, {"turns": ["def add(a, b):", "and more"]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def report(pair, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--ar-draft", str(pair[0]), "--oracle",
                 "--prompts", str(prompts_file), "--num-prompts", "2", "--max-tokens", str(MAX_TOKENS),
                 "--widths", str(BLOCK), "--num-draft", "2", "--verify-prompts", "1", "--ignore-eos",
                 "--random-draft",
                 "--out", str(out)])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), out


def _method(report, kind):
    return next(m for m in report["methods"] if m["kind"] == kind)


def test_report_has_every_method_and_field(report, capsys):
    data, _ = report
    assert [m["name"] for m in data["methods"]] == ["mlx-lm", "oracle adaptive", f"oracle B={BLOCK}",
                                                    "mlx-lm spec k=2", "dflash adaptive", "dflash+lookup adaptive",
                                                    f"dflash B={BLOCK}", "random adaptive", "lookup adaptive"]
    for m in data["methods"]:
        for key in ("tok_s", "speedup", "tau", "histogram", "widths", "cycles", "peak_memory_gb", "identical",
                    "seconds", "sources"):
            assert key in m, key
        assert m["tokens"] == 2 * MAX_TOKENS
        assert m["tok_s"] > 0 and m["peak_memory_gb"] > 0
    assert _method(data, "mlx-lm")["speedup"] == pytest.approx(1.0)
    assert _method(data, "mlx-lm")["tau"] == 1.0
    for kind in ("dflash", "oracle"):  # the profiled run splits their time into phases
        phases = _method(data, kind)["phases_ms_per_cycle"]
        assert set(phases) == {"draft", "verify", "rollback", "host"} and phases["verify"] > 0
    assert _method(data, "mlx-lm-spec")["phases_ms_per_cycle"] is None
    assert data["verify_cost"]["prompts"] == 1
    assert data["verify_cost"]["relative"]["1"] == 1.0
    assert {"4", "8", "16"} <= set(data["verify_cost"]["relative"])
    assert set(data["verify_cost"]["draft_steps"]) == {str(BLOCK)} and data["verify_cost"]["draft_steps"][str(BLOCK)] > 0
    assert [p["id"] for p in data["prompts"]] == ["hello", "2"]
    assert data["config"]["block_sizes"] == [BLOCK]


def test_outputs_equal_plain_decoding(report):
    data, _ = report
    for m in data["methods"]:
        assert m["identical"] == m["prompts"] == 2, m["name"]


def test_oracle_fills_every_block_but_the_last(report):
    data, _ = report
    for prompt in data["prompts"]:
        run = prompt["runs"][f"oracle B={BLOCK}"]
        # The prefill makes the first token; the rest come in full blocks, the last one clamped to what is left.
        assert run["cycles"] == math.ceil((run["tokens"] - 1) / BLOCK)
    oracle = next(m for m in data["methods"] if m["name"] == f"oracle B={BLOCK}")
    assert set(oracle["histogram"]) <= {str(BLOCK), str((MAX_TOKENS - 1) % BLOCK)}
    assert set(oracle["widths"]) <= {str(BLOCK), str((MAX_TOKENS - 1) % BLOCK)}
    # The target as its own AR draft: every draft is accepted.
    assert _method(data, "mlx-lm-spec")["tau"] == pytest.approx(MAX_TOKENS / math.ceil(MAX_TOKENS / 3))


def test_chart_written_when_matplotlib_present(report):
    data, out = report
    if importlib.util.find_spec("matplotlib") is None:
        assert any("matplotlib" in n for n in data["notes"])
    else:
        assert (out / "bench.png").stat().st_size > 1000


def test_profiler_hook_marks_phases_and_changes_nothing(pair):
    from dflash_mlx import load
    from dflash_mlx.api import prepare
    from dflash_mlx.decode.loop import dflash_generate_step

    class Recorder:
        def __init__(self):
            self.marks = []

        def mark(self, phase, *arrays):
            mx.eval(*arrays)
            self.marks.append(phase)

    model, tokenizer, drafter = load(str(pair[0]), str(pair[1]))
    target = prepare(model, drafter)
    ids = mx.array(encode_prompt(tokenizer, "Hello"), dtype=mx.int32)
    plain = [t for c in dflash_generate_step(ids, target, drafter, max_tokens=9) for t in c.tokens]
    recorder = Recorder()
    profiled = [t for c in dflash_generate_step(ids, target, drafter, max_tokens=9, profiler=recorder)
                for t in c.tokens]
    assert profiled == plain
    assert recorder.marks[0] == "prefill"
    cycle = ["host", "draft", "verify", "host", "rollback"]
    assert recorder.marks[1:6] == cycle and set(recorder.marks[1:]) == set(cycle)


def test_prompt_sources(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "a"}\n\n{"turns": ["b", "c"], "question_id": 7}\n{"prompt": "d"}\n')
    assert [(p.id, p.text) for p in load_prompts(str(path), 2)] == [("1", "a"), ("7", "b")]
    path.write_text('{"other": 1}\n')
    with pytest.raises(DFlashError, match="has no prompt"):
        load_prompts(str(path))
    with pytest.raises(DFlashError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_editing_set_and_lookup_methods(pair, tmp_path):
    """The shipped editing prompts load; `--draft lookup` runs lookup alone beside plain decoding, and its passes
    are counted per source; `--no-lookup` leaves the lookup methods out."""
    editing = load_prompts("editing")
    assert len(editing) == 20 and all("```python" in p.text for p in editing)
    code = main(["bench", "--model", str(pair[0]), "--draft", "lookup", "--prompts", "editing", "--num-prompts", "1",
                 "--max-tokens", "8", "--no-profile", "--verify-prompts", "0", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [m["name"] for m in data["methods"]] == ["mlx-lm", "lookup adaptive"]
    lookup = data["methods"][1]
    assert lookup["identical"] == 1 and sum(s["tokens"] for s in lookup["sources"].values()) == lookup["tokens"] - 1
    code = main(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--prompts", "editing", "--num-prompts",
                 "1", "--max-tokens", "4", "--no-profile", "--no-fixed-draft", "--verify-prompts", "0", "--no-lookup",
                 "--out", str(tmp_path)])
    assert code == 0
    assert [m["name"] for m in json.loads((tmp_path / "bench.json").read_text())["methods"]] == ["mlx-lm",
                                                                                                "dflash adaptive"]


def test_bench_needs_something_to_compare(pair, capsys):
    code = main(["bench", "--model", str(pair[0])])
    assert code == 2
    assert "give --draft, --ar-draft or --oracle" in capsys.readouterr().err


def test_no_fixed_draft_and_profile_prompts(pair, prompts_file, tmp_path):
    code = main(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--prompts", str(prompts_file),
                 "--num-prompts", "2", "--max-tokens", "6", "--widths", str(BLOCK), "--no-fixed-draft",
                 "--profile-prompts", "1", "--verify-prompts", "0", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [m["name"] for m in data["methods"]] == ["mlx-lm", "dflash adaptive", "dflash+lookup adaptive",
                                                    "lookup adaptive"]
    assert [bool(p["runs"]["dflash adaptive"].get("phases_s")) for p in data["prompts"]] == [True, False]


def test_no_drafter_alone_keeps_the_lookup_methods(pair, prompts_file, tmp_path):
    code = main(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--prompts", str(prompts_file),
                 "--num-prompts", "1", "--max-tokens", "4", "--no-profile", "--no-fixed-draft", "--verify-prompts", "0",
                 "--no-drafter-alone", "--out", str(tmp_path)])
    assert code == 0
    assert [m["name"] for m in json.loads((tmp_path / "bench.json").read_text())["methods"]] == [
        "mlx-lm", "dflash+lookup adaptive", "lookup adaptive"]


def test_sampled_bench_is_reproducible_with_a_seed(pair, prompts_file, tmp_path):
    """`bench --temp 0.7 --seed 1` twice: every method's output is the same token for token. Sampled DFlash output
    depends on the verify widths, so the adaptive method must choose them from acceptance alone, not the clock."""
    outputs = []
    for run in range(2):
        out = tmp_path / f"run{run}"
        code = main(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--prompts", str(prompts_file),
                     "--num-prompts", "2", "--max-tokens", "24", "--temp", "0.7", "--seed", "1", "--ignore-eos",
                     "--no-profile", "--verify-prompts", "0", "--out", str(out)])
        assert code == 0
        report = json.loads((out / "bench.json").read_text())
        outputs.append({(p["id"], name): r["output"] for p in report["prompts"] for name, r in p["runs"].items()})
    assert any("adaptive" in name for _, name in outputs[0])
    assert outputs[0] == outputs[1]
