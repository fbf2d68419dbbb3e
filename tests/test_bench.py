"""``vatspec eval``: its measurement (``vatspec.eval.bench``: interleaving, bookkeeping, re-measurement), its report
(``vatspec.eval.report``: tables, intervals, words, files) and the command."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_decode import tiny_target
from vatspec.commands.eval import _relative_to
from vatspec.drafters.sampling import Proposal
from vatspec.eval import bench, report
from vatspec.eval.bench import AR, HF, evaluate, prompt_ids, run_order
from vatspec.eval.report import markdown_table, write_report

BOS = 1  # every test prompt starts with it, so the oracle below can rebuild the full sequence


pytestmark = pytest.mark.usefixtures("one_thread")


class OracleDrafter:
    """Drafts the target's own greedy continuation (recomputed without a cache, tiny models only)
    and spoils draft ``pattern[r]`` of round r, so round r accepts ``pattern[r]`` tokens."""

    target_layer_ids = [0]
    k = 4  # drafted tokens per round when evaluate / generate get no k

    def __init__(self, target, pattern):
        self.target, self.pattern = target, pattern

    def new_session(self, head=None, exit_threshold=None):
        return OracleSession(self)


class OracleSession:
    def __init__(self, d):
        self.d, self.seq, self.r = d, [BOS], 0

    def extend(self, features, tokens):
        self.seq += tokens.tolist()

    def propose(self, k, *, temperature=0.0, top_k=0, top_p=1.0, generator=None):
        seq = list(self.seq)
        for _ in range(k):
            seq.append(int(self.d.target(torch.tensor([seq])).logits[0, -1].argmax()))
        draft = torch.tensor(seq[len(self.seq) :])
        a = self.d.pattern[self.r % len(self.d.pattern)]
        self.r += 1
        if a < k:
            draft[a] = (draft[a] + 1) % self.d.target.vocab_size
        return Proposal(draft)


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(seed=11)
    prompts = {
        "math": [[BOS, 5, 6, 7], [BOS, 9], [BOS, 30, 31]],
        "code": [[BOS, 40, 41, 42, 43], [BOS, 2, 3]],
    }
    methods = {"good": (OracleDrafter(target, [3, 2, 3]), None), "poor": (OracleDrafter(target, [0, 1]), None)}
    return target, methods, prompts


def test_run_order_rotates():
    names = [AR, "a", "b", HF]
    order = run_order(names, 6)
    assert order[:4] == [[AR, "a", "b", HF], ["a", "b", HF, AR], ["b", HF, AR, "a"], [HF, AR, "a", "b"]]
    assert order[4] == order[0] and all(sorted(o) == sorted(names) for o in order)
    for slot in range(4):  # over len(names) prompts every method takes every slot once
        assert sorted(o[slot] for o in order[:4]) == sorted(names)


def test_evaluate_interleaves_and_warms_up(tiny, monkeypatch):
    target, methods, prompts = tiny
    calls = []
    real_generate, real_hf = bench.generate, bench.hf_generate

    def logged_generate(target, ids, drafter, **kw):
        name = next((n for n, (d, _) in methods.items() if d is drafter), AR)
        calls.append((name, tuple(ids)))
        return real_generate(target, ids, drafter, **kw)

    def logged_hf(target, ids, max_new_tokens):
        calls.append((HF, tuple(ids)))
        return real_hf(target, ids, max_new_tokens)

    monkeypatch.setattr(bench, "generate", logged_generate)
    monkeypatch.setattr(bench, "hf_generate", logged_hf)
    evaluate(target, methods, prompts, max_new_tokens=6, warmup=2, remeasure=0, progress=False)
    names = [AR, "good", "poor", HF]
    first = prompts["math"]
    want = [(n, tuple(first[i])) for i in range(2) for n in names]  # warm-up, fixed order
    for ps in prompts.values():
        want += [(n, tuple(ps[i])) for i, order in enumerate(run_order(names, len(ps))) for n in order]
    assert calls == want


def test_evaluate_bookkeeping(tiny):
    target, methods, prompts = tiny
    max_new = 13  # 1 prefill token + 12 from rounds
    res = evaluate(target, methods, prompts, max_new_tokens=max_new, warmup=0, k=4, progress=False)
    s = res["summary"]
    assert res["benchmarks"] == {"math": 3, "code": 2}
    for name in (AR, "good", "poor", HF):
        for bench_name, n in res["benchmarks"].items():
            assert s[name][bench_name]["prompts"] == n
            assert s[name][bench_name]["tokens"] == n * max_new  # no EOS in the tiny model
            assert s[name][bench_name].get("matches_ar", n) == n  # greedy: lossless, HF agrees
    # "good" accepts 3, 2, 3, ... of k = 4: pooled tau = committed tokens / rounds over the 3 prompts
    runs = res["runs"]["good"]["math"]
    assert all(r["committed"] == max_new - 1 for r in runs)
    tau_by_hand = 3 * (max_new - 1) / sum(r["rounds"] for r in runs)
    assert s["good"]["math"]["tau"] == pytest.approx(tau_by_hand)
    assert s["good"]["math"]["tau"] > s["poor"]["math"]["tau"] > 1.0 == s[AR]["math"]["tau"]
    h = s["good"]["average"]["histogram"]
    assert sum(n * c for n, c in enumerate(h)) == 5 * (max_new - 1)  # every committed token is counted
    assert s[AR]["average"]["speedup"] == 1.0
    assert s["good"]["code"]["speedup"] == pytest.approx(
        s["good"]["code"]["tokens_per_s"] / s[AR]["code"]["tokens_per_s"]
    )
    avg = s["poor"]["average"]
    assert avg["tau"] == pytest.approx((s["poor"]["math"]["tau"] + s["poor"]["code"]["tau"]) / 2)


def test_report_files(tiny, tmp_path):
    target, methods, prompts = tiny
    res = evaluate(target, methods, prompts, max_new_tokens=8, warmup=1, k=3, progress=False)
    paths = write_report(res, tmp_path, relative_to="poor")
    saved = json.loads(paths["json"].read_text())
    assert saved["summary"]["good"]["math"]["tau"] == res["summary"]["good"]["math"]["tau"]
    md = paths["markdown"].read_text()
    assert "| Method | math speedup | math τ | code speedup | code τ | average speedup | average τ |" in md
    assert "| good |" in md and "| Δ vs poor |" in md and "| AR (same loop, no draft) | 1.00× | 1.00 |" in md
    assert md.count("Δ vs poor") == 1  # under "good" only, not under the baseline itself
    assert "AR / HF" in md
    rounds = {m: sum(res["summary"][m][b]["rounds"] for b in res["benchmarks"]) for m in ("good", "poor")}
    assert f"| good | {rounds['good']} |" in md and f"| poor | {rounds['poor']} |" in md  # per-round cost table
    for key in ("tau_plot", "hist_plot"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no such method"):
        markdown_table(res, relative_to="nope")
    # paired per-prompt tau: "good" (accepts 3, 2, 3 of 3) against "poor" (0, 1), prompt by prompt
    per = {m: [r["committed"] / r["rounds"] for b in res["benchmarks"] for r in res["runs"][m][b]]
           for m in ("good", "poor")}
    want = sum(per["good"]) / 5 - sum(per["poor"]) / 5
    paired = saved["paired_tau"]["good"]
    assert paired["estimate"] == pytest.approx(want) and paired["vs"] == "poor"
    assert paired["units"] == 5 and paired["low"] > 0
    assert f"| good | poor | {want:+.3f}" in md and "the interval excludes 0, so good is ahead" in md


def test_sampling_evaluation_runs(tiny):
    """At T > 0 there is no losslessness check, and every method still gets a tau."""
    target, methods, prompts = tiny
    good = {"good": methods["good"]}
    res = evaluate(target, good, {"math": prompts["math"][:1]}, temperature=1.0, max_new_tokens=5, warmup=0,
                   k=2, draft_argmax=True, hf_baseline=False, progress=False)
    assert "matches_ar" not in res["summary"]["good"]["math"] and HF not in res["summary"]
    assert res["summary"]["good"]["math"]["tokens"] == 5


class ChatTokenizer:
    """Records what it renders (one character a message) and the template arguments; one token a character."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, chat_template=None, **kwargs):
        assert add_generation_prompt and not tokenize
        self.seen, self.kwargs = messages, kwargs
        return "m" * len(messages)

    def __call__(self, text, add_special_tokens):
        assert not add_special_tokens  # the template writes its own special tokens
        return {"input_ids": [7] * len(text)}


def test_prompt_ids():
    tok = ChatTokenizer()
    assert prompt_ids(tok, [3, 4]) == [3, 4] and prompt_ids(tok, torch.tensor([[5, 6]])) == [5, 6]
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert prompt_ids(tok, conv) == [7] and tok.seen == conv[:1]  # cut after the last user turn
    obj = type("Conv", (), {"messages": conv + [{"role": "user", "content": "more"}]})()
    assert prompt_ids(tok, obj) == [7, 7, 7]
    assert prompt_ids(tok, {"messages": conv[:1]}) == [7]
    from vatspec.data import ChatTemplate

    assert prompt_ids(tok, conv, ChatTemplate(kwargs={"enable_thinking": False})) == [7]
    assert tok.kwargs == {"enable_thinking": False}  # the template arguments reach the rendering


def test_eval_command(tiny, tmp_path, monkeypatch):
    """``vatspec eval`` wires checkpoints, benchmarks and prompt files into evaluate + report."""
    from vatspec import benchmarks, cli, data
    from vatspec.commands import eval as eval_command

    target, methods, prompts = tiny
    monkeypatch.setattr(eval_command, "open_target", lambda path, **kw: target)
    monkeypatch.setattr(eval_command, "open_draft", lambda path, t: (OracleDrafter(t, [2]), None))
    monkeypatch.setattr(benchmarks, "load_benchmark", lambda name: [[BOS, 3, 4], [BOS, 8]])
    user = tmp_path / "mine.jsonl"
    user.write_text("")
    monkeypatch.setattr(data, "load_conversations", lambda path, **kw: [[BOS, 12]])
    out = tmp_path / "eval"
    rc = cli.main(["eval", "--target", "default",
                   "--draft", f"vat={tmp_path}/ckpt", "--bench", "gsm8k", "--prompts", str(user),
                   "--max-new-tokens", "5", "--k", "2", "--warmup", "0", "--out", str(out), "--no-plots"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["benchmarks"] == {"gsm8k": 2, "mine": 1}
    assert set(res["summary"]) == {AR, "vat", HF} and res["config"]["drafts"] == {"vat": f"{tmp_path}/ckpt"}


@pytest.mark.slow
def test_smollm2_ar_matches_hf_generate():
    from vatspec.target import open_target

    target = open_target("default", device="cpu", dtype="float32")
    conv = [{"role": "user", "content": "Name three primary colours."}]
    res = evaluate(target, {}, {"chat": [conv]}, max_new_tokens=24, warmup=0, progress=False)
    s = res["summary"]
    assert s[HF]["chat"]["matches_ar"] == 1 and s[AR]["chat"]["tokens"] == s[HF]["chat"]["tokens"]


def test_relative_to_specs():
    methods = ["E", "E + VAT", "D", "D + VAT"]
    assert _relative_to([], methods) is None
    assert _relative_to(["E"], methods) == {"E + VAT": "E", "D": "E", "D + VAT": "E"}
    assert _relative_to(["E + VAT=E", "D + VAT=D"], methods) == {"E + VAT": "E", "D + VAT": "D"}
    with pytest.raises(ValueError, match="no method 'X'"):
        _relative_to(["X=E"], methods)


def test_eval_command_k_auto_calibrates_each_method(tiny, tmp_path, monkeypatch, capsys):
    from vatspec import benchmarks, cli, data
    from vatspec.commands import eval as eval_command

    target, _, _ = tiny
    monkeypatch.setattr(eval_command, "open_target", lambda path, **kw: target)
    monkeypatch.setattr(eval_command, "open_draft", lambda path, t: (OracleDrafter(t, [2]), None))
    monkeypatch.setattr(benchmarks, "load_benchmark", lambda name: [[BOS, 3, 4]])
    monkeypatch.setattr(data, "load_conversations", lambda path, **kw: [[BOS, 12], [BOS, 30, 31]])
    args = ["eval", "--target", "default", "--draft", f"vat={tmp_path}/ckpt", "--bench", "gsm8k",
            "--max-new-tokens", "9", "--warmup", "0",
            "--no-plots", "--no-hf", "--k", "auto"]
    assert cli.main([*args, "--out", str(tmp_path / "x")]) == 2
    assert "--k auto needs --calibration" in capsys.readouterr().err
    assert cli.main([*args, "--calibration", str(tmp_path / "held.jsonl"), "--out", str(tmp_path / "eval")]) == 0
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    cal = res["calibration"]["vat"]
    # the oracle accepts exactly 2 of every round's drafts: S = 1, 1, 0, 0 over k_max = 4
    assert cal["survival"] == [1.0, 1.0, 1.0, 0.0, 0.0] and cal["rounds"] > 0
    assert res["config"]["k"]["vat"] == cal["k"] and 1 <= cal["k"] <= 4
    # a chosen k > 1 is decoded at k = 1 beside it, and the report says whether the choice held
    assert res["config"]["recheck"] == ({"vat": "vat @ k=1"} if cal["k"] > 1 else {})
    assert res["config"]["k"] == {"vat": cal["k"], **({"vat @ k=1": 1} if cal["k"] > 1 else {})}
    assert "Draft length chosen on held-out calibration prompts" in (tmp_path / "eval" / "results.md").read_text()
    # --calibration without --k auto would be read for nothing; calibrating on scored prompts is no held-out choice
    fixed = [a if a != "auto" else "2" for a in args]
    assert cli.main([*fixed, "--calibration", str(tmp_path / "held.jsonl"), "--out", str(tmp_path / "y")]) == 2
    assert "--calibration is read only to choose k: pass --k auto" in capsys.readouterr().err
    monkeypatch.setattr(data, "load_conversations", lambda path, **kw: [[BOS, 3, 4], [BOS, 30, 31]])
    assert cli.main([*args, "--calibration", str(tmp_path / "held.jsonl"), "--out", str(tmp_path / "z")]) == 2
    assert "1 of its 2 prompts are among the evaluation prompts" in capsys.readouterr().err


def test_calibration_lines_do_not_repeat_a_baseline_row():
    """A VAT arm decodes at its baseline's k; its row names where the k came from instead of
    repeating the baseline's measured numbers as if they were its own."""
    cal = {"k": 1, "survival": [1.0, 0.39, 0.10], "cost": [1.0, 1.19, 1.62], "speedup": [1.0, 1.16, 0.92],
           "faster": [0.0, 0.0, 0.0], "rounds": 101, "ar_wins": False}
    lines = report.calibration_lines({"EAGLE-3": cal, "EAGLE-3 + VAT": {**cal, "chosen_on": "EAGLE-3"}})
    base, vat = (next(ln for ln in lines if ln.startswith(f"| {n} |")) for n in ("EAGLE-3", "EAGLE-3 + VAT"))
    assert "0.39 0.10" in base and "| 101 |" in base
    assert vat == "| EAGLE-3 + VAT | 1 | EAGLE-3's k (the same decode settings) | | | | | |"
    slow_cal = {**cal, "ar_wins": True}
    slow = report.calibration_lines({"A": slow_cal, "A + VAT": {**slow_cal, "chosen_on": "A"}})
    assert any(ln.startswith("For A even the best k") for ln in slow)


def _timed_runs(walls: dict[str, dict[str, list[float]]], tokens: int = 10) -> dict:
    """A results dict as ``evaluate`` returns it, for the speedup intervals: per method and benchmark the wall
    seconds of each prompt's run, every run ``tokens`` long."""
    runs = {m: {b: [{"tokens": tokens, "wall_s": w} for w in ws] for b, ws in per.items()} for m, per in walls.items()}
    return {"summary": {m: {} for m in walls}, "runs": runs, "config": {"recheck": {}}}


def test_speedup_intervals_by_hand():
    results = _timed_runs({
        AR: {"x": [1.0, 1.0, 1.0, 1.0], "y": [2.0, 2.0, 2.0]},
        "fast": {"x": [0.5, 0.5, 0.5, 0.5], "y": [1.0, 1.0, 1.0]},  # twice as fast on every prompt
        "same": {"x": [1.1, 0.9, 1.05, 0.95], "y": [2.2, 1.8, 2.0]},  # as fast as AR, within the noise
    })
    iv = report.speedup_intervals(results, {"same": "fast"})
    fast, same = iv["speedup"]["fast"], iv["speedup"]["same"]
    # every resample of "fast" is 2.0: an interval of zero width, excluding 1.0x
    assert fast["average"].estimate == pytest.approx(2.0) and fast["average"].low == pytest.approx(2.0)
    assert not fast["average"].contains_null and fast["average"].units == 7
    # "same": tokens/s pooled per benchmark (40 / 4.0 against 40 / 4.0; 30 / 6.0 against 30 / 6.0), then averaged
    assert same["x"].estimate == pytest.approx(1.0) and same["average"].estimate == pytest.approx(1.0)
    assert same["average"].low < 1.0 < same["average"].high and same["average"].contains_null
    assert "contains 1.0×" in report.speedup_words("same", same["average"])
    assert "excludes 1.0×, so it is faster" in report.speedup_words("fast", fast["average"])
    d = iv["difference"]["same vs fast"]
    assert d["method"] == "same" and d["vs"] == "fast"
    assert d["average"].estimate == pytest.approx(-1.0) and d["average"].high < 0 and d["average"].base == 2.0
    # a benchmark of one prompt cannot be resampled: no interval there, nor for the average, and the words say so
    one = report.speedup_intervals(_timed_runs({AR: {"x": [1.0, 1.0], "y": [1.0]}, "m": {"x": [0.5, 0.6], "y": [0.5]}}))
    assert one["speedup"]["m"]["x"].resolved and not one["speedup"]["m"]["y"].resolved
    assert not one["speedup"]["m"]["average"].resolved and one["speedup"]["m"]["average"].contains_null
    assert "no interval" in report.speedup_words("m", one["speedup"]["m"]["average"])
    assert one["speedup"]["m"]["y"].to_dict()["low"] is None  # JSON: null, never NaN


def test_recheck_says_whether_the_chosen_k_held():
    def results(k3_wall: float) -> dict:
        r = _timed_runs({AR: {"x": [1.0, 1.1, 0.9, 1.0]}, "m": {"x": [k3_wall * w for w in (1.0, 1.1, 0.9, 1.0)]},
                         "m @ k=1": {"x": [0.8, 0.88, 0.72, 0.8]}})
        r["config"].update(recheck={"m": "m @ k=1"}, k={"m": 3, "m @ k=1": 1})
        r["calibration"] = {"m": {"k": 3}}
        return r

    slower = results(0.9)  # k = 3 runs at 1.11x, k = 1 at 1.25x on every prompt
    held = results(0.7)  # k = 3 at 1.43x
    lines = report.recheck_lines(slower, report.speedup_intervals(slower))
    assert any("m: k = 3 gave 1.11×" in ln and "the choice did not hold" in ln for ln in lines)
    lines = report.recheck_lines(held, report.speedup_intervals(held))
    assert any("the choice held" in ln for ln in lines) and not any("did not hold" in ln for ln in lines)
    one = {**held, "config": {**held["config"], "recheck": {}, "k": {"m": 1}}, "calibration": {"m": {"k": 1}}}
    lines = report.recheck_lines(one, report.speedup_intervals(one))
    assert "k = 1 was chosen; nothing to re-check" in "\n".join(lines)


def test_reports_print_no_nan():
    from vatspec.eval.stats import Difference, pct

    # a change relative to a zero baseline does not exist: "-", never "+nan%" or "inf%"
    assert report.relative_change(0.5, 0.0) != report.relative_change(0.5, 0.0)  # nan
    assert pct(report.relative_change(0.5, 0.0)) == "-" and pct(report.relative_change(1.1, 1.0)) == "+10.0%"
    zero = Difference(0.0, 0.0, 0.0, 0.95, 8, 0.0)
    assert "(-)" in zero.sentence("Held-out accepted length per chain", "VAT", "base") and "nan" not in \
        zero.sentence("x", "a", "b")
    for bad in ("| a | nan |", "τ_sim: +nan%", "| 1.0× | inf× |", "-inf", "NaN"):
        with pytest.raises(ValueError, match="report.md:2: the report prints a non-finite number"):
            report.check_finite(f"ok\n{bad}\n", "report.md")
    text = "inference, info, infinite-looking words and a - for a missing figure | - |\n"
    assert report.check_finite(text, "report.md") == text


def test_round_cost_table_says_when_the_ar_baseline_ran_slow():
    def row(draft_s, verify_s, rounds, speedup=1.0, tau=1.2):
        return {"b": {"draft_s": draft_s, "verify_s": verify_s, "rounds": rounds},
                "average": {"speedup": speedup, "tau": tau}}

    # AR: 100 steps of 40 ms; the draft verifies 2 tokens in 42 ms a round (1.05 AR steps): a quiet run
    quiet = {AR: row(0.0, 4.0, 100), "m": row(0.3, 3.15, 75)}
    lines = report.round_cost_table(quiet, ["b"], ["m"])
    assert "| m | 75 | 0.10 | 1.05 | 0.83 |" in lines and not any("ran slow" in ln for ln in lines)
    # AR steps of 60 ms against the same 42 ms verify: 0.70 AR steps, which no 2-token pass can cost
    slow = {AR: row(0.0, 6.0, 100), "m": row(0.3, 3.15, 75)}
    assert any("The AR baseline ran slow in this run" in ln and "m verified" in ln
               for ln in report.round_cost_table(slow, ["b"], ["m"]))


def test_a_prompt_hit_by_a_burst_is_measured_again():
    """A scripted evaluation: per method a steady time per round, and a burst that triples every run of the
    first measurement of prompt 1 (and, with ``stays``, its next one too)."""
    names = [AR, "m"]

    def group(i: int, turn: int, burst: float) -> dict:
        slow = burst if i == 1 and turn < 2 else 1.0
        return {n: {"prompt": i, "tokens": 10, "wall_s": 1.0 * slow, "rounds": 10, "draft_s": 0.0,
                    "verify_s": (0.5 if n == "m" else 1.0) * slow} for n in names}

    class Bar:
        total = 0

    for burst, turns_kept in ((3.0, 2), (1.1, None)):
        calls = []

        def run_group(b, bench, i, turn=0, calls=calls, burst=burst):
            calls.append((i, turn))
            return group(i, turn, burst)

        groups = {(0, "x", i): group(i, 0, burst) for i in range(4)}
        again = bench._remeasure(groups, run_group, names, 2, Bar())
        if turns_kept is None:  # 1.1x: within a quiet machine's spread, nothing measured again
            assert again == {} and calls == []
            continue
        # prompt 1 measured again twice: the first repeat still in the burst, the second quiet and kept
        assert again == {"x": [1]} and calls == [(1, 1), (1, 2)]
        assert groups[(0, "x", 1)][AR]["wall_s"] == 1.0 and groups[(0, "x", 1)]["m"]["remeasured"] == turns_kept
        assert all("remeasured" not in groups[(0, "x", i)]["m"] for i in (0, 2, 3))


def test_recheck_says_when_calibration_timed_another_machine_state():
    # calibration timed a round at k = 1 at 1.94 AR steps (a competing job); the decode, later, at 1.10
    results = _timed_runs({AR: {"x": [1.0, 1.0]}, "m": {"x": [0.9, 0.9]}})
    results["benchmarks"] = {"x": 2}
    results["summary"] = {AR: {"x": {"draft_s": 0.0, "verify_s": 4.0, "rounds": 100}},
                          "m": {"x": {"draft_s": 0.3, "verify_s": 3.0, "rounds": 75}}}
    results["config"].update(k={"m": 1})
    results["calibration"] = {"m": {"k": 1, "cost": [1.0, 1.94, 2.3]}}
    lines = report.recheck_lines(results, report.speedup_intervals(results))
    assert any("calibration timed a round at k = 1 at 1.94 AR steps, the decode at 1.10" in ln for ln in lines)
    results["calibration"]["m"]["cost"] = [1.0, 1.15, 1.4]  # within 25% of the decode's: nothing said
    assert not any("calibration timed" in ln for ln in report.recheck_lines(results, report.speedup_intervals(results)))


def test_runs_too_short_to_judge_are_not_called_disturbed():
    # HF generate's time holds the prefill, and a run of 3 rounds (an early EOS) is mostly its own noise
    assert bench.seconds_per_round({"tokens": 7, "wall_s": 1.0}) is None
    assert bench.seconds_per_round({"rounds": 3, "draft_s": 0.0, "verify_s": 0.3}) is None
    assert bench.seconds_per_round({"rounds": 10, "draft_s": 0.1, "verify_s": 0.4}) == pytest.approx(0.05)

    class Bar:
        total = 0

    groups = {(0, "x", i): {AR: {"rounds": 10, "draft_s": 0.0, "verify_s": 1.0},
                            HF: {"tokens": 7 if i == 0 else 48, "wall_s": 1.0}} for i in range(3)}
    assert bench._remeasure(groups, lambda *a: pytest.fail("measured again"), [AR, HF], 2, Bar()) == {}


def test_a_prompt_measured_while_other_work_ran_is_measured_again():
    # every run as fast as the others (the timing sees nothing), but other work took a core during prompt 2's
    # first measurement
    names = [AR, "m"]

    def group(i: int, turn: int) -> dict:
        busy = 1.0 if i == 2 and turn == 0 else 0.02
        return {n: {"prompt": i, "tokens": 10, "wall_s": 1.0, "rounds": 10, "draft_s": 0.0, "verify_s": 1.0,
                    "others_cores": busy} for n in names}

    class Bar:
        total = 0

    calls = []
    groups = {(0, "x", i): group(i, 0) for i in range(4)}
    again = bench._remeasure(groups, lambda b, bench_, i, turn: calls.append((i, turn)) or group(i, turn), names, 2,
                             Bar())
    assert again == {"x": [2]} and calls == [(2, 1)]
    assert groups[(0, "x", 2)][AR]["others_cores"] == 0.02 and groups[(0, "x", 2)]["m"]["remeasured"] == 1


def test_calibration_lines_say_when_other_work_ran():
    cal = {"k": 1, "survival": [1.0, 0.35], "cost": [1.0, 1.9], "speedup": [1.0, 0.7], "faster": [0.0, 0.0],
           "rounds": 103, "ar_wins": True, "others_cores": 1.8}
    lines = "\n".join(report.calibration_lines({"EAGLE-3": cal}))
    assert "Other work took cores of this machine while calibration timed the rounds of EAGLE-3 (1.8)" in lines
    quiet = report.calibration_lines({"EAGLE-3": {**cal, "others_cores": 0.0}})
    assert "describe a busy machine" not in "\n".join(quiet)


def test_a_speedup_difference_without_a_tau_difference_is_called_so():
    # b runs 10% slower than a on every prompt at the same tau (3 rounds of 10 tokens each)
    results = _timed_runs({AR: {"x": [1.0, 1.1, 0.9, 1.0]}, "a": {"x": [0.8, 0.88, 0.72, 0.8]},
                           "b": {"x": [0.88, 0.97, 0.79, 0.88]}})
    for m in ("a", "b"):
        for r in results["runs"][m]["x"]:
            r.update(rounds=3, committed=9)
    lines = report.speedup_lines(results, report.speedup_intervals(results, {"b": "a"}))
    said = next(ln for ln in lines if ln.startswith("- Speedup (average over benchmarks): b - a"))
    assert "the interval excludes 0" in said and "their τ did not move" in said
