"""Acceptance length tau and wall-clock speedup of drafters, per benchmark: what ``vatspec eval`` measures
(``vatspec.eval.report`` writes it up).

    results = evaluate(target, {"eagle3": (drafter, head)}, {"gsm8k": prompts}, temperature=0.0,
                       max_new_tokens=256, warmup=1, seed=0)
    eval_report.write_report(results, "runs/eval")   # results.json, results.md, tau.png, acceptance.png

Measurement protocol
--------------------
* One process, one target, batch size 1 (``vatspec.eval.decode``).
* Every method, the autoregressive baseline ``ar`` (the same decode loop without a drafter) and HF
  ``generate()`` greedy (``hf_generate``, to show the baseline is honest) run on every prompt,
  interleaved: prompt i runs all of them back to back, in an order rotated by i (``run_order``),
  so slow drifts of the machine (thermal, other jobs) hit every method alike.
* ``warmup`` prompts (the first ones of the first benchmark) first run every method untimed.
* Per benchmark: ``tau`` = committed tokens / verify rounds pooled over its prompts (bonus
  included, prefill token excluded); ``tokens_per_s`` = new tokens / wall seconds (prefill
  included); ``speedup`` = a method's tokens/s over ``ar``'s tokens/s on the same prompts.
  ``average`` = the mean over benchmarks (as the paper's tables), histograms pooled.
* At temperature > 0 each (benchmark, prompt) gets one seed shared by all methods.
* A busy machine: a prompt one of whose runs was slow beyond a quiet machine's spread (``DISTURBED``), or
  ran while other work took CPU (``machine.OtherLoad``), is measured again (``_remeasure``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence

import torch

from vatspec.eval.decode import generate
from vatspec.eval.kernels import few_row_kernel
from vatspec.eval.machine import BUSY, OtherLoad

log = logging.getLogger(__name__)

AR, HF = "ar", "hf_generate"  # the two baselines every evaluation measures
DISPLAY = {AR: "AR (same loop, no draft)", HF: "HF generate() greedy"}


# --------------------------------------------------------------------------- prompts
def prompt_ids(tokenizer, item, template=None) -> list[int]:
    """One prompt -> token ids. ``item``: token ids (list / 1-D tensor), or a conversation (an
    object with ``.messages``, a dict with ``"messages"``, or a list of ``{role, content}``).
    A conversation is cut after its last user turn and rendered with the chat template
    (``add_generation_prompt=True``) and ``template``'s arguments (a ``vatspec.data.ChatTemplate``; None:
    the tokenizer's own template, no arguments), as the serving engine renders it."""
    if isinstance(item, torch.Tensor):
        return item.flatten().tolist()
    if isinstance(item, Sequence) and not isinstance(item, str) and all(isinstance(t, int) for t in item):
        return list(item)
    messages, tools = getattr(item, "messages", None), getattr(item, "tools", None)
    if messages is None and isinstance(item, Mapping):
        messages, tools = item.get("messages"), item.get("tools")
    if messages is None and isinstance(item, Sequence):
        messages = list(item)
    if not messages:
        raise ValueError(f"a prompt must be token ids or a conversation with messages, got {type(item).__name__}")
    messages = list(messages)
    while messages and messages[-1]["role"] == "assistant":  # the model answers the last user turn
        messages.pop()
    from vatspec.data.chat import ChatTemplate

    text = (template or ChatTemplate()).render(tokenizer, messages, generation_prompt=True, tools=tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- measurement
def rotated(names: Sequence[str], i: int) -> list[str]:
    """``names`` rotated left by i."""
    i %= len(names)
    return [*names[i:], *names[:i]]


def run_order(names: Sequence[str], num_prompts: int) -> list[list[str]]:
    """The order in which prompt i runs the methods: ``names`` rotated by i, so each method takes
    each slot (first, second, ...) equally often and runs right after / before every other."""
    return [rotated(names, i) for i in range(num_prompts)]


# a run that took this many times its method's median time per round (over the evaluation's prompts) was hit by
# a burst of load: set above the spread of one method's runs on a quiet machine (the spread measured:
# docs/LOG.md, "Figures moved out of code comments"); load from other processes is read directly
# (machine.OtherLoad), so this mark only has to catch what the kernel's counters do not show
DISTURBED = 1.5


MIN_ROUNDS = 8  # a run of fewer rounds (an early EOS) is too short to tell a burst from its own noise


def seconds_per_round(rec: dict) -> float | None:
    """A decode-loop run's wall time per round, (draft + verify) / rounds, prefill aside; None for a run
    too short to judge (``MIN_ROUNDS``) and for HF ``generate``, whose time holds the prefill."""
    if rec.get("rounds", 0) < MIN_ROUNDS:
        return None
    return (rec["draft_s"] + rec["verify_s"]) / rec["rounds"]


def _remeasure(groups: dict, run_group, names: Sequence[str], limit: int, bar) -> dict[str, list[int]]:
    """Measure again, up to ``limit`` times, each prompt whose group has a disturbed run, and keep the group
    whose worst run is the least disturbed: the whole group, so every run of a prompt still shares its machine
    state with the AR run it is compared with. A run is disturbed when it took more than ``DISTURBED`` times
    its method's median time per round (the medians over every prompt's first measurement), or when other
    work took more than ``machine.BUSY`` cores during it (a steady job slows every run of a prompt, but not
    alike: the timing alone cannot see it). Returns the prompts measured again, per benchmark."""
    timed = {n: [t for g in groups.values() if (t := seconds_per_round(g[n])) is not None] for n in names}
    medians = {n: statistics.median(ts) for n, ts in timed.items() if ts}

    def worst(recs: dict) -> float:  # > DISTURBED: disturbed
        slow = [t / medians[n] for n in medians if (t := seconds_per_round(recs[n])) is not None]
        busy = [DISTURBED * r["others_cores"] / BUSY for r in recs.values() if r.get("others_cores") is not None]
        return max([*slow, *busy], default=0.0)

    again: dict[str, list[int]] = {}
    for key, recs in groups.items():
        b, bench, i = key
        turn, score = 0, worst(recs)
        while score > DISTURBED and turn < limit:
            turn += 1
            bar.total += len(names)
            fresh = run_group(b, bench, i, turn)
            if worst(fresh) < score:
                groups[key], score = fresh, worst(fresh)
        if turn:
            again.setdefault(bench, []).append(i)
            for rec in groups[key].values():
                rec["remeasured"], rec["disturbance"] = turn, score
    return again


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_generate(target, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """HF ``generate()`` greedy on the same prompt: (new tokens, wall seconds)."""
    device = target.device
    x = torch.tensor([ids], device=device)
    eos = target.eos_token_ids
    with few_row_kernel(target.model):  # the kernel our loop runs, so the two baselines differ only by the loop
        _sync(device)
        t0 = time.perf_counter()  # inside the block, as generate's own clock: the swap is not timed
        out = target.model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else None,
        )
        _sync(device)
        seconds = time.perf_counter() - t0
    return out[0, len(ids) :].tolist(), seconds


def _summarize(runs: list[dict]) -> dict:
    """Pool per-prompt runs of one method on one benchmark."""
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["wall_s"] for r in runs)
    out = {"prompts": len(runs), "tokens": tokens, "wall_s": seconds, "tokens_per_s": tokens / seconds}
    if runs and "rounds" in runs[0]:
        rounds = sum(r["rounds"] for r in runs)
        committed = sum(r["committed"] for r in runs)
        out.update(
            rounds=rounds,
            tau=committed / rounds if rounds else float("nan"),
            histogram=_pool([r["histogram"] for r in runs]),
            prefill_s=sum(r["prefill_s"] for r in runs),
            draft_s=sum(r["draft_s"] for r in runs),
            verify_s=sum(r["verify_s"] for r in runs),
        )
    if runs and "matches_ar" in runs[0]:
        out["matches_ar"] = sum(r["matches_ar"] for r in runs)
    return out


def evaluate(
    target,
    methods: Mapping[str, tuple],
    prompts_by_bench: Mapping[str, Sequence],
    *,
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    warmup: int = 1,
    seed: int = 0,
    exit_threshold: float | None = None,
    k: int | Mapping[str, int] | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_argmax: bool = False,
    hf_baseline: bool = True,
    recheck: Sequence[str] = (),
    remeasure: int = 2,
    template=None,
    progress: bool = True,
) -> dict:
    """Measure every method against the AR baseline (and HF ``generate``) on every prompt. One function: the
    interleaved run order, the warm-up and the per-prompt records are one loop, so every method sees the same
    machine state.

    methods:          name -> (drafter | None, accept head | None); a None drafter runs AR again
                      (its speedup shows the measurement noise).
    prompts_by_bench: benchmark name -> prompts (token ids or conversations, see ``prompt_ids``).
    exit_threshold:   early exit for the methods that have a head (others ignore it).
    k:                drafted tokens per round: one for all, or method -> k (e.g. from ``calibrate``);
                      None (or a method missing from the mapping) = the drafter's own ``drafter.k``.
    recheck:          methods whose k was chosen (``calibrate``): one that drafts k > 1 also runs at k = 1, as
                      the method ``recheck_name(name)``, interleaved with the rest, so the report can say
                      whether the choice held on this run's own timing (``recheck_lines``).
    template:         the ``ChatTemplate`` conversations are rendered with, as served (None: the tokenizer's own).
    remeasure:        how many times a prompt's group of runs may be measured again when one of its runs took
                      more than ``DISTURBED`` times its method's median time per round (``_remeasure``).
    Returns a JSON-ready dict: ``config``, ``benchmarks`` (prompt counts), ``summary[name][bench]``
    with ``average`` per name, and the per-prompt ``runs``.
    """
    from tqdm.auto import tqdm

    for reserved in (AR, HF):
        if reserved in methods:
            raise ValueError(f"method name {reserved!r} is reserved for a baseline; rename it")
    device = target.device
    k_of = dict(k) if isinstance(k, Mapping) else {name: k for name in methods}
    rechecked = {}
    for name in recheck:
        if name not in methods:
            raise ValueError(f"recheck: no method {name!r} (have {', '.join(methods)})")
        if (k_of.get(name) or getattr(methods[name][0], "k", 1)) > 1:
            rechecked[name] = recheck_name(name)
    methods = {**methods, **{r: methods[n] for n, r in rechecked.items()}}
    k_of.update({r: 1 for r in rechecked.values()})
    names = [AR, *methods] + ([HF] if hf_baseline else [])
    ids_by_bench = {b: [prompt_ids(target.tokenizer, p, template) for p in ps] for b, ps in prompts_by_bench.items()}
    ids_by_bench = {b: ps for b, ps in ids_by_bench.items() if ps}
    if not ids_by_bench:
        raise ValueError("evaluate: no prompts")
    gen_kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  draft_argmax=draft_argmax)

    def run_one(name: str, ids: list[int], gen_seed: int) -> dict:
        with OtherLoad() as load:  # the CPU other work took meanwhile: a busy machine is measured again
            if name == HF:
                toks, wall = hf_generate(target, ids, max_new_tokens)
                rec = {"tokens": len(toks), "wall_s": wall, "_out": toks}
            else:
                drafter, head = (None, None) if name == AR else methods[name]
                g = torch.Generator(device=device).manual_seed(gen_seed)
                res = generate(target, ids, drafter, k=k_of.get(name), head=head,
                               exit_threshold=exit_threshold if head is not None else None, generator=g, **gen_kw)
                rec = {"tokens": len(res.tokens), "wall_s": res.wall_s, "rounds": len(res.rounds),
                       "committed": sum(res.tokens_per_step), "histogram": res.histogram, "prefill_s": res.prefill_s,
                       "draft_s": res.draft_s, "verify_s": res.verify_s, "stop": res.stop, "_out": res.tokens}
        return {**rec, "others_cores": load.cores}

    first = next(iter(ids_by_bench.values()))
    n_warm = min(warmup, len(first))
    total = len(names) * (n_warm + sum(len(ps) for ps in ids_by_bench.values()))
    bar = tqdm(total=total, desc="eval", disable=not progress, unit="run")
    for i in range(n_warm):
        for name in names:
            bar.set_postfix_str(f"warm-up {name}")
            run_one(name, first[i], seed)
            bar.update()

    def run_group(b: int, bench: str, i: int, turn: int = 0) -> dict[str, dict]:
        """Prompt i of ``bench``: every method once, back to back, in the order rotated by i (+ ``turn`` on a
        re-measurement); each run's speedup over the AR run of the group."""
        prompt, gen_seed = ids_by_bench[bench][i], seed * 1_000_003 + b * 10_007 + i
        recs, outs = {}, {}
        for name in rotated(names, i + turn):
            bar.set_postfix_str(f"{bench} {name}" + (" again" if turn else ""))
            rec = run_one(name, prompt, gen_seed)
            outs[name] = rec.pop("_out")
            recs[name] = {"prompt": i, "prompt_tokens": len(prompt), **rec}
            bar.update()
        ar = recs[AR]
        for name in names[1:]:  # per prompt: tokens/s over the AR run of the same prompt
            rec = recs[name]
            rec["speedup"] = (rec["tokens"] / rec["wall_s"]) / (ar["tokens"] / ar["wall_s"]) if (
                rec["tokens"] and ar["tokens"]) else None
            if temperature == 0:  # greedy decoding is lossless: every output should equal AR's
                rec["matches_ar"] = outs[name] == outs[AR]
        return recs

    groups = {(b, bench, i): run_group(b, bench, i)
              for b, (bench, prompts) in enumerate(ids_by_bench.items()) for i in range(len(prompts))}
    again = _remeasure(groups, run_group, names, remeasure, bar)
    bar.close()
    runs: dict[str, dict[str, list[dict]]] = {name: {bench: [] for bench in ids_by_bench} for name in names}
    for (_, bench, _), recs in groups.items():
        for name, rec in recs.items():
            runs[name][bench].append(rec)

    summary: dict[str, dict] = {}
    for name in names:
        per = {bench: _summarize(rs) for bench, rs in runs[name].items()}
        for bench, s in per.items():
            s["speedup"] = s["tokens_per_s"] / summary[AR][bench]["tokens_per_s"] if name != AR else 1.0
        avg = {key: sum(s[key] for s in per.values()) / len(per)
               for key in ("tokens_per_s", "speedup", "tau") if key in next(iter(per.values()))}
        if "histogram" in next(iter(per.values())):
            avg["histogram"] = _pool([s["histogram"] for s in per.values()])
        summary[name] = {**per, "average": avg}
        mism = sum(s["prompts"] - s["matches_ar"] for s in per.values() if "matches_ar" in s)
        if mism:
            log.warning("%s: %d prompt(s) differ from the AR output at temperature 0 (float near-ties; "
                        "large counts mean a bug%s)", name, mism,
                        "" if target.dtype == torch.float32 else
                        f"; in {str(target.dtype).removeprefix('torch.')} verification's k + 1-token forward "
                        "and AR's 1-token forward round differently, so ties flip often: check with "
                        "target.dtype=float32, where outputs must be equal")

    return {
        "config": {
            "temperature": temperature, "top_k": top_k, "top_p": top_p, "draft_argmax": draft_argmax,
            "max_new_tokens": max_new_tokens,
            "k": {n: getattr(d, "k", None) if k_of.get(n) is None else k_of[n] for n, (d, _) in methods.items()},
            "warmup": n_warm, "seed": seed, "recheck": rechecked, "remeasure": remeasure,
            "disturbed_above": DISTURBED, "remeasured": again,
            "exit_threshold": exit_threshold, "batch_size": 1, "device": str(device),
            "dtype": str(target.dtype).removeprefix("torch."), "target": getattr(target, "path", None),
            "threads": torch.get_num_threads(), "methods": list(methods), "order": "rotated per prompt",
        },
        "benchmarks": {bench: len(ps) for bench, ps in ids_by_bench.items()},
        "summary": summary,
        "runs": runs,
    }


def recheck_name(name: str) -> str:
    """The method that decodes ``name``'s draft at k = 1 beside its chosen k."""
    return f"{name} @ k=1"


def _pool(hists: list[list[int]]) -> list[int]:
    out = [0] * max((len(h) for h in hists), default=0)
    for h in hists:
        for n, c in enumerate(h):
            out[n] += c
    return out
