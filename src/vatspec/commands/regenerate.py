"""``vatspec regenerate``: replace the assistant turns of conversations by the target's own responses
(``vatspec.data.regenerate``); appends to ``--out`` and resumes where it stopped.

    vatspec regenerate runs/prompts.jsonl --out runs/regen.jsonl --target default --max-new-tokens 512
    vatspec regenerate prompts.jsonl --out regen.jsonl --target /models/Qwen3-8B --endpoint http://127.0.0.1:8000 \
        --endpoint http://127.0.0.1:8001 --model Qwen/Qwen3-8B --max-length 4096 \
        --chat-template-kwargs enable_thinking=false --verify-sample 8
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from vatspec.commands import add_dtype_arg, add_template_args, float_arg, int_arg, report, use_template

# a prompt over this many tokens is not answered, unless --max-length says how long a training sequence is
MAX_PROMPT_TOKENS = 2048
# requests in flight per server: vLLM and SGLang batch every request they hold into one forward (continuous
# batching, hundreds of sequences a GPU), so a few in flight leave a GPU server mostly idle
ENDPOINT_CONCURRENCY = 64


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="conversations or prompts: .jsonl/.json/.parquet, a folder, a hub name, "
                                      "or bench:NAME for a bundled benchmark")
    parser.add_argument("--out", required=True, help="output JSONL; resumed if it is an earlier regenerate output "
                                                     "(any other existing file is refused, never changed)")
    parser.add_argument("--target", required=True, help="local HF model folder, or 'default' (SmolLM2-135M)")
    add_template_args(parser)
    parser.add_argument("--reasoning", choices=("keep", "drop"), default="keep",
                        help="a reasoning target's thinking, stored apart from each answer (reasoning_content: "
                             "the server's reasoning parser, or the family's own markers learned from its template): "
                             "keep it (trained as generated in thinking mode) or drop it (the answer trains as the "
                             "template renders it without reasoning)")
    parser.add_argument("--batch-size", type=int_arg(1), default=8, help="conversations a batch (at most)")
    parser.add_argument("--batch-tokens", type=int_arg(1), default=None,
                        help="also at most this many prompt tokens a batch (rows x its longest first prompt): "
                             "wide batches of short prompts, narrow ones of long prompts (the demo: 64 and 4096)")
    parser.add_argument("--max-new-tokens", type=int_arg(1), default=512)
    parser.add_argument("--temperature", type=float_arg(0.0), default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float_arg(0.0, 1.0, above=True), default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-tokens", type=int_arg(1), default=None,
                        help="a conversation whose first prompt holds more tokens is not answered (a later turn's: "
                             f"it ends there); unset: --max-length (a prompt that fits training is kept), else "
                             f"{MAX_PROMPT_TOKENS}")
    parser.add_argument("--max-length", type=int_arg(1), default=None,
                        help="the training length (data.max_length): a row stops generating once it holds this "
                             "many tokens, prompt included, plus a few; training sees the same tokens")
    parser.add_argument("--limit", type=int_arg(0), default=None, help="only the first N conversations")
    parser.add_argument("--skip-bad", action="store_true", help="skip (and count) bad input records")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    add_dtype_arg(parser)
    parser.add_argument("--threads", type=int_arg(1), default=None,
                        help="torch CPU threads; 1 is much faster on a CPU shared with other jobs")
    srv = parser.add_argument_group("through serving engines (OpenAI-compatible chat completions: vLLM, SGLang, TGI, "
                                    "llama.cpp, transformers serve); --target then gives the tokenizer")
    srv.add_argument("--endpoint", action="append", default=[], metavar="URL",
                     help="a server's URL (repeat for several: requests spread over all); no credentials, "
                          "query or fragment in it: an API key is read from VATSPEC_API_KEY, else OPENAI_API_KEY")
    srv.add_argument("--model", help="the model name the servers serve (required with --endpoint)")
    srv.add_argument("--concurrency", type=int_arg(1), default=ENDPOINT_CONCURRENCY,
                     help="requests in flight per endpoint: a GPU server (vLLM, SGLang) batches all it holds into one "
                          "forward, so this many keep it busy; a CPU server (llama.cpp, transformers serve) wants "
                          "1-4. In-process generation batches by --batch-size instead")
    srv.add_argument("--retries", type=int_arg(0), default=5,
                     help="retries of a request after a 5xx, a timeout or a dropped connection (backoff 0.5 s, "
                          "doubling)")
    srv.add_argument("--timeout", type=float_arg(0.0, above=True), default=600.0, help="seconds per request")
    srv.add_argument("--last-turn-only", action="store_true",
                     help="answer only the last user turn, the original history kept as context (not supervised)")
    srv.add_argument("--verify-sample", type=int_arg(0), default=0, metavar="N",
                     help="generate N answers in-process too (loads the target) and report the share whose token ids "
                          "equal the server's")


def run(args: argparse.Namespace) -> int:
    import torch

    from vatspec.benchmarks import load_benchmark
    from vatspec.data import DataError, load_conversations
    from vatspec.data.regen import check_same_input, is_regenerated, shortest_prompt
    from vatspec.outputs import OutputError, check_apart, check_file, own_jsonl, write_lock
    from vatspec.target import TargetError, open_target

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.max_prompt_tokens is None:
        args.max_prompt_tokens = args.max_length or MAX_PROMPT_TOKENS
    if args.threads:
        torch.set_num_threads(args.threads)
    read = {"bad": 0}
    try:
        # the output first: an input, a folder or a file that is not an earlier regenerate output is
        # refused before anything is read or written
        inputs = {"input": args.input if Path(args.input).exists() else None,
                  "--target": args.target if Path(args.target).exists() else None}
        check_apart(check_file(args.out), inputs, "--out")
        done = (own_jsonl(args.out, is_regenerated, "--out", tail_prefix=b'{"id": ')[0]
                if Path(args.out).exists() else [])
        if args.input.startswith("bench:"):
            convs = load_benchmark(args.input[len("bench:"):], turns="all")
        else:
            convs = load_conversations(args.input, skip_bad=args.skip_bad, require_assistant=False, stats=read)
        check_same_input(done, convs, args.out, args.input)
        if args.limit is not None:
            convs = convs[: args.limit]
        if args.endpoint and not args.model:
            raise DataError("--endpoint needs --model: the name the servers serve the target under")
        if args.model and not args.endpoint:
            raise DataError("--model names the model of --endpoint servers; give --endpoint URL")
        if args.endpoint:
            from vatspec.data.endpoints import check_url

            for url in args.endpoint:  # a secret in a URL: refused before anything is loaded
                check_url(url)
        local = not args.endpoint or args.verify_sample  # through servers only the tokenizer is needed
        target = open_target(args.target, device=(args.device or "auto") if local else "meta", dtype=args.dtype)
        template = use_template(target, args)
        if args.max_length is not None and (n := shortest_prompt(convs, target.tokenizer, template)) >= args.max_length:
            raise DataError(f"--max-length {args.max_length}: every conversation's first prompt holds at least "
                            f"{n} tokens, so no answer token would fit the training length; raise --max-length")
        with write_lock(args.out, "--out", "regenerate"):  # one writer: a second regenerate fails at once
            if args.endpoint:
                return _through_endpoints(args, convs, target, template, read)
            stats = _in_process(args, convs, target, template)
    except (DataError, OutputError, TargetError) as e:
        return report("regenerate", e)
    print(
        f"wrote {stats.conversations} conversations ({stats.turns} turns, {stats.new_tokens} tokens, "
        f"{stats.tokens_per_s:.1f} tok/s) to {args.out}; {stats.skipped_done} already done, "
        f"{stats.too_long} too long, {stats.truncated_turns} turns hit --max-new-tokens"
        + (f", {stats.reasoning_dropped} reasoning blocks dropped" if args.reasoning == "drop" else "")
        + f"; {read['bad']} bad input records skipped"
    )
    return 0


def _in_process(args, convs, target, template):
    from vatspec.data import regenerate

    return regenerate(
        convs,
        target,
        args.out,
        batch_size=args.batch_size,
        batch_tokens=args.batch_tokens,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
        max_length=args.max_length,
        template=template,
        reasoning=args.reasoning,
    )


def _through_endpoints(args, convs, target, template, read) -> int:

    from vatspec.data.endpoints import regenerate_endpoints, verify_sample
    from vatspec.data.regen import is_regenerated
    from vatspec.outputs import own_jsonl

    stats = regenerate_endpoints(
        convs, args.endpoint, args.model, target.tokenizer, target.eos_token_ids, args.out,
        concurrency=args.concurrency, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, seed=args.seed, max_prompt_tokens=args.max_prompt_tokens, max_length=args.max_length,
        template=template, reasoning=args.reasoning, last_turn_only=args.last_turn_only, retries=args.retries,
        timeout=args.timeout,
    )
    line = (f"wrote {stats.conversations} conversations ({stats.turns} turns, {stats.new_tokens} tokens, "
            f"{stats.tokens_per_s:.1f} tok/s, {stats.requests} requests) to {args.out}: {len(convs)} read, "
            f"{stats.skipped_done} already done, {stats.retried} retried, {stats.failed} failed"
            + (f" (listed in {args.out}.failed.jsonl; a rerun retries them)" if stats.failed else "")
            + f", {stats.truncated_turns} turns cut at max tokens, {stats.too_long} too long; {read['bad']} bad "
            "input records skipped")
    if stats.prompts_checked:
        line += (f"; the engine's prompt ids equal this project's rendering in {stats.prompts_same} of "
                 f"{stats.prompts_checked} answers" + (f" (first differences at tokens {stats.prompt_differs_at[:8]})"
                                                       if stats.prompt_differs_at else ""))
    summary = {"format": "vatspec-regen-summary", "endpoints": args.endpoint, "model": args.model,
               "prompts": {"checked": stats.prompts_checked, "same": stats.prompts_same,
                           "first_difference": stats.prompt_differs_at},
               "read": len(convs), "done": stats.conversations, "skipped_done": stats.skipped_done,
               "retried": stats.retried, "failed": stats.failed, "cut": stats.truncated_turns,
               "tokens": stats.new_tokens, "seconds": stats.seconds}
    if args.verify_sample:
        order = {c.id: k for k, c in enumerate(convs)}
        records, _ = own_jsonl(args.out, is_regenerated, "--out")
        records.sort(key=lambda r: order.get(r["id"], len(order)))
        v = verify_sample(records, target, template, args.verify_sample)
        summary["verify_sample"] = v
        line += (f"; token ids identical to in-process generation in {v['identical']} of {v['sampled']} answers"
                 + (f" (first differences at tokens {v['first_difference']})" if v["first_difference"] else ""))
    _write_summary(args.out + ".summary.json", summary)
    all_failed = stats.failed > 0 and stats.conversations == 0  # exit 1: a wrong key, a dead server, bad answers
    if all_failed:
        line += f"; every conversation of this run failed (see {args.out}.failed.jsonl)"
    print(line)
    return 1 if all_failed else 0


def _write_summary(path: str, summary: dict) -> None:
    """``OUT.summary.json``: written over only an earlier summary of this command."""
    import json
    import os

    from vatspec.outputs import OutputError

    if os.path.exists(path):
        try:
            old = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = None
        if not (isinstance(old, dict) and old.get("format") == summary["format"]):
            raise OutputError(f"{path} exists and is not an earlier regenerate summary; it is left as it is")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, path)
