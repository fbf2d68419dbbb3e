"""Output locations: where a command may write.

A command writes into a folder only if it made that folder (or found it empty), never over a file
or folder it did not create, and never onto, into or around one of its inputs. A folder a command
made holds ``.vatspec-owner`` (``{"command": ..., "created": ...}``): the proof, on the next run,
that the command may write there again. A file output proves itself by its content (a JSONL file
of the command's own records); the commands that write one check that before touching it.

    check_apart(out, {"--draft": "runs/e3"}, "--out")   # raises OutputError if they overlap
    check_folder(out, "eval", "--out")                  # before any work: empty, absent or ours
    claim_folder(out, "eval")                           # when the first file is written
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

log = logging.getLogger(__name__)

OWNER = ".vatspec-owner"


def strict_json(obj, **kw) -> str:
    """``obj`` as JSON that strict readers take: a non-finite number (NaN, inf) written as null, not as the bare
    ``NaN`` Python's ``json`` writes by default (``jq``, JavaScript and Go refuse it)."""
    return json.dumps(_finite(obj), allow_nan=False, **kw)


def _finite(x):
    if isinstance(x, float):
        return x if x - x == 0.0 else None  # nan - nan and inf - inf are nan
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def vatspec_home() -> Path:
    """Cache directory for converted targets and bundled corpora (``$VATSPEC_HOME``)."""
    env = os.environ.get("VATSPEC_HOME")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "vatspec"


class OutputError(ValueError):
    """An output location that would damage a file, a folder or an input the command does not own."""


def _real(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()


def check_apart(out: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None], what: str) -> None:
    """``out`` is not one of ``inputs`` (name -> path), not inside one, and holds none of them."""
    o = _real(out)
    for name, path in inputs.items():
        if not path:
            continue
        i = _real(path)
        if o == i:
            raise OutputError(f"{what} {out} is the input {name} {path}; choose another {what}")
        if o.is_relative_to(i):
            raise OutputError(f"{what} {out} is inside the input {name} {path}; choose another {what}")
        if i.is_relative_to(o):
            raise OutputError(f"{what} {out} holds the input {name} {path}; choose another {what}")


def owner(folder: str | os.PathLike) -> str | None:
    """The command that made ``folder`` (its ``.vatspec-owner``), or None."""
    try:
        return str(json.loads((Path(folder) / OWNER).read_text(encoding="utf-8"))["command"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_folder(folder: str | os.PathLike, command: str, what: str = "--out") -> None:
    """``folder`` is absent, an empty folder, or one made by ``command``: anything else is an
    ``OutputError`` naming it, raised before the command does any work."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{what} {folder} exists and is not a folder")
    for parent in folder.parents:
        if parent.exists() and not parent.is_dir():
            raise OutputError(f"{what} {folder}: {parent} is a file, not a folder")
    if folder.is_dir() and any(folder.iterdir()) and owner(folder) != command:
        made = owner(folder)
        by = f"was made by vatspec {made}" if made else f"was not made by vatspec {command} (no {OWNER})"
        raise OutputError(f"{what} {folder} is not empty and {by}; choose another {what} or empty it yourself")


def claim_folder(folder: str | os.PathLike, command: str) -> Path:
    """Create ``folder`` (parents too) if needed and mark it as made by ``command``; checked first."""
    folder = Path(folder)
    check_folder(folder, command)
    folder.mkdir(parents=True, exist_ok=True)
    mark_folder(folder, command)
    return folder


def mark_folder(folder: str | os.PathLike, command: str) -> None:
    """Write ``folder``'s ``.vatspec-owner``: made by ``command`` (kept if it says so already)."""
    if owner(folder) != command:
        text = json.dumps({"command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
        (Path(folder) / OWNER).write_text(text)


def check_file(path: str | os.PathLike, what: str = "--out") -> Path:
    """``path`` can be a file: not a folder, not ``.``, its parents not files."""
    path = Path(path)
    if not path.name or path.is_dir():
        raise OutputError(f"{what} {path} is a folder; expected a file name")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise OutputError(f"{what} {path}: {parent} is a file, not a folder")
    return path


def own_jsonl(path: str | os.PathLike, ours, what: str, *, tail_prefix: bytes | None = None) -> tuple[list, int]:
    """The records of ``path``, which must be an earlier output of the caller: every complete line a
    JSON object that ``ours(record)`` accepts. Returns ``(records, length)``, ``length`` the bytes of the
    complete lines. A last line without its newline is allowed only when it looks like an interrupted
    write of the caller's: it starts with ``tail_prefix`` (how the caller's records start) and is not
    complete JSON; the caller may then cut it. Anything else is an ``OutputError`` naming the file and
    line, raised before the file is touched."""
    path = Path(path)
    data = path.read_bytes()
    length = data.rfind(b"\n") + 1
    tail = data[length:]
    if tail and not (tail_prefix is not None and tail.startswith(tail_prefix) and not _is_json(tail)):
        raise OutputError(f"{what} {path} ends in a line that is not one of vatspec's records; it is not this "
                          "command's output, so it is left as it is: choose another output file")
    records = []
    for i, line in enumerate(data[:length].split(b"\n")[:-1], 1):
        try:
            rec = json.loads(line.decode("utf-8"))
            good = ours(rec)
        except (ValueError, KeyError, TypeError, AttributeError):
            good = False
        if not good:
            raise OutputError(f"{what} {path}:{i}: not a record this command writes; the file is not its "
                              "output, so it is left as it is: choose another output file")
        records.append(rec)
    return records, length


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError both
        return False
    return True


def user_mode(path: str | os.PathLike) -> None:
    """Give ``path`` the user's default file mode (0644 under umask 022). safetensors creates its files 0600,
    which an engine running as another user (a container) cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


@contextmanager
def write_lock(path: str | os.PathLike, what: str, command: str, part: str = ""):
    """Hold the one-writer lock of the output ``path`` (a run folder, a cache, a JSONL file, an export) while
    the body runs: a second writer fails at once with an ``OutputError`` naming the holder (pid, host,
    command, since when). The lock is an advisory ``flock`` on a file under ``$VATSPEC_HOME/locks`` keyed by
    the output's real path (``part``: a share of it that may be written apart, e.g. one rank's shards), so
    the outputs hold nothing extra; the kernel releases it when its process dies, and the next writer
    reports the dead holder it takes over from. One machine: writers on two hosts sharing a filesystem
    are not seen."""
    import fcntl
    import hashlib
    import socket

    real = str(_real(path))
    folder = vatspec_home() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / (hashlib.sha256(f"{real}\0{part}".encode()).hexdigest()[:32] + ".lock")
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputError(f"{what} {path} is being written by {_holder(fd)}; wait for it to finish or "
                              f"choose another {what}") from None
        old = _holder_record(fd)
        if old and old.get("host") == socket.gethostname() and not pid_alive(old.get("pid")):
            log.warning("%s %s: taking over the lock of pid %s (%s since %s), which is no longer running",
                        what, path, old.get("pid"), old.get("command"), old.get("since"))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "path": real, "part": part,
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released: the file stays (unlinking it would let two writers hold two files)
    finally:
        os.close(fd)


def _holder_record(fd: int) -> dict | None:
    try:
        rec = json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _holder(fd: int) -> str:
    rec = _holder_record(fd) or {}
    return (f"vatspec {rec.get('command', '?')} (pid {rec.get('pid', '?')} on {rec.get('host', '?')}, since "
            f"{rec.get('since', '?')})")


def pid_alive(pid) -> bool:
    """Whether process ``pid`` runs on this machine (one we may not signal counts as running)."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


# what a failed write raises: the OS's error, or safetensors' (a full disk while serializing)
WRITE_ERRORS = (OSError, SafetensorError)


def write_error(e: BaseException) -> str:
    """The reason of a failed write (``WRITE_ERRORS``) in a few words: "No space left on device", ..."""
    return getattr(e, "strerror", None) or str(e).removeprefix("Error while serializing: ")
