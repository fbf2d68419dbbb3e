"""Hardening, second pass: values nothing can use are refused before any work, in one line naming the flag,
field or file, and nothing present before is changed (the file checksums are compared)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from vatspec.cli import main

CONVS = [{"id": f"c{k}", "messages": [{"role": "user", "content": f"Question {k}: say {w}."},
                                      {"role": "assistant", "content": f"{w} {w}, as you asked."}]}
         for k, w in enumerate(["one", "two", "three", "four", "five", "six"])]


def checksums(root):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def env(tmp_path, tiny_target_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**c, "id": f"h{k}"}) + "\n" for k, c in enumerate(CONVS[:2])))
    base = [f"target.path={tiny_target_dir}", f"data.train={data}", f"train.out_dir={tmp_path / 'run'}",
            "data.max_length=64", "drafter.draft_vocab_size=256", "train.steps=1"]
    return tmp_path, base, data, held


CASES = [
    # (name, extra train arguments (with {data}, {held}), message)
    ("held-out file equal to the training file", ["data.heldout={data}"], "shares 6 of 6 conversations with"),
    ("held-out prompts repeat training prompts", ["data.heldout={held}"], "shares 2 of 2 conversations with"),
    ("repeated target layers", ["drafter.target_layer_ids=[1,1,2]"], "drafter.target_layer_ids: [1, 1, 2] repeats"),
    ("text no tokenizer can encode", ["data.train={bad}"],
     "surrogate.jsonl:3: turn 0: content: text no tokenizer can encode ('\\ud800' at character 5: half of a UTF-16"),
]
SURROGATE = ('{"id": "s", "messages": [{"role": "user", "content": "bad \\ud800 here"}, '
             '{"role": "assistant", "content": "ok"}]}\n')


@pytest.mark.parametrize("name, extra, message", CASES, ids=[c[0] for c in CASES])
def test_train_refuses_before_any_work(env, capsys, name, extra, message):
    tmp_path, base, data, held = env
    bad = tmp_path / "surrogate.jsonl"  # line 3: a JSON escape of half a surrogate pair
    bad.write_text("".join(json.dumps(c) + "\n" for c in CONVS[:2]) + SURROGATE + "".join(
        json.dumps(c) + "\n" for c in CONVS[2:]))
    before = checksums(tmp_path)
    rc = main(["train", *base, *[e.format(data=data, held=held, bad=bad) for e in extra]])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("vatspec train: error:")]
    assert len(lines) == 1
    assert checksums(tmp_path) == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, message", [
    (["--k", "0"], "--k 0 drafts nothing"),
    (["--k", "9"], "--k 9: the DFlash draft 'd' fills at most 3 tokens a round"),
    (["--relative-to", "nobody"], "--relative-to 'nobody': no such method (have d, ar, hf_generate)"),
])
def test_eval_refuses_before_decoding(tmp_path, tiny_target_dir, capsys, flags, message):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    run = tmp_path / "run"
    assert main(["train", f"target.path={tiny_target_dir}", f"data.train={data}", f"train.out_dir={run}",
                 "data.max_length=64", "drafter=dflash", "drafter.block_size=4", "drafter.num_anchors=4",
                 "train.steps=1", "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "eval"
    rc = main(["eval", "--target", str(tiny_target_dir), "--draft", f"d={run}", "--bench", "gsm8k", "--num-prompts",
               "1", "--max-new-tokens", "4", "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not out.exists()  # nothing decoded, nothing written


def test_a_section_given_twice_in_yaml_is_refused(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  steps: 5\nloss:\n  kind: vat\ntrain:\n  seed: 3\n")
    assert main(["train", "--config", str(f), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert f"{f}: not valid YAML" in err and "'train' is given twice (line 5)" in err


def test_resume_and_init_from_together_are_refused(tmp_path, capsys):
    assert main(["train", "target.path=default", f"train.out_dir={tmp_path / 'r'}", "--resume", "--init-from",
                 str(tmp_path)]) == 2
    assert "--resume continues a run from its own checkpoint; --init-from starts a new run" in capsys.readouterr().err


def test_export_k_must_draft(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path), "--out", str(tmp_path / "o"), "--format", "speculators", "--k", "0"])
    assert "argument --k/--speculative-tokens: must be >= 1, got 0" in capsys.readouterr().err


def test_unencodable_text_is_skipped_under_skip_bad(env, capsys):
    tmp_path, base, data, held = env
    bad = tmp_path / "surrogate.jsonl"
    bad.write_text(SURROGATE + data.read_text())
    assert main(["train", *base, f"data.train={bad}", "data.skip_bad=true", "--no-progress"]) == 0
    stats = json.loads((tmp_path / "run" / "data_stats.json").read_text())
    assert "7 records, 1 bad skipped" in capsys.readouterr().out, stats


def test_resume_as_another_drafter_is_refused_in_one_line(env, capsys):
    """--resume-with-changes changes the steps, not the model: another drafter kind cannot load the weights."""
    tmp_path, base, data, held = env
    assert main(["train", *base, "--no-progress"]) == 0
    capsys.readouterr()
    before = checksums(tmp_path)
    rc = main(["train", *base, "drafter=dflash", "train.steps=2", "--resume-with-changes", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len([x for x in err.splitlines() if "error" in x]) == 1, err
    assert "step-000001's weights do not fit the drafter this config builds (drafter.kind 'eagle3' -> 'dflash'" in err
    assert "start a new run" in err
    assert checksums(tmp_path) == before


def test_default_eagle3_layers_are_distinct_on_a_shallow_target(env, capsys):
    """The reference formula (1, L//2 - 1, L - 4) repeats layer 2 on 6 layers; training takes the next one,
    and the draft exports (the engines capture each layer once)."""
    tmp_path, base, data, held = env
    assert main(["train", *base, "--no-progress"]) == 0
    saved = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/drafter.json")).read_text())
    assert saved["config"]["target_layer_ids"] == [1, 2, 3]
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "served")]) == 0


def _no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_a_full_disk_names_the_checkpoint_and_leaves_no_partial_files(env, capsys, monkeypatch):
    from safetensors import SafetensorError

    import vatspec.checkpoint as ckpt

    tmp_path, base, data, held = env
    real = ckpt.save_file

    def fill(tensors, path, *a, **k):  # the first file fits, the second meets a full disk
        if Path(path).name != "drafter.safetensors":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real(tensors, path, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", fill)
    rc = main(["train", *base, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert f"{tmp_path / 'run' / 'checkpoints' / 'step-000001'}: the checkpoint could not be written (I/O error: " \
           "No space left on device (os error 28)); its partial files are removed" in err
    assert not list((tmp_path / "run").rglob("*.tmp-*"))


def test_a_full_disk_names_the_cache_shard_and_the_export_folder(env, capsys, monkeypatch):
    import safetensors.torch

    import vatspec.export.write as write

    tmp_path, base, data, held = env
    target = base[0].split("=", 1)[1]
    monkeypatch.setattr(safetensors.torch, "save_file", _no_space)  # the cache writer imports it when it writes
    rc = main(["cache-features", str(data), "--target", target, "--out", str(tmp_path / "cache"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{tmp_path / 'cache' / 'shard-00000.safetensors'}: could not be written (No space left " \
                      "on device); the partial file is removed" in err, err
    assert not list((tmp_path / "cache").glob("*.tmp-*"))
    monkeypatch.undo()

    assert main(["train", *base, "--no-progress"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(write, "save_file", _no_space)
    out = tmp_path / "served"
    rc = main(["export", str(tmp_path / "run"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{out}: could not be written (No space left on device); nothing is kept" in err, err
    assert not out.exists() and not list(tmp_path.glob(".served.tmp-*"))


def test_export_errors_name_the_out_folder_not_a_temporary_one(env, capsys, monkeypatch):
    import vatspec.export.write as write
    from vatspec.export.formats import ExportError

    tmp_path, base, data, held = env
    assert main(["train", *base, "--no-progress"]) == 0
    capsys.readouterr()

    def invalid(path, *a, **k):
        raise ExportError(f"{path}: not a valid eagle3-hf export: fc.weight is torn")

    monkeypatch.setattr(write, "validate_export", invalid)
    out = tmp_path / "served"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {out}: not a valid eagle3-hf export" in err and ".tmp-" not in err, err


def test_regenerate_refuses_another_inputs_output_and_a_useless_max_length(env, capsys):
    tmp_path, base, data, held = env
    target = base[0].split("=", 1)[1]
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps(c) + "\n" for c in CONVS[:3]))
    other = tmp_path / "other.jsonl"  # the same ids, other prompts
    other.write_text("".join(json.dumps({**c, "messages": [{"role": "user", "content": f"Say {k}."}]}) + "\n"
                             for k, c in enumerate(CONVS)))
    out = tmp_path / "regen.jsonl"
    gen = ["--target", target, "--max-new-tokens", "3", "--out", str(out)]
    assert main(["regenerate", str(first), *gen]) == 0
    capsys.readouterr()
    before = checksums(tmp_path)
    assert main(["regenerate", str(other), *gen]) == 2
    err = capsys.readouterr().err
    assert f"{out}:1: conversation 'c2' was regenerated from other messages than {other}'s 'c2'" in err, err
    assert main(["regenerate", str(held), *gen]) == 2  # ids h0, h1: none of them written here
    assert f"{out}:1: conversation 'c2' is not in {held}" in capsys.readouterr().err
    assert checksums(tmp_path) == before
    assert main(["regenerate", str(data), *gen]) == 0  # the same input, extended: resumes
    assert "3 already done" in capsys.readouterr().out

    assert main(["regenerate", str(data), *gen[:-1], str(tmp_path / "short.jsonl"), "--max-length", "10"]) == 2
    err = capsys.readouterr().err
    assert "--max-length 10: every conversation's first prompt holds at least" in err, err
    assert not (tmp_path / "short.jsonl").exists()


def test_check_names_a_shape_the_config_does_not_give(env, capsys):
    tmp_path, base, data, held = env
    target = base[0].split("=", 1)[1]
    assert main(["train", *base, "--no-progress"]) == 0
    out = tmp_path / "served"
    assert main(["export", str(tmp_path / "run"), "--out", str(out), "--format", "speculators"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg["transformer_layer_config"]["intermediate_size"] *= 2
    (out / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["check", str(out), "--target", target, "--no-measure"]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if "FAIL  load" in x)
    assert "the weights do not fit the speculators config.json: layers.0.mlp.gate_proj.weight is [64, 32], " \
           "the config makes it [128, 32]" in line


def test_a_run_folder_copied_without_its_dotfiles_resumes(env, capsys):
    """A run folder with checkpoints is train's even without its owner file (rsync --exclude '.*')."""
    tmp_path, base, data, held = env
    assert main(["train", *base, "--no-progress"]) == 0
    (tmp_path / "run" / ".vatspec-owner").unlink()
    assert main(["train", *base, "train.steps=2", "--resume-with-changes", "--no-progress"]) == 0, \
        capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (tmp_path / "run" / ".vatspec-owner").is_file()
