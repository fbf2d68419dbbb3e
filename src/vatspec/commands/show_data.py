"""``vatspec show-data``: see what trains. A data file's training sequences, tokenized as training tokenizes
them, with the supervised tokens marked (green on a terminal, ``[[...]]`` in a pipe), per-sequence counts and
a summary of the whole file (what ``RUN/data_stats.json`` would count). Only the target's tokenizer is read.

    vatspec show-data data/regen.jsonl --target default [-n 3] [--id ID] [--tokens] [--max-length 2048]
"""

from __future__ import annotations

import argparse
import sys

from vatspec.commands import add_template_args, int_arg, report, use_template
from vatspec.config import DataConfig

GREEN, DIM, RESET = "\x1b[32m", "\x1b[2m", "\x1b[0m"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", metavar="DATA", help="conversations (JSONL/JSON/HF dataset folder), as data.train")
    parser.add_argument("--target", required=True, help="a local HF folder, or 'default' (the embedded SmolLM2)")
    add_template_args(parser)
    parser.add_argument("-n", type=int_arg(0), default=3, help="how many sequences to print")
    parser.add_argument("--id", action="append", default=[], metavar="ID",
                        help="print this conversation's sequences instead (repeatable; ID or ID@n)")
    parser.add_argument("--max-length", type=int_arg(2), default=DataConfig.max_length,
                        help="as data.max_length")
    parser.add_argument("--skip-bad", action="store_true", help="skip and count bad records, as data.skip_bad")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="auto: colour on a terminal; otherwise supervised runs are printed in [[...]]")
    parser.add_argument("--tokens", action="store_true", help="one token a line: position, id, text, S/-")


def run(args: argparse.Namespace) -> int:
    from vatspec import data as D
    from vatspec.data.chat import format_kwargs, prompt_agreement
    from vatspec.target import TargetError, open_target
    from vatspec.train.data import MIN_SUPERVISED, dropped_and_cut, sequence_stats

    read: dict = {}
    try:
        convs = D.load_conversations(args.data, skip_bad=args.skip_bad, stats=read)
        target = open_target(args.target, device="meta")  # the tokenizer and config; no weights
        # as training: the data's day, where the template stamps one
        template = D.pin_date(use_template(target, args), target.tokenizer, D.recorded_settings(convs))
        settings = template.settings(target.tokenizer)
        D.check_data_template(convs, settings, args.data)
        seqs = D.split_turns(convs, target.tokenizer, template)
        examples = [D.tokenize_conversation(c, target.tokenizer, args.max_length, template) for c in seqs]
        shown = examples[: args.n]
        if args.id:
            missing = [i for i in args.id if not any(_named(ex.id, i) for ex in examples)]
            if missing:
                raise D.DataError(f"--id {missing[0]}: no conversation with this id in {args.data}")
            shown = [ex for ex in examples if any(_named(ex.id, i) for i in args.id)]
    except (D.DataError, TargetError) as e:
        return report("show-data", e)
    tok, L = target.tokenizer, args.max_length
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    date = f", date {settings['chat_template_date']}" if "chat_template_date" in settings else ""
    print(f"show-data {args.data}: chat template sha256 {settings['chat_template_sha256'][:12]}, arguments "
          f"{format_kwargs(settings['chat_template_kwargs'])}{date}, max_length {L}")
    for ex in shown:
        print(f"--- {ex.id}")
        if args.tokens:
            for pos, (i, m) in enumerate(zip(ex.input_ids, ex.loss_mask)):
                line = f"{pos:>5} {i:>6} {_text(tok, [i])!r:<28} {'S' if m else '-'}"
                print(_paint(line, m) if color else line)
        else:
            print(_marked(tok, ex, color))
        dropped, cut = dropped_and_cut(ex, L)
        sup = sum(ex.loss_mask)
        print(f"{ex.id}: {len(ex)} tokens, {sup} supervised, {len(ex) - sup} context, "
              f"{'cut' if cut else 'not cut'} at max_length {L}"
              + (f"; dropped by training (fewer than {MIN_SUPERVISED} supervised tokens)" if dropped else ""))
    st = sequence_stats(examples, L)
    sup = sum(sum(ex.loss_mask) for ex in examples)
    total = sum(len(ex) for ex in examples)
    calls = sum(_tool_call_tokens(c, ex) for c, ex in zip(seqs, examples))
    print(f"summary: {read['records']} records read, {read['bad']} bad skipped, {len(convs)} conversations, "
          f"{len(examples)} sequences, {sup} supervised tokens, {total - sup} context tokens, "
          f"{st['kept_truncated'] + st['dropped_over_length']} cut at max_length {L}, "
          f"{st['dropped_over_length'] + st['dropped_too_short']} dropped (fewer than {MIN_SUPERVISED} supervised), "
          f"supervised share {sup / max(total, 1):.1%}"
          + (f"; tool-call tokens {calls} ({calls / max(sup, 1):.1%} of the supervised)"
             if any(m.get("tool_calls") for c in convs for m in c.messages) else ""))
    checked, same, parts = prompt_agreement(convs, tok, template)
    if checked:  # records through a server that returned its prompt ids: do we render what it fed the target?
        print(f"engine prompts: {checked} answers hold the server's own prompt ids (trained as they are); "
              f"{same} equal this rendering" + (f", the others first differ at tokens {parts[:8]}" if parts else ""))
    return 0


def _tool_call_tokens(conv, ex) -> int:
    """The supervised tokens of ``conv``'s assistant messages that call tools: the sequence's supervised runs
    are its answers in order, one run each (an answer cut at max_length has none after the cut)."""
    first = int(conv.meta.get("context_turns", 0))
    answers = [m for i, m in enumerate(conv.messages) if m["role"] == "assistant" and i >= first]
    runs, n = [], 0
    for t, m in enumerate(ex.loss_mask):
        if m:
            n += 1
        if n and (not m or t == len(ex) - 1):
            runs.append(n)
            n = 0
    return sum(r for a, r in zip(answers, runs) if a.get("tool_calls"))


def _named(seq_id: str, wanted: str) -> bool:
    """``seq_id`` is the sequence ``wanted`` names: itself, or one part ``ID@n`` of conversation ``ID``."""
    return seq_id == wanted or seq_id.rpartition("@")[0] == wanted


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _marked(tok, ex, color: bool) -> str:
    """The sequence decoded run by run (a run: tokens alike supervised or not), supervised runs marked;
    newlines shown as ``↵`` before the real one."""
    out, start = [], 0
    for t in range(1, len(ex) + 1):
        if t == len(ex) or ex.loss_mask[t] != ex.loss_mask[start]:
            text = _text(tok, ex.input_ids[start:t]).replace("\n", "↵\n")
            sup = ex.loss_mask[start]
            out.append(_paint(text, sup) if color else f"[[{text}]]" if sup else text)
            start = t
    return "".join(out)


def _paint(text: str, supervised: bool) -> str:
    return f"{GREEN if supervised else DIM}{text}{RESET}"
