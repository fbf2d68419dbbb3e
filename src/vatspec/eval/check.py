"""``vatspec check``: is a served draft folder what the engine will run, and does it accept what it did
in training?

A draft can load without an error and still be served wrong: a layer id off by one, an embedding the
loader never filled, another RoPE base, another tokenizer. Acceptance then collapses silently. This
module reads any served folder (this project's exports or a peer trainer's: EAGLE-3 HF, speculators,
DFlash) the way the engines do, checks the conventions they rely on, and measures greedy
acceptance on held-out prompts next to what training measured (``vatspec.json``, when the folder has one).

    report = check_draft(folder, target, prompts)    # -> CheckReport; report.ok, report.findings
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from vatspec.drafters.layers import rope_parameters
from vatspec.drafters.served import Finding, ServedFormat, embedding_matches
from vatspec.eval.decode import generate
from vatspec.export.formats import CONFIG, ExportError, detect, read_json
from vatspec.export.read import import_draft, load_accept_head
from vatspec.export.record import RECORD, read_record, target_fingerprint

# "far below training": the served draft accepts less than this fraction of the drafted tokens per
# round that training's held-out simulation accepted. A served-wrong draft falls to ~0 (a shifted
# layer or a wrong embedding leaves step-0 accuracy near chance); prompt-set differences alone move
# it by tens of percent, not by half.
COLLAPSE_RATIO = 0.5
MIN_TRAINED_ACCEPT = 0.05  # below this many accepted drafts per chain in training there is nothing to compare


@dataclass
class CheckReport:
    folder: str
    format: str | None
    findings: list[Finding] = field(default_factory=list)
    measured: dict | None = None  # decode at T=0: tau, per-position acceptance, prompts, rounds
    training: dict | None = None  # vatspec.json's held-out metrics, when recorded

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def to_dict(self) -> dict:
        return {"folder": self.folder, "format": self.format, "ok": self.ok,
                "findings": [vars(f) for f in self.findings], "measured": self.measured, "training": self.training}


# ----------------------------------------------------------------------------- conventions
def convention_findings(folder: Path, target, template=None) -> tuple[str | None, list[Finding]]:
    """Every convention the engines rely on, checked on ``folder`` against ``target``."""
    src = folder / CONFIG
    try:
        cfg = read_json(src)
        fmt = detect(cfg, str(src))
    except ExportError as e:
        return None, [Finding(False, "format", str(e))]
    out = [Finding(True, "format", f"{fmt.name} ({', '.join(cfg.get('architectures') or [])})")]
    lc = fmt.layer_config(cfg)

    # 1. layer ids: in range, distinct, increasing (the engines capture layers in the order they run)
    ids, problems = fmt.layer_ids(cfg, target.num_layers)
    out += [Finding(False, "layer ids", p) for p in problems]
    L = target.num_layers
    if ids:
        in_range = all(0 <= i < L for i in ids)
        out.append(Finding(in_range, "layer ids", f"{ids} (output of layer i) "
                           + ("in range" if in_range else f"out of range for a {L}-layer target")))
        ordered = all(a < b for a, b in zip(ids, ids[1:]))
        out.append(Finding(ordered, "layer order", "increasing" if ordered else
                           f"{ids} not distinct and increasing: the engines feed fc the layers in the order they run "
                           f"({sorted(set(ids))}), not the listed order"))
    record = read_record(folder)
    if record is None and (folder / RECORD).exists():  # a third-party folder has none; a broken one is said
        out.append(Finding(False, "record", f"{RECORD} is not a readable vatspec record (broken JSON, or another "
                           "file of that name): the checks against training are skipped; re-export the draft"))
    if record is not None and ids:
        trained = sorted(int(i) for i in record.get("target_layer_ids") or [])
        same = trained == sorted(ids)
        out.append(Finding(same, "layer ids vs training", f"served {sorted(ids)} = trained {trained}" if same else
                           f"config.json makes the engines read layers {sorted(ids)} (output of layer i), the draft "
                           f"was trained on {trained} (vatspec.json)"))

    # 2. sizes: the draft shares the target's embedding (and, DFlash, its lm_head)
    bad = [f"{n}={have} (target {want})" for n, (have, want) in fmt.sizes(cfg, target).items() if have != want]
    out.append(Finding(not bad, "sizes", "; ".join(bad) if bad else "vocab, hidden and layer counts match the target"))

    # 3. RoPE: the draft layer must rotate as it trained: DFlash like the target; EAGLE-3 (its own model) like the
    # target where the engines serve its scaling as transformers computes it (linear, llama3, yarn), else plain at
    # the target's theta (dynamic, longrope), as it trains
    theta, scaling = rope_parameters(lc)
    t_theta, t_scaling = fmt.target_rope(target.config)
    same = math.isclose(theta, t_theta, rel_tol=1e-6) and (scaling or None) == (t_scaling or None)
    out.append(Finding(same, "rope", f"rope_theta {theta:g}, scaling {scaling}" + (" = the target's" if same else
                       f"; the target's: rope_theta {t_theta:g}, scaling {t_scaling}")))

    # 4. weights: the draft vocabulary maps and the embedding the loaders use
    out += _weight_findings(fmt, cfg, folder, target)

    # 5. the format's own conventions (DFlash: the MASK token)
    out += fmt.findings(cfg, folder, target)

    # 6. tokenizer and chat template, when recorded
    if record is not None:
        have, want = record.get("target") or {}, target_fingerprint(target, template)
        for key, what in (("tokenizer_sha256", "tokenizer"), ("chat_template_sha256", "chat template")):
            if have.get(key) and want.get(key):
                same = have[key] == want[key]
                out.append(Finding(same, what, f"the target's {what} is the one trained with" if same else
                                   f"the target's {what} differs from the one the draft was trained with "
                                   "(vatspec.json)"))
        if "chat_template_kwargs" in have:  # how the engine is told to render (chat_template_kwargs)
            from vatspec.data.chat import format_kwargs

            a = format_kwargs(have["chat_template_kwargs"] or {})
            b = format_kwargs(want.get("chat_template_kwargs") or {})  # served with no template: no arguments
            out.append(Finding(a == b, "template args", f"{b}, as trained" if a == b else
                               f"served with {b} but trained with {a} (vatspec.json): pass "
                               f"--chat-template-kwargs as the engine renders"))
        if have.get("chat_template_date") or want.get("chat_template_date"):  # a template that stamps the day
            a, b = have.get("chat_template_date"), want.get("chat_template_date")
            out.append(Finding(a == b, "template date", f"{b}, as trained" if a == b else
                               f"rendered on {b} but trained on {a} (vatspec.json): pass --chat-template-date {a}"))
    return fmt.name, out


def _weight_findings(fmt: ServedFormat, cfg: dict, folder: Path, target) -> list[Finding]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return [Finding(False, "weights", f"no *.safetensors in {folder}")]
    odd = [f.name for f in files if not f.is_file()]  # a FIFO would block the read forever
    if odd:
        return [Finding(False, "weights", f"{', '.join(odd)} in {folder} is not a regular file: the engines read "
                        "every *.safetensors of the folder")]
    try:
        tensors: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle)
                    if name in tensors:  # which one an engine keeps depends on its loading order
                        return [Finding(False, "weights", f"{name} is in both {tensors[name].name} and {file.name}: "
                                        "the engines load every *.safetensors of the folder; remove the stale file")]
                    tensors[name] = file
    except (OSError, SafetensorError) as e:
        return [Finding(False, "weights", f"unreadable ({e})")]

    def get(name: str) -> torch.Tensor:
        with safe_open(str(tensors[name]), framework="pt") as f:
            return f.get_tensor(name)

    values = {name: get(name) for name in tensors}
    out = [_values_finding(values), _dtype_finding(cfg, values)]
    emb = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
    if emb is not None:
        same = embedding_matches(get(emb), target)
        out.append(Finding(same, "embedding", f"{emb} is the target's input embedding" if same else
                           f"{emb} is not the target's input embedding: the engines draft with it"))
    return out + fmt.weight_findings(cfg, values, target)


def _values_finding(tensors: dict[str, torch.Tensor]) -> Finding:
    """Every tensor read: no NaN or inf anywhere, and no weight matrix all zeros or one constant (what a bad
    conversion or a torn copy leaves, and what a trained or freshly initialised matrix never is)."""
    bad = []
    for name, t in sorted(tensors.items()):
        if not t.is_floating_point():
            continue
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad.append(f"{name} has {int((~finite).sum())} NaN/inf of {t.numel()}")
        elif t.dim() == 2 and t.numel() > 1 and bool((t == t.flatten()[0]).all()):
            bad.append(f"{name} is constant ({float(t.flatten()[0]):g} everywhere)")
    if bad:
        return Finding(False, "weight values", "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4
                                                                       else ""))
    return Finding(True, "weight values", f"{len(tensors)} tensors read: finite, no constant matrix")


def _dtype_finding(cfg: dict, tensors: dict[str, torch.Tensor]) -> Finding:
    """The floating tensors share one dtype, the one ``config.json`` declares (``torch_dtype`` or ``dtype``): a
    mix, or another dtype than declared, is what a partial or hand-made conversion leaves."""
    stored: dict[str, list[str]] = {}
    for name, t in sorted(tensors.items()):
        if t.is_floating_point():
            stored.setdefault(str(t.dtype).removeprefix("torch."), []).append(name)
    declared = cfg.get("torch_dtype") or cfg.get("dtype")
    if len(stored) > 1:
        return Finding(False, "weight dtype", "mixed: " + "; ".join(f"{len(v)} tensors {d} (e.g. {v[0]})"
                                                                     for d, v in sorted(stored.items())))
    have = next(iter(stored), None)
    if declared and have and declared != have:
        return Finding(False, "weight dtype", f"the tensors are {have}, config.json declares {declared} "
                       f"(torch_dtype): a conversion that stopped half way or a hand-edited config")
    return Finding(True, "weight dtype", f"{have or 'no floating tensors'}" + (", as config.json declares"
                                                                                 if declared else ""))


# ----------------------------------------------------------------------------- acceptance
def measure(target, drafter, prompts: Sequence[list[int]], *, k: int | None = None, max_new_tokens: int = 64) -> dict:
    """Greedy speculative decoding of ``prompts``, ``k`` drafts per round (default ``drafter.k``) -> tau
    (tokens per verify pass, bonus included) and the per-position acceptance: ``cond_accept[j]`` =
    P(draft j + 1 accepted | drafts 1..j accepted)."""
    k = k or drafter.k
    reach = [0] * k
    hit = [0] * k
    rounds = committed = 0
    for ids in prompts:
        res = generate(target, ids, drafter, k=k, max_new_tokens=max_new_tokens)
        rounds += len(res.rounds)
        committed += sum(res.tokens_per_step)
        for r in res.rounds:
            for j in range(min(r.accepted + 1, r.drafted)):  # positions this round's chain reached
                reach[j] += 1
                hit[j] += j < r.accepted
    return {"prompts": len(prompts), "rounds": rounds, "tau": committed / rounds if rounds else float("nan"),
            "cond_accept": [h / n if n else float("nan") for h, n in zip(hit, reach)], "k": k,
            "max_new_tokens": max_new_tokens}


def acceptance_finding(measured: dict, training: dict | None) -> Finding | None:
    """Served acceptance against training's held-out simulation; None when there is nothing to compare."""
    heldout = (training or {}).get("heldout") or {}
    tau_sim = heldout.get("tau_sim")
    if tau_sim is None or not math.isfinite(measured["tau"]):
        return None
    trained, served = tau_sim - 1.0, measured["tau"] - 1.0
    if trained < MIN_TRAINED_ACCEPT:
        return Finding(True, "acceptance", f"training accepted {trained:.3f} drafts per chain: too few to compare")
    ratio = served / trained
    ok = ratio >= COLLAPSE_RATIO
    return Finding(ok, "acceptance", f"served tau {measured['tau']:.3f} vs training's held-out tau_sim {tau_sim:.3f} "
                   f"(step {heldout.get('step')}): {ratio:.0%} of the accepted drafts"
                   + ("" if ok else f", below {COLLAPSE_RATIO:.0%}: served differently from how it was trained"))


def check_draft(folder: str | Path, target, prompts: Sequence[list[int]] | None = None, *,
                max_new_tokens: int = 64, template=None) -> CheckReport:
    """Check ``folder`` against ``target`` served with ``template`` (a ``ChatTemplate``; None: the tokenizer's
    own, no arguments); with ``prompts`` (token ids), also decode them and compare the acceptance with
    training's. The draft is opened as the engines would open it."""
    folder = Path(folder)
    fmt, findings = convention_findings(folder, target, template)
    record = read_record(folder)
    report = CheckReport(str(folder), fmt, findings, training=(record or {}).get("training"))
    if fmt is None:
        return report
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            drafter = import_draft(folder, target)
        findings.append(Finding(True, "load", f"loads as a {drafter.kind} draft, k={drafter.k}"))
        findings += [Finding(True, "load", f"warning: {w.message}") for w in caught]
        if (folder / "accept_head").is_dir():
            load_accept_head(folder)
    except ExportError as e:
        findings.append(Finding(False, "load", str(e)))
        return report
    if prompts:  # at the k training simulated, when recorded (a served k is a launch setting)
        k = (report.training or {}).get("k") or drafter.k
        report.measured = measure(target, drafter, prompts, k=k, max_new_tokens=max_new_tokens)
        found = acceptance_finding(report.measured, report.training)
        if found is not None:
            findings.append(found)
    return report
