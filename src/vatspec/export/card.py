"""``README.md``: the model card of an export folder, ready for a model hub.

YAML front matter (``base_model`` when the target is named by a hub id, ``library_name``, ``tags``), then
the target, the drafter, the data and chat template settings it was trained with, its held-out acceptance
(what training measured, else "not measured") and the vLLM and SGLang launch commands for this folder
(docs/serving.md). ``model_card`` builds the text from what the export already holds, asking the folder's format
(``ServedFormat``: tags, rows, k, launch flags) for what differs between formats; ``write_card`` reads those
(``config.json``, ``vatspec.json``, the run's saved ``config.yaml``) and writes it.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import yaml

from vatspec.data.chat import BOOL_KWARGS, format_kwargs
from vatspec.drafters import drafter_class
from vatspec.drafters.served import ServedFormat
from vatspec.export.formats import CONFIG, served_format
from vatspec.export.record import RECORD

CARD = "README.md"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_card(fmt: str, cfg: dict, record: dict | None, *, target: str | None, folder: str, k: int,
               run: dict | None = None) -> str:
    """The card of a ``fmt`` folder written at ``folder``: ``cfg`` its ``config.json``, ``record`` its
    ``vatspec.json`` (None: none), ``target`` the target's name or path, ``k`` the tokens the draft proposes a
    round where ``cfg`` does not record them (``ServedFormat.served_k``; EAGLE-3's eagle3-hf: its TTT steps),
    ``run`` the training run's saved config (None: not from a run)."""
    record = record or {}
    served = served_format(fmt)
    title = drafter_class(served.kind).title
    k = served.served_k(cfg) or k
    target = served.named_target(cfg) or target
    name = target or "TARGET"
    hub = bool(target) and _HUB_ID.fullmatch(target) is not None and not Path(target).exists()
    front = {**({"base_model": target} if hub else {}), "library_name": "vatspec",
             "tags": ["speculative-decoding", *served.tags, "draft-model", "vatspec"]}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {title} draft for {name}", "",
             f"A speculative-decoding draft model ({title}, `{fmt}` format) for `{name}`, "
             + ("trained with vatspec" if record.get("training") else "exported by vatspec")
             + ". It proposes tokens that the target verifies, so the text served is the target's own; serve it "
             "with the same target it was trained on.", ""]
    if not hub:
        lines += [("The target is named here by a local path" if target else "The export did not name its target")
                  + ": set `base_model` in the front matter to its hub id, and name it so in the commands below, "
                  "before uploading.", ""]
    lines += ["## Base model", "", *_target(name, record.get("target") or {}), "",
              "## Drafter", "", *_drafter(served, cfg, k, record), "",
              "## Training", "", *_training(record, run), "",
              "## Held-out acceptance", "", *_heldout(record.get("training")), "",
              "## Serving", "", *_serve(served, name, folder, k), ""]
    return "\n".join(lines)


def write_card(folder: Path, fmt: str, target: str | None, k: int, out: Path) -> None:
    """``folder/README.md``, the card of the export being written in ``folder`` that is served from ``out``."""
    cfg = json.loads((folder / CONFIG).read_text())
    record = json.loads((folder / RECORD).read_text()) if (folder / RECORD).is_file() else None
    run = None
    checkpoint = ((record or {}).get("training") or {}).get("checkpoint")
    if checkpoint and (Path(checkpoint) / "config.yaml").is_file():
        try:
            run = yaml.safe_load((Path(checkpoint) / "config.yaml").read_text())
        except yaml.YAMLError:
            run = None  # a card without the run's data settings, never a failed export
    text = model_card(fmt, cfg, record, target=target, folder=str(out), k=k, run=run if isinstance(run, dict) else None)
    (folder / CARD).write_text(text)


def _target(name: str, tgt: dict) -> list[str]:
    out = [f"- target: `{name}`"]
    if tgt:
        out.append(f"- {tgt.get('num_layers')} layers, hidden size {tgt.get('hidden_size')}, vocabulary "
                   f"{tgt.get('vocab_size')}")
    if tgt.get("tokenizer_sha256"):
        out.append(f"- tokenizer sha256 `{tgt['tokenizer_sha256']}`, chat template sha256 "
                   f"`{tgt.get('chat_template_sha256')}` (`vatspec check` compares them with the target served)")
    return out


def _drafter(served: ServedFormat, cfg: dict, k: int, record: dict) -> list[str]:
    layer = served.layer_config(cfg)
    # an export's config.json lists its layer ids, so no default (which needs the target's depth) is taken
    ids = record.get("target_layer_ids") or served.layer_ids(cfg, num_layers=0)[0]
    rows = [("kind", drafter_class(served.kind).title),
            ("decoder layers", layer["num_hidden_layers"]),
            ("hidden size", layer["hidden_size"]),
            ("target layers read (output of layer i)", sorted(ids)),
            ("weights dtype", cfg["torch_dtype"]),
            *served.card_rows(cfg, k)]
    return ["| | |", "| --- | --- |", *(f"| {a} | {b} |" for a, b in rows)]


def _training(record: dict, run: dict | None) -> list[str]:
    tgt, train = record.get("target") or {}, record.get("training") or {}
    data = (run or {}).get("data") or {}
    out = []
    if run:
        source = data.get("train") or data.get("features") or "(not recorded)"
        out += [f"- data: `{source}`" + (" (a feature cache)" if not data.get("train") and data.get("features")
                                         else ""),
                f"- max length {data.get('max_length')}, supervised positions: {data.get('loss_on', 'assistant')}",
                f"- loss: `{((run.get('loss') or {}).get('kind'))}`"]
    else:
        out.append("- data: not recorded (the draft was not exported from a vatspec training run)")
    if run:
        out.append(f"- chat template: `{data['chat_template']}`" if data.get("chat_template") else
                   "- chat template: the tokenizer's own")
    kwargs = tgt.get("chat_template_kwargs")
    if kwargs is None:
        out.append("- chat template arguments: not recorded")
    else:
        out.append(f"- chat template arguments (`chat_template_kwargs`): `{json.dumps(kwargs)}`"
                   + ("; send the same with each request" if kwargs else ""))
        switch = next((key for key in BOOL_KWARGS if key in kwargs), None)
        out.append(f"- reasoning: {'on' if kwargs[switch] else 'off'} (`{format_kwargs({switch: kwargs[switch]})}`)"
                   if switch else "- reasoning: the template's default (no thinking switch given)")
    if tgt.get("chat_template_date"):
        out.append(f"- the template's date pinned to {tgt['chat_template_date']}")
    if train:
        out.append(f"- checkpoint: step {train.get('step')}, k = {train.get('k')}")
    return out


def _heldout(training: dict | None) -> list[str]:
    held = (training or {}).get("heldout")
    if not held or held.get("tau_sim") is None:
        return ["Not measured (the run logged no held-out evaluation, or the draft was not exported from a run)."]
    out = [f"- τ (tokens a round: the drafts accepted and the target's own, by simulated greedy verification on "
           f"held-out answers): **{held['tau_sim']:.3f}** at step {held.get('step')}"
           + (f", over {held['chains']} chains" if held.get("chains") else "")]
    if held.get("cond_acc"):
        out.append("- acceptance at each drafted position, given the earlier ones accepted: "
                   + ", ".join(f"{a:.3f}" if isinstance(a, (int, float)) and math.isfinite(a) else "-"
                               for a in held["cond_acc"]))  # nan: no chain reached that position
    out.append("- measured by training, not by an engine: `vatspec check FOLDER --target TARGET` measures the "
               "served draft")
    return out


def _serve(served: ServedFormat, target: str, folder: str, k: int) -> list[str]:
    t, f = shlex.quote(target), shlex.quote(folder)
    spec = shlex.quote(json.dumps({"method": served.vllm_method, "model": folder, "num_speculative_tokens": k}))
    vllm = ["vLLM:", "", "```bash", f"vllm serve {t} --speculative-config {spec}"]
    if served.vllm_alone:
        vllm += ["# or alone: vLLM reads the target and the token count from the folder", f"vllm serve {f}"]
    vllm += ["```", ""]
    if served.sglang_algorithm is None:
        loaded = [g.name for g in drafter_class(served.kind).formats if g.sglang_algorithm]
        return vllm + [f"SGLang does not load the `{served.name}` format"
                       + (f": export with `--format {loaded[0]}` for it." if loaded else ".")]
    args = [f"python -m sglang.launch_server --model-path {t}",
            f"--speculative-algorithm {served.sglang_algorithm} --speculative-draft-model-path {f}",
            served.sglang_flags(k)]
    note = ["", served.sglang_note] if served.sglang_note else []
    return vllm + ["SGLang:", "", "```bash", " \\\n    ".join(a for a in args if a), "```", *note]
