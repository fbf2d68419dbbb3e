"""Regeneration in-process against regeneration through servers, side by side on the same prompts.

    .venv/bin/python scripts/bench_regen_endpoints.py [--n 64] [--max-new-tokens 64] [--concurrency 4] \
        [--engine transformers|vllm] [--vllm-python ~/vllm-cpu/bin/python] [--serve-args "..."]

Answers the demo's first N training prompts (greedy, the embedded target, float32) three ways in one run:
``regenerate`` in-process (the demo's batches), through one server process on the loopback address
(``transformers serve``, or vLLM's OpenAI server from the CPU build ``vllm-cpu`` in its own venv), and
through two such processes at once (``--endpoint`` twice; vLLM servers bound to a core each). Prints each
way's time, tokens, tokens/s, its ratio to in-process, and the share of answers whose token ids equal
in-process's (the server's ids where it returns them, as vLLM does, else its text re-tokenized). The servers
are started and stopped by the script; they share the machine's cores with nothing else of it while they answer.
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
    args = ap.parse_args()

    from vatspec.benchmarks import prepare_prompts
    from vatspec.data import regenerate
    from vatspec.data.endpoints import regenerate_endpoints
    from vatspec.demo import REGEN_BATCH, SIZES
    from vatspec.target import open_target, prepare_default_target

    size = SIZES["default"]
    prompts = prepare_prompts(size.prompts, seed=size.seed, max_turns=1, max_chars=600)[: args.n]
    work = Path(tempfile.mkdtemp(prefix="bench-regen-endpoints-"))
    rows = []

    target = open_target("default", device="cpu", dtype="float32")
    t = time.perf_counter()
    st = regenerate(prompts, target, work / "inproc.jsonl", batch_size=REGEN_BATCH[0], batch_tokens=REGEN_BATCH[1],
                    max_new_tokens=args.max_new_tokens, progress=False)
    rows.append(("in-process", time.perf_counter() - t, st.new_tokens, work / "inproc.jsonl"))
    tok, eos = target.tokenizer, list(target.eos_token_ids)
    del target

    path = prepare_default_target()
    extra = shlex.split(args.serve_args)
    for n_servers in (1, 2):
        vllm = args.vllm_python if args.engine == "vllm" else None
        cores = [str(k % (os.cpu_count() or 1)) for k in range(n_servers)] if n_servers > 1 else [None]
        servers = [start_server(path, extra, work / f"serve{n_servers}-{k}.log", vllm, cores[k])
                   for k in range(n_servers)]
        out = work / f"endpoints{n_servers}.jsonl"
        try:
            t = time.perf_counter()
            st = regenerate_endpoints(prompts, [u for _, u, _ in servers], servers[0][2], tok, eos, out,
                                      concurrency=args.concurrency, max_new_tokens=args.max_new_tokens,
                                      progress=False)
            rows.append((f"{n_servers} {args.engine} x {args.concurrency}", time.perf_counter() - t, st.new_tokens,
                         out))
        finally:
            for proc, _, _ in servers:
                proc.send_signal(signal.SIGINT)
                proc.wait(30)

    ref = answer_ids(rows[0][3], tok)
    base = rows[0][2] / rows[0][1]
    print(f"\n{args.n} prompts, at most {args.max_new_tokens} new tokens, greedy, float32; {args.engine} server "
          f"{args.serve_args or '(defaults)'}")
    print(f"{'way':<24} {'seconds':>8} {'tokens':>7} {'tok/s':>7} {'vs in-process':>14} {'ids equal':>10}")
    for name, secs, tokens, out in rows:
        got = answer_ids(out, tok)
        same = sum(got.get(k) == v for k, v in ref.items())
        print(f"{name:<24} {secs:8.1f} {tokens:7d} {tokens / secs:7.1f} {tokens / secs / base:13.2f}x "
              f"{same:>4}/{len(ref)}")
    print(f"(files in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
