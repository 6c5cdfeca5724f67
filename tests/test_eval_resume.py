"""Eval output files: resuming after a torn last line, refusing other corruption, merging
the ranks' journals, and the summary's wall-time throughput."""

import json
import logging
import os

import pytest
import test_eval
from test_eval import read_results

from chunk_llama.eval import EvalConfig, load_prompt_set, run_eval
from chunk_llama.eval.cli import main as eval_main
from chunk_llama.eval.records import merge_results, read_jsonl, repair
from chunk_llama.eval.summary import render_markdown, summarize, wall_seconds
from chunk_llama.loading import load_model
from chunk_llama.settings import EngineArgs

tiny_model_dir = test_eval.tiny_model_dir  # the same tiny model and prompt set as test_eval.py

def cli_args(model_dir, out):
    return ["--model", str(model_dir), "--data", str(model_dir / "set.jsonl"), "--max-new-tokens", "6",
            "--chunk-size", "16", "--kv-cache-bytes", str(1 << 22), "--output", str(out)]


def read_runs(folder):
    with open(os.path.join(folder, "runs.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def single_run(tiny_model_dir, tmp_path_factory):
    """One process over the whole set: the reference every other way of running must equal."""
    out = tmp_path_factory.mktemp("single")
    assert eval_main(cli_args(tiny_model_dir, out)) == 0
    return out


def test_torn_last_line_is_dropped_with_a_warning_and_its_request_runs_again(
        tiny_model_dir, single_run, tmp_path, caplog):
    expected = read_results(single_run)
    assert [r["id"] for r in expected] == list(range(12))  # apps alpha 0-3, beta 4-7, gamma 8-11
    out = tmp_path / "torn"
    out.mkdir()
    # a run killed while writing the record of id 9: ids 0-8 whole, half of 9, no run record for gamma yet
    lines = [json.dumps(r) + "\n" for r in expected]
    (out / "results.jsonl").write_text("".join(lines[:9]) + lines[9][: len(lines[9]) // 2])
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_runs(single_run)
                                            if r["app"] != "gamma"))
    with caplog.at_level(logging.WARNING, logger="chunk_llama.eval.records"):
        assert eval_main(cli_args(tiny_model_dir, out)) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "chunk_llama.eval.records"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"{out / 'results.jsonl'}:10: dropped a torn last line")
    text = (out / "results.jsonl").read_text()
    assert text.endswith("\n") and read_results(out) == expected  # valid JSONL, complete, sorted by id
    gamma_runs = [r for r in read_runs(out) if r["app"] == "gamma"]
    assert [r["requests"] for r in gamma_runs] == [3]  # 9, 10, 11 ran again; 8 was done
    assert json.load(open(out / "summary.json"))["apps"]["overall"]["requests"] == 12


def test_a_malformed_line_before_the_last_is_an_error_naming_file_and_line(
        tiny_model_dir, single_run, tmp_path):
    out = tmp_path / "bad"
    out.mkdir()
    lines = [json.dumps(r) + "\n" for r in read_results(single_run)]
    lines[3] = lines[3][:20] + "\n"  # cut short, yet followed by more records: not what a crash leaves
    (out / "results.jsonl").write_text("".join(lines))
    before = (out / "results.jsonl").read_bytes()
    with pytest.raises(ValueError, match=rf"{out / 'results.jsonl'}:4: not a JSON line"):
        eval_main(cli_args(tiny_model_dir, out))
    assert (out / "results.jsonl").read_bytes() == before  # nothing truncated or rewritten
    (out / "results.jsonl").write_text("".join(lines[:3]) + '{"id": 3}\n')
    with pytest.raises(ValueError, match=r"results.jsonl:4: record lacks \['app', "):
        read_jsonl(str(out / "results.jsonl"), required=("id", "app", "correct"))


def test_repair_truncates_only_a_torn_tail(tmp_path):
    path = tmp_path / "journal.jsonl"
    cut_character = "é".encode()[:1]  # the first byte of two
    path.write_bytes(b'{"id": 1}\n{"id": 2, "output": "caf' + cut_character)
    with pytest.raises(ValueError, match=r"journal.jsonl:2: torn last line"):
        read_jsonl(str(path))
    assert read_jsonl(str(path), allow_torn_tail=True) == [{"id": 1}]
    repair(str(path))
    assert path.read_bytes() == b'{"id": 1}\n'
    path.write_bytes(b'{"id": 1}\n{"id": 2}')  # complete, only the newline missing: kept, newline added
    repair(str(path))
    assert path.read_bytes() == b'{"id": 1}\n{"id": 2}\n'


def test_merge_keeps_one_copy_of_a_result_and_refuses_two_different_ones():
    a, b = dict(id=1, app="x", output="p"), dict(id=0, app="x", output="q")
    assert merge_results([a, b, dict(a)]) == [b, a]  # a copy left by a crash between merge and cleanup
    with pytest.raises(ValueError, match="two different results for id 1"):
        merge_results([a, b, dict(a, output="other")])


def run(app, rank, started_at, seconds, generated_tokens):
    return dict(app=app, rank=rank, started_at=started_at, seconds=seconds, generated_tokens=generated_tokens,
                requests=1, peak_kv_bytes=0, peak_unshared_kv_bytes=0, prefill_tokens_reused=0,
                prefill_tokens_computed=0, parity=dict(checked=0, equal=0))


def test_throughput_divides_by_wall_time_of_parallel_runs_not_summed_seconds():
    runs = [run("a", 0, 100.0, 10.0, 500),  # ranks 0 and 1 side by side: 100 s to 111 s
            run("b", 1, 101.0, 8.0, 300), run("c", 1, 109.0, 2.0, 100),
            run("a", 0, 5000.0, 4.0, 200)]  # a resumed run much later: adds 4 s, not the gap
    results = [dict(id=i, app=r["app"], correct=False, prompt_tokens=10, shared_tokens=8, generated_tokens=1)
               for i, r in enumerate(runs)]
    assert wall_seconds(runs) == pytest.approx(11.0 + 4.0)
    summary = summarize(results, runs, dict(input_order=0, grouped_order=0), num_processes=2)
    overall = summary["apps"]["overall"]
    assert overall["wall_seconds"] == pytest.approx(15.0) and overall["generated_tokens"] == 1100
    assert overall["throughput_tokens_per_s"] == pytest.approx(1100 / 15.0)  # not 1100 / 24 (summed seconds)
    assert summary["apps"]["a"]["throughput_tokens_per_s"] == pytest.approx(700 / 14.0)
    assert summary["apps"]["b"]["throughput_tokens_per_s"] == pytest.approx(300 / 8.0)
    split = [run("d", 0, 200.0, 10.0, 100), run("d", 1, 205.0, 10.0, 100)]  # one app on two ranks at once
    assert wall_seconds(split) == pytest.approx(15.0)
    assert "generating for 15.0 s of wall time" in render_markdown(summary)


def test_ranks_merged_in_process_equal_one_process(tiny_model_dir, single_run, tmp_path):
    model, tokenizer = load_model(str(tiny_model_dir))
    dataset = load_prompt_set(str(tiny_model_dir / "set.jsonl"))
    out = tmp_path / "two"
    config = EvalConfig(output_dir=str(out), progress=False, max_new_tokens=6,
                        engine=EngineArgs(chunk_size=16, kv_cache_bytes=1 << 22))
    gathered = []

    def rank1_gather(parts):  # rank 1 hands its journals over, as gather_object would
        gathered.extend(parts)
        return parts

    assert run_eval(model, tokenizer, dataset, config, rank=1, num_processes=2, gather=rank1_gather) is None
    summary = run_eval(model, tokenizer, dataset, config, rank=0, num_processes=2,
                       gather=lambda parts: parts + gathered)
    assert read_results(out) == read_results(single_run)
    assert sorted(os.listdir(out)) == ["results.jsonl", "runs.jsonl", "summary.json", "summary.md"]
    assert sorted(r["rank"] for r in read_runs(out)) == [0, 1, 1]  # apps alpha | beta, gamma
    assert summary["num_processes"] == 2 and summary["apps"]["overall"]["requests"] == 12


def test_journals_of_a_stopped_two_process_run_are_merged_by_one_process(
        tiny_model_dir, single_run, tmp_path):
    model, tokenizer = load_model(str(tiny_model_dir))
    dataset = load_prompt_set(str(tiny_model_dir / "set.jsonl"))
    out = tmp_path / "resumed"
    config = EvalConfig(output_dir=str(out), progress=False, max_new_tokens=6,
                        engine=EngineArgs(chunk_size=16, kv_cache_bytes=1 << 22))

    class Stopped(Exception):
        pass

    def stop(parts):
        raise Stopped

    with pytest.raises(Stopped):  # rank 1 finished its apps, then the run died before the merge
        run_eval(model, tokenizer, dataset, config, rank=1, num_processes=2, gather=stop)
    assert sorted(os.listdir(out)) == ["results.rank1-of-2.jsonl", "runs.rank1-of-2.jsonl"]
    run_eval(model, tokenizer, dataset, config)
    assert read_results(out) == read_results(single_run)
    assert sorted(os.listdir(out)) == ["results.jsonl", "runs.jsonl", "summary.json", "summary.md"]
    runs = read_runs(out)
    assert sorted(r["app"] for r in runs) == ["alpha", "beta", "gamma"]  # nothing ran twice
    assert {r["app"]: r["num_processes"] for r in runs} == {"alpha": 1, "beta": 2, "gamma": 2}
