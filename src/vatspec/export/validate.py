"""Validation: an export folder checked against its format (exact keys, tensors, dtypes, vocabulary
maps, accept head) and, given a target, against that target."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from vatspec.drafters.served import LLAMA_LAYER_KEYS, ConfigCheck, ServedFormat
from vatspec.export.card import CARD
from vatspec.export.formats import CONFIG, HEAD_DIR, WEIGHTS, ExportError, detect, read_json
from vatspec.export.read import load_accept_head
from vatspec.export.record import RECORD
from vatspec.target import DTYPES


def validate_export(path: str | Path, target=None) -> str:
    """Check an export folder against its format; return the format or raise ``ExportError`` listing
    every problem: the exact config fields and their values, the exact tensor names, shapes and dtypes,
    the draft vocabulary maps, the accept head, and (with ``target``) the fit to the target."""
    path = Path(path)
    src = path / CONFIG
    cfg = read_json(src)
    fmt = detect(cfg, str(src))
    bad: list[str] = []
    _check_config(fmt, cfg, bad)
    extra_files = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    known = (CONFIG, WEIGHTS, HEAD_DIR, RECORD, CARD) + fmt.extra_files
    extra_files = [n for n in extra_files if n not in known]
    if extra_files:
        bad.append(f"unexpected files {extra_files} (an export holds {', '.join(known)})")
    if not bad:
        fmt.check_files(path, cfg, bad)
    if not bad:
        _check_weights(fmt, cfg, path / WEIGHTS, bad)
    if not bad and target is not None:
        _check_fit(fmt, cfg, path / WEIGHTS, target, bad)
    if (path / HEAD_DIR).exists():
        try:
            head, _ = load_accept_head(path)
            if head.proj.in_features != fmt.layer_config(cfg).get("hidden_size"):
                bad.append(f"{HEAD_DIR}: hidden_size {head.proj.in_features} differs from the draft's")
        except ExportError as e:
            bad.append(str(e))
    if bad:
        raise ExportError(f"{path}: not a valid {fmt.name} export:\n  - " + "\n  - ".join(bad))
    return fmt.name


def _check_config(fmt: ServedFormat, cfg: dict, bad: list[str]) -> None:
    """The fields every format's decoder layer has, then the format's own."""
    check = ConfigCheck(bad, CONFIG)
    if not check.keys(cfg, fmt.config_keys, "top level"):
        return
    lc = cfg[fmt.layer_key] if fmt.layer_key else cfg
    if fmt.layer_key and not check.keys(lc, LLAMA_LAYER_KEYS, fmt.layer_key):
        return
    want = check.want
    want(cfg["torch_dtype"] in DTYPES, f"torch_dtype {cfg['torch_dtype']!r} not in {sorted(DTYPES)}")
    want(lc["hidden_act"] == "silu", f"hidden_act {lc['hidden_act']!r}: the engines run SiLU only")
    want(lc["attention_bias"] is False and lc.get("mlp_bias", False) is False,
         "attention_bias / mlp_bias must be false")
    want(lc["tie_word_embeddings"] is False,
         "tie_word_embeddings must be false (SGLang would use the embedding as lm_head)")
    fmt.check_config(cfg, check)


def _check_weights(fmt: ServedFormat, cfg: dict, file: Path, bad: list[str]) -> None:
    if not file.is_file():
        bad.append(f"{WEIGHTS} is missing")
        return
    want = fmt.expected_weights(cfg)
    fdtype = DTYPES[cfg["torch_dtype"]]
    with safe_open(str(file), framework="pt") as f:
        have = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing or extra:
            bad.append(f"{WEIGHTS}: missing {missing}, unexpected {extra}")
        for k in sorted(set(want) & set(have)):
            shape, dt = have[k]
            dt_want = fmt.tensor_dtypes.get(k, _ST_DTYPE[fdtype])
            if shape != want[k] or dt != dt_want:
                bad.append(f"{WEIGHTS}: {k} is {dt}{list(shape)}, expected {dt_want}{list(want[k])}")
        if not bad:
            fmt.check_weights(f.get_tensor, bad)


_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _check_fit(fmt: ServedFormat, cfg: dict, file: Path, target, bad: list[str]) -> None:
    for name, (have, want) in fmt.sizes(cfg, target).items():
        if have != want:
            bad.append(f"{CONFIG}: {name}={have} does not match the target ({want})")
    ids, _ = fmt.layer_ids(cfg, target.num_layers)
    if max(ids) >= target.num_layers:
        bad.append(f"{CONFIG}: layer ids {ids} (output of layer i) out of range for a {target.num_layers}-layer target")
    fmt.check_fit(cfg, file, target, bad)
