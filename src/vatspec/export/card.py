"""``README.md``: the model card of an export folder, ready for a model hub.

YAML front matter (``base_model`` when the target is named by a hub id, ``library_name``, ``tags``), then
the target, the drafter, the data and chat template settings it was trained with, its held-out acceptance
(what training measured, else "not measured") and the vLLM and SGLang launch commands for this folder
(docs/serving.md). ``model_card`` builds the text from what the export already holds; ``write_card`` reads
those (``config.json``, ``vatspec.json``, the run's saved ``config.yaml``) and writes it.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import yaml

from vatspec.data.chat import BOOL_KWARGS, format_kwargs
from vatspec.export.formats import CONFIG
from vatspec.export.record import RECORD

CARD = "README.md"
NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}
TAGS = {"eagle3-hf": ["eagle3"], "speculators": ["eagle3", "speculators"], "dflash": ["dflash"]}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_card(fmt: str, cfg: dict, record: dict | None, *, target: str | None, folder: str, k: int,
               run: dict | None = None) -> str:
    """The card of a ``fmt`` folder written at ``folder``: ``cfg`` its ``config.json``, ``record`` its
    ``vatspec.json`` (None: none), ``target`` the target's name or path, ``k`` the tokens the draft proposes a
    round (EAGLE-3: its TTT steps; speculators and DFlash read it from ``cfg``), ``run`` the training run's
    saved config (None: not from a run)."""
    record = record or {}
    kind = "dflash" if fmt == "dflash" else "eagle3"
    if fmt == "speculators":
        k = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        target = cfg["speculators_config"]["verifier"]["name_or_path"] or target
    elif fmt == "dflash":
        k = cfg["block_size"] - 1
    name = target or "TARGET"
    hub = bool(target) and _HUB_ID.fullmatch(target) is not None and not Path(target).exists()
    front = {**({"base_model": target} if hub else {}), "library_name": "vatspec",
             "tags": ["speculative-decoding", *TAGS[fmt], "draft-model", "vatspec"]}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {NAMES[kind]} draft for {name}", "",
             f"A speculative-decoding draft model ({NAMES[kind]}, `{fmt}` format) for `{name}`, "
             + ("trained with vatspec" if record.get("training") else "exported by vatspec")
             + ". It proposes tokens that the target verifies, so the text served is the target's own; serve it "
             "with the same target it was trained on.", ""]
    if not hub:
        lines += [("The target is named here by a local path" if target else "The export did not name its target")
                  + ": set `base_model` in the front matter to its hub id, and name it so in the commands below, "
                  "before uploading.", ""]
    lines += ["## Base model", "", *_target(name, record.get("target") or {}), "",
              "## Drafter", "", *_drafter(fmt, cfg, k, record), "",
              "## Training", "", *_training(record, run), "",
              "## Held-out acceptance", "", *_heldout(record.get("training")), "",
              "## Serving", "", *_serve(fmt, name, folder, k), ""]
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


def _drafter(fmt: str, cfg: dict, k: int, record: dict) -> list[str]:
    layer = cfg.get("transformer_layer_config") or cfg
    ids = record.get("target_layer_ids") or (cfg["dflash_config"]["target_layer_ids"] if fmt == "dflash" else
                                             [i - 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]])
    rows = [("kind", NAMES["dflash" if fmt == "dflash" else "eagle3"]),
            ("decoder layers", layer["num_hidden_layers"]),
            ("hidden size", layer["hidden_size"]),
            ("target layers read (output of layer i)", sorted(ids)),
            ("weights dtype", cfg["torch_dtype"])]
    if fmt == "dflash":
        mask = cfg["dflash_config"]
        rows += [("block size", cfg["block_size"]), ("tokens drafted a round (block size - 1)", k),
                 ("draft vocabulary", f"the target's ({layer['vocab_size']})"),
                 ("MASK token id", f"{mask['mask_token_id']}" + (f" (`{mask['mask_token']}`)" if "mask_token" in mask
                                                                 else ""))]
    else:
        rows += [("tokens drafted a round (k)", k),
                 ("draft vocabulary", f"{cfg['draft_vocab_size']} of the target's {layer['vocab_size']}")]
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


def _serve(fmt: str, target: str, folder: str, k: int) -> list[str]:
    t, f = shlex.quote(target), shlex.quote(folder)
    method = "dflash" if fmt == "dflash" else "eagle3"
    spec = shlex.quote(json.dumps({"method": method, "model": folder, "num_speculative_tokens": k}))
    vllm = ["vLLM:", "", "```bash", f"vllm serve {t} --speculative-config {spec}"]
    if fmt == "speculators":
        vllm += ["# or alone: vLLM reads the target and the token count from the folder", f"vllm serve {f}"]
    vllm += ["```", ""]
    if fmt == "speculators":
        return vllm + ["SGLang does not load the `speculators` format: export with `--format eagle3-hf` for it."]
    if fmt == "dflash":
        sglang = [f"python -m sglang.launch_server --model-path {t} \\",
                  f"    --speculative-algorithm DFLASH --speculative-draft-model-path {f} \\",
                  f"    --speculative-num-draft-tokens {k + 1}"]
        note = ["", "DFlash needs an attention backend with non-causal attention for the draft (see the engines' "
                "documentation for the flags of their current versions)."]
    else:
        sglang = [f"python -m sglang.launch_server --model-path {t} \\",
                  f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path {f} \\",
                  f"    --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"]
        note = ["", "Chain drafting (`--speculative-eagle-topk 1`) is what training simulated."]
    return vllm + ["SGLang:", "", "```bash", *sglang, "```", *note]
