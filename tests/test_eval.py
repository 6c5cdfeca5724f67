"""Prompt sets, scoring, sharding and `chunk-llama eval` in one and in two processes
(resume and merge details: test_eval_resume.py)."""

import json
import os
import subprocess
import sys

import pytest
from helpers import tiny_llama, tiny_tokenizer

from chunk_llama.eval import extract_tool_call, is_correct, load_prompt_set
from chunk_llama.eval.cli import main as eval_main
from chunk_llama.eval.data import chat_messages, parse_few_shot, prompt_ids
from chunk_llama.eval.ordering import shard_by_app, simulate_prefill_tokens
from chunk_llama.eval.summary import render_markdown, summarize, wilson_interval

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shipped_set_has_four_apps_of_sixty_questions_with_long_varied_prompts():
    data = load_prompt_set()
    apps = sorted(set(data["app"]))
    assert len(apps) >= 4
    assert data.column_names == ["app", "system_prompt", "question", "answer", "few_shot", "id"]
    rows = data.to_list()
    for app in apps:
        mine = [r for r in rows if r["app"] == app]
        assert len(mine) >= 50 and len({r["system_prompt"] for r in mine}) == 1
        assert all(is_correct(f"Action: {r['answer']}", r["answer"]) for r in mine)
        # few-shot examples as chat turns right after the system prompt, the same for every question
        chats = [chat_messages(r) for r in mine]
        assert all(chat[:-1] == chats[0][:-1] for chat in chats)
        num_examples = len(chats[0]) // 2 - 1
        assert [m["role"] for m in chats[0]] == ["system"] + ["user", "assistant"] * num_examples + ["user"]
        turns = chats[0][1:-1]
        assert len(turns) >= 20 and all(is_correct(t["content"], t["content"].split("Action: ")[1])
                                        for t in turns[1::2])
        assert not {t["content"] for t in turns[::2]} & {r["question"] for r in mine}  # not asked
    lengths = sorted({sum(len(m["content"]) for m in chat_messages(r)[:-1]) for r in rows})  # shared prefixes
    assert len(lengths) == len(apps) and lengths[-1] > 2 * lengths[0]  # varied like the paper's Table 2
    assert len(load_prompt_set(apps=["weather", "papers"], limit=7)) == 14


def test_user_files_and_clear_errors(tmp_path):
    rows = [dict(app="a", system_prompt="s", question="q1", answer="T[1]"),
            dict(app="b", system_prompt="s2", question="q2", answer="T[2]")]
    jsonl = tmp_path / "set.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_prompt_set(str(jsonl))["question"] == ["q1", "q2"]
    csv = tmp_path / "set.csv"
    csv.write_text("app,system_prompt,question\na,s,q\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['answer'\]"):
        load_prompt_set(str(csv))
    load_prompt_set(str(jsonl)).save_to_disk(str(tmp_path / "folder"))
    assert len(load_prompt_set(str(tmp_path / "folder"))) == 2
    with pytest.raises(ValueError, match="unknown app"):
        load_prompt_set(str(jsonl), apps=["zzz"])
    with pytest.raises(ValueError, match="neither"):
        load_prompt_set(str(tmp_path / "missing.jsonl"))


def test_few_shot_column_is_optional_and_validated(tmp_path):
    turns = [{"role": "user", "content": "w10"}, {"role": "assistant", "content": "w11"}]
    rows = [dict(app="a", system_prompt="w12", question="w13", answer="T[1]", few_shot=turns),
            dict(app="a", system_prompt="w12", question="w14", answer="T[2]", few_shot=turns)]
    jsonl = tmp_path / "set.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_prompt_set(str(jsonl)).to_list()
    assert [parse_few_shot(r["few_shot"]) for r in loaded] == [turns, turns]
    tokenizer = chat_tokenizer()
    assert prompt_ids(tokenizer, loaded[0]) == [12, 10, 11, 13]  # system, example (user, assistant), question
    assert prompt_ids(tokenizer, dict(loaded[0], few_shot=None)) == [12, 13]
    csv = tmp_path / "set.csv"  # CSV: a JSON string, or empty for none
    csv.write_text('app,system_prompt,question,answer,few_shot\na,s,q,T[1],"[{""role"": ""user"", '
                   '""content"": ""x""}, {""role"": ""assistant"", ""content"": ""T[0]""}]"\na,s,q2,T[2],\n')
    assert [len(parse_few_shot(r["few_shot"])) for r in load_prompt_set(str(csv)).to_list()] == [2, 0]
    for bad, error, match in [
        ("not json", ValueError, "row 0: few_shot is not valid JSON"),
        ({"role": "user"}, TypeError, "row 0: few_shot must be a list"),
        (["hi"], TypeError, "message 0 must be a dict"),
        ([{"role": "assistant", "content": "x"}], ValueError, "message 0 has role 'assistant'.*be 'user'"),
        ([{"role": "user", "content": 3}], TypeError, "content must be a string"),
        ([{"role": "user", "content": "x"}], ValueError, "ends with a user message"),
    ]:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(dict(rows[0], few_shot=bad)) + "\n")
        with pytest.raises(error, match=match):
            load_prompt_set(str(path))


def test_accuracy_has_a_wilson_interval():
    low, high = wilson_interval(6, 60)  # 10%: [4.7%, 20.1%] (Wilson 1927)
    assert abs(low - 0.0466) < 1e-4 and abs(high - 0.2015) < 1e-4
    assert wilson_interval(0, 8)[0] == 0.0 and abs(wilson_interval(0, 8)[1] - 0.3244) < 1e-4
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)
    results = [dict(app="a", correct=i < 3, prompt_tokens=10, shared_tokens=5) for i in range(8)]
    run = dict(app="a", started_at=0.0, seconds=1.0, generated_tokens=8, peak_kv_bytes=0,
               peak_unshared_kv_bytes=0, prefill_tokens_reused=0, prefill_tokens_computed=80,
               parity=dict(checked=0, equal=0))
    summary = summarize(results, [run], dict(input_order=0, grouped_order=0), 1)
    a = summary["apps"]["a"]
    assert a["correct"] == 3 and a["accuracy"] == 3 / 8 and a["accuracy_ci"] == list(wilson_interval(3, 8))
    assert "| 3/8 = 37.5% [13.7%, 69.4%] |" in render_markdown(summary)


def chat_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def test_scoring_normalizes_the_first_tool_call():
    assert extract_tool_call("Thought: x\nAction: FlightStatus[DL 1, 2022-01-02]\nObs") == "FlightStatus[DL 1, 2022-01-02]"
    assert is_correct('Action:  flightstatus[ "DL  1" ,2022-01-02 ]', "FlightStatus[DL 1, 2022-01-02]")
    assert not is_correct("Action: FlightStatus[DL 2, 2022-01-02]", "FlightStatus[DL 1, 2022-01-02]")
    assert not is_correct("no call at all", "Finish[1]")
    gold = "DailyWeather[Boston, 2022-01-29]"  # the few-shot format: a Thought naming a tool, then the Action
    assert is_correct("Thought: The DailyWeather tool answers this directly.\n"
                      "Action: DailyWeather[Boston, 2022-01-29]\nObservation: x", gold)
    assert is_correct("Thought: Forecast[Boston, 3]?\nAction 1: DailyWeather[Boston, 2022-01-29]", gold)
    for wrong in ["Thought: x\nAction: Forecast[Boston, 3]", "Action: DailyWeather[Boston, 2022-01-29, 3]",
                  "Action: DailyWeather[2022-01-29, Boston]", "Action: DailyWeather[Boston, 2022-01-",
                  "Thought: x\nAction: Finish[DailyWeather[Boston, 2022-01-29]]"]:
        assert not is_correct(wrong, gold), wrong


def test_sharding_keeps_apps_together_and_balances_tokens():
    items = [(i, app, 100) for i, app in enumerate(["x"] * 6 + ["y"] * 3 + ["z"] * 3)]
    shards = shard_by_app(items, 2)
    assert sorted(sum(shards, [])) == list(range(12))
    app_of = {i: a for i, a, _ in items}
    assert all(len({app_of[i] for i in s} & {app_of[i] for i in other}) == 0 for s, other in [shards, shards[::-1]])
    assert sorted(len(s) for s in shards) == [6, 6]
    assert all(s for s in shard_by_app([(i, "only", 10) for i in range(5)], 3))  # one app split over processes


def test_grouped_order_computes_less_prefill_when_the_budget_is_tight():
    prefixes = {app: [app * 1000 + t for t in range(64)] for app in range(3)}
    interleaved = [prefixes[i % 3] + [7000 + i] for i in range(12)]
    grouped = sorted(interleaved, key=lambda p: p[0])
    args = dict(capacity=6, chunk_size=16, max_batch_size=2, max_new_tokens=8)
    assert simulate_prefill_tokens(grouped, **args) < simulate_prefill_tokens(interleaved, **args)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tiny_llama(eos=5).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = [dict(app=app, system_prompt=" ".join(f"w{6 + (k * 7 + j) % 90}" for j in range(n)),
                 question=f"w{20 + q} w{40 + q}", answer=f"T[w{q}]")
            for k, (app, n) in enumerate([("alpha", 70), ("beta", 40), ("gamma", 30)]) for q in range(4)]
    with open(folder / "set.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return folder


def read_results(folder):
    with open(os.path.join(folder, "results.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_eval_writes_results_and_summary_and_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "single"
    argv = ["--model", str(tiny_model_dir), "--data", str(tiny_model_dir / "set.jsonl"), "--max-new-tokens", "6",
            "--chunk-size", "16", "--kv-cache-bytes", str(1 << 22), "--check-parity", "5", "--output", str(out)]
    assert eval_main(argv) == 0
    results = read_results(out)
    assert [r["id"] for r in results] == list(range(12))
    summary = json.load(open(out / "summary.json"))
    overall = summary["apps"]["overall"]
    assert overall["requests"] == 12 and overall["parity_checked"] == 5 and overall["parity_equal"] == 5
    alpha = summary["apps"]["alpha"]  # 4 prompts that differ only in their last 2 tokens (the question)
    assert alpha["shared_tokens"] == alpha["prompt_tokens"] - 4 * 2 and overall["prefill_tokens_reused"] > 0
    assert "sharing" in open(out / "summary.md").read()
    # resumable: a second run finds everything done and recomputes nothing
    os.remove(out / "summary.json")
    assert eval_main(argv) == 0
    assert read_results(out) == results and json.load(open(out / "summary.json"))["apps"]["overall"]["requests"] == 12


def test_two_processes_with_accelerate_equal_one(tiny_model_dir, tmp_path):
    common = ["--model", str(tiny_model_dir), "--data", str(tiny_model_dir / "set.jsonl"), "--max-new-tokens", "6",
              "--chunk-size", "16", "--kv-cache-bytes", str(1 << 22)]
    assert eval_main([*common, "--output", str(tmp_path / "one")]) == 0
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no",
                           os.path.join(REPO, "scripts", "eval_toolqa.py"), *common, "--output", str(tmp_path / "two")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_results(tmp_path / "two") == read_results(tmp_path / "one")
    assert json.load(open(tmp_path / "two" / "summary.json"))["num_processes"] == 2
    # rank 0 gathered both journals (gather_object over gloo) and each rank then removed its own
    assert sorted(os.listdir(tmp_path / "two")) == ["results.jsonl", "runs.jsonl", "summary.json",
                                                    "summary.md"]
    with open(tmp_path / "two" / "runs.jsonl") as f:
        assert sorted({json.loads(line)["rank"] for line in f}) == [0, 1]


def test_constrained_eval_writes_only_well_formed_calls_of_the_apps_tools(tmp_path):
    """`--constrained`: every answer is one Thought line and one Action calling one of the tools
    its app's system prompt lists, with that tool's number of arguments, whatever the (random) model."""
    import re

    from helpers import tiny_byte_llama, tiny_byte_tokenizer

    from chunk_llama.eval.constrained import app_tools

    assert app_tools(load_prompt_set(apps=["flights"], limit=1)[0]["system_prompt"]) == {
        "FlightStatus": 2, "FlightsBetween": 3, "AirportDelays": 2, "AirportInfo": 1, "CarrierOnTime": 2,
        "Calculate": 1, "Finish": 1}
    with pytest.raises(ValueError, match="app 'x': --constrained needs the system prompt to list its tools"):
        app_tools("no tools here", "x")
    folder = tmp_path / "model"
    tokenizer = tiny_byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tiny_byte_llama(tokenizer, max_position_embeddings=2048).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    systems = {"alpha": "Tools:\n1. Weather[city, date]\n2. Finish[answer]\n",
               "beta": "Tools:\n1. Search[query]\n2. Route[from, to, day]\n"}
    rows = [dict(app=app, system_prompt=system, question=f"question {i}", answer="Finish[x]")
            for app, system in systems.items() for i in range(3)]
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--model", str(folder), "--data", str(data), "--max-new-tokens", "900", "--chunk-size", "16",
            "--kv-cache-bytes", str(1 << 22), "--output", str(tmp_path / "constrained"), "--constrained"]
    assert eval_main(argv) == 0
    calls = {"alpha": r"(Weather\[[^\[\],\n]+, [^\[\],\n]+\]|Finish\[[^\[\],\n]+\])",
             "beta": r"(Search\[[^\[\],\n]+\]|Route\[[^\[\],\n]+, [^\[\],\n]+, [^\[\],\n]+\])"}
    results = read_results(tmp_path / "constrained")
    assert len(results) == 6
    for r in results:
        assert re.fullmatch(r"Thought: [^\n]{1,160}\nAction: " + calls[r["app"]], r["output"]), r["output"]
        assert r["tool_call"] == r["output"].split("Action: ")[1] and r["constrained"] is True
    assert json.load(open(tmp_path / "constrained" / "summary.json"))["constrained"] is True
    assert "--constrained" in open(tmp_path / "constrained" / "summary.md").read()
    with pytest.raises(ValueError, match="holds results decoded with --constrained"):
        eval_main([a for a in argv if a != "--constrained"])
    with pytest.raises(ValueError, match="--check-parity compares with stock generate"):
        eval_main(argv + ["--check-parity", "2"])


def test_two_machines_with_accelerate_equal_one(tiny_model_dir, tmp_path):
    """The multi-node launch (two `accelerate launch` calls, one per machine, here both on
    127.0.0.1 over gloo) writes what one process writes."""
    import socket

    common = ["--model", str(tiny_model_dir), "--data", str(tiny_model_dir / "set.jsonl"), "--max-new-tokens", "6",
              "--chunk-size", "16", "--kv-cache-bytes", str(1 << 22)]
    assert eval_main([*common, "--output", str(tmp_path / "one")]) == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    machines = [subprocess.Popen(
        [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--mixed_precision", "no",
         "--dynamo_backend", "no", os.path.join(REPO, "scripts", "eval_toolqa.py"), *common,
         "--output", str(tmp_path / "two")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for rank in (0, 1)]
    outputs = [m.communicate(timeout=600)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert read_results(tmp_path / "two") == read_results(tmp_path / "one")
    assert json.load(open(tmp_path / "two" / "summary.json"))["num_processes"] == 2
