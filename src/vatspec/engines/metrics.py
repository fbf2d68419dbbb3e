"""The engines' own acceptance counters, read from their Prometheus ``/metrics`` text.

vLLM counts, over every request since it started (counters, so a cell's figures are the difference of
two scrapes, ``after - before``):

    vllm:spec_decode_num_drafts_total                      rounds that drafted
    vllm:spec_decode_num_draft_tokens_total                tokens drafted
    vllm:spec_decode_num_accepted_tokens_total             drafted tokens the target accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="j"}   accepted at draft position j

and prints the mean acceptance length as ``1 + accepted / drafts`` (the bonus token counted): so does
``SpecCounters.mean_acceptance_length``. SGLang exports a gauge instead, ``sglang:spec_accept_length``
(its recent batches' mean accepted length, bonus token counted), read as it is.

    before = spec_counters(scrape(url)); ...load...; cell = spec_counters(scrape(url)) - before
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from vatspec.data.endpoints import fetch

VLLM = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted"}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: ``(name, labels, value)``; comments and blank lines skipped,
    a line that is not a sample is an error naming its number."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"/metrics line {n}: not a Prometheus sample: {line[:120]!r}")
        try:
            value = float(m.group(4))
        except ValueError:
            raise ValueError(f"/metrics line {n}: value {m.group(4)!r} is not a number") from None
        out.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), value))
    return out


def scrape(url: str, timeout: float = 10.0, key: str | None = None) -> str:
    """The ``/metrics`` text of the server at ``url`` (its root, with or without ``/v1``); an ``OSError`` when it
    does not answer it."""
    status, raw = fetch(url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=timeout, key=key,
                        accept="text/plain")
    if status != 200:
        raise OSError(f"/metrics: HTTP {status}")
    return raw.decode("utf-8", "replace")


@dataclass(frozen=True)
class SpecCounters:
    """Speculative-decoding counters of one engine (vLLM's names above); ``found``: the engine exports them
    (False: no speculation, or an engine that does not count)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: tuple[int, ...] = ()
    found: bool = False
    accept_length: float | None = None  # SGLang's gauge, when that is all there is

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.per_pos), len(before.per_pos))
        pad = lambda p: tuple(p) + (0,) * (n - len(p))  # noqa: E731
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            tuple(a - b for a, b in zip(pad(self.per_pos), pad(before.per_pos))),
                            self.found, self.accept_length)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens committed per verify round, vLLM's way: 1 + accepted / drafts (SGLang: its gauge)."""
        if self.drafts > 0:
            return 1.0 + self.accepted / self.drafts
        return self.accept_length

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def per_position_rate(self) -> list[float]:
        """The share of rounds whose draft position j was accepted."""
        return [a / self.drafts for a in self.per_pos] if self.drafts > 0 else []

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "accepted_per_pos": list(self.per_pos), "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_rate": self.acceptance_rate, "per_position_rate": self.per_position_rate}


def spec_counters(text: str) -> SpecCounters:
    """The speculative-decoding counters in a ``/metrics`` text (vLLM's summed over its engines and models;
    SGLang's accept-length gauge)."""
    totals = {v: 0.0 for v in VLLM.values()}
    per_pos: dict[int, float] = {}
    found, gauge = False, []
    for name, labels, value in parse(text):
        base = name.removesuffix("_total")
        if base in VLLM:
            totals[VLLM[base]] += value
            found = True
        elif base == VLLM_PER_POS and "position" in labels:
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + value
            found = True
        elif name == SGLANG_ACCEPT_LENGTH and math.isfinite(value):
            gauge.append(value)
            found = True
    pos = tuple(round(per_pos.get(j, 0.0)) for j in range(max(per_pos, default=-1) + 1))
    return SpecCounters(round(totals["drafts"]), round(totals["draft_tokens"]), round(totals["accepted"]), pos,
                        found, sum(gauge) / len(gauge) if gauge else None)


@dataclass
class Scraper:
    """``/metrics`` of one server read around each piece of load; ``failed`` holds why a scrape failed (the
    figures of that cell are then missing, not zero)."""

    url: str
    key: str | None = field(default=None, repr=False)
    failed: str | None = None

    def read(self) -> SpecCounters | None:
        try:
            return spec_counters(scrape(self.url, key=self.key))
        except (OSError, ValueError) as e:
            self.failed = f"{type(e).__name__}: {e}"
            return None
