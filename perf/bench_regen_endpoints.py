"""Regeneration in-process against regeneration through servers, side by side on the same prompts.

    .venv/bin/python perf/bench_regen_endpoints.py [--n 64] [--max-new-tokens 64] [--concurrency 4] \
        [--engine transformers|vllm] [--vllm-python ~/vllm-cpu/bin/python] [--serve-args "..."] [--repeat 1]

Answers the demo's first N training prompts (greedy, the embedded target, float32) three ways in one run:
``regenerate`` in-process (the demo's batches), through one server process on the loopback address
(``transformers serve``, or vLLM's OpenAI server from the CPU build ``vllm-cpu`` in its own venv), and
through two such processes at once (``--endpoint`` twice; vLLM servers bound to a core each). Prints each
way's time, tokens, tokens/s, its ratio to in-process, and the share of answers whose token ids equal
in-process's (the server's ids where it returns them, as vLLM does, else its text re-tokenized). ``--repeat``
rounds of the three ways, their order rotating (``timer.SideBySide``): the time is the median. The servers
are started before and stopped after each timed way; they share the machine's cores with nothing else of it
while they answer (the in-process target stays loaded, idle).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from timer import SideBySide


def start_server(path: Path, extra: list[str], log: Path, vllm_python: str | None,
                 cores: str | None = None) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if vllm_python:
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", *extra]
    else:
        cmd = [str(Path(sys.executable).with_name("transformers")), "serve", str(path), "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning", *extra]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    if vllm_python and cores is not None:  # one core each: vLLM's default binds every server to core 0
        env.update(VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                return proc, url, json.loads(r.read())["data"][0]["id"]
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(1)
    raise SystemExit(f"transformers serve did not start: {log.read_text()[-2000:]}")


def answer_ids(path: Path, tok) -> dict[str, list[int]]:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        m = rec["messages"][1]
        out[rec["id"]] = m.get("token_ids") or tok(m["content"], add_special_tokens=False)["input_ids"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight per server")
    ap.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    ap.add_argument("--vllm-python", default=str(Path.home() / "vllm-cpu/bin/python"),
                    help="--engine vllm: the python of a venv with vllm-cpu installed")
    ap.add_argument("--serve-args", default="", help="extra flags of the server")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the three ways")
    args = ap.parse_args()

    from vatspec.benchmarks import prepare_prompts
    from vatspec.data import regenerate
    from vatspec.data.endpoints import regenerate_endpoints
    from vatspec.target import open_target, prepare_default_target
    from vatspec_recipes.experiment import REGEN_BATCH
    from vatspec_recipes.recipe import load_recipe

    size = load_recipe("demo").size
    prompts = prepare_prompts(size.prompts, seed=size.seed, max_turns=1, max_chars=600)[: args.n]
    work = Path(tempfile.mkdtemp(prefix="bench-regen-endpoints-"))
    target = open_target("default", device="cpu", dtype="float32")
    tok, eos = target.tokenizer, list(target.eos_token_ids)
    path = prepare_default_target()
    extra = shlex.split(args.serve_args)
    vllm = args.vllm_python if args.engine == "vllm" else None
    ways = {"in-process": 0, **{f"{n} {args.engine} x {args.concurrency}": n for n in (1, 2)}}  # way -> servers
    t = SideBySide(list(ways), repeats=args.repeat, warmup=0)
    tokens, outs = {}, {}
    for r, order in t.rounds():
        for way in order:
            n_servers, out = ways[way], work / f"{way.split()[0]}-{r}.jsonl"
            if not n_servers:
                with t.time(way):
                    st = regenerate(prompts, target, out, batch_size=REGEN_BATCH[0], batch_tokens=REGEN_BATCH[1],
                                    max_new_tokens=args.max_new_tokens, progress=False)
            else:
                cores = [str(k % (os.cpu_count() or 1)) for k in range(n_servers)] if n_servers > 1 else [None]
                servers = [start_server(path, extra, work / f"serve{n_servers}-{k}-{r}.log", vllm, cores[k])
                           for k in range(n_servers)]
                try:
                    with t.time(way):
                        st = regenerate_endpoints(prompts, [u for _, u, _ in servers], servers[0][2], tok, eos, out,
                                                  concurrency=args.concurrency, max_new_tokens=args.max_new_tokens,
                                                  progress=False)
                finally:
                    for proc, _, _ in servers:
                        proc.send_signal(signal.SIGINT)
                        proc.wait(30)
            tokens[way] = st.new_tokens
            outs.setdefault(way, out)  # the first round's answers are compared

    ref = answer_ids(outs["in-process"], tok)
    base = tokens["in-process"] / t.median("in-process")
    print(f"\n{args.n} prompts, at most {args.max_new_tokens} new tokens, greedy, float32; {args.engine} server "
          f"{args.serve_args or '(defaults)'}; median of {args.repeat}")
    print(f"{'way':<24} {'seconds':>8} {'tokens':>7} {'tok/s':>7} {'vs in-process':>14} {'ids equal':>10}")
    for way in ways:
        got = answer_ids(outs[way], tok)
        same = sum(got.get(k) == v for k, v in ref.items())
        secs = t.median(way)
        print(f"{way:<24} {secs:8.1f} {tokens[way]:7d} {tokens[way] / secs:7.1f} {tokens[way] / secs / base:13.2f}x "
              f"{same:>4}/{len(ref)}")
    print(f"(files in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
