"""The command-line surface a new user touches: one meaning per dtype flag, defaults in every ``--help``,
``--config NAME`` for installed configs, a ``--print-config`` that sizes the run, the trackers' own
environment variables, and regeneration defaults sized for a server."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import safetensors

from vatspec.cli import all_commands, command_module, main

DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}
# every dtype flag: (command, flag, the arguments the command requires besides)
DTYPE_FLAGS = [("regenerate", "--dtype", ["in.jsonl", "--out", "o.jsonl", "--target", "default"]),
               ("eval", "--dtype", ["--target", "default"]),
               ("check", "--dtype", ["served", "--target", "default"]),
               ("acceptance", "--dtype", ["a=runs/a", "--answers", "a.jsonl"]),
               ("cache-features", "--dtype", []),
               ("cache-features", "--feature-dtype", []),
               ("export", "--weights-dtype", ["run", "--out", "served"])]


def parser_of(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"vatspec {name}")
    command_module(name).configure(parser)
    return parser


def help_of(name: str, capsys) -> str:
    """``vatspec NAME --help`` as printed, one line per option (argparse's wrapping undone)."""
    with pytest.raises(SystemExit):
        main([name, "--help"])
    return " ".join(capsys.readouterr().out.split())


# ----------------------------------------------------------------------------- 1. dtype flags
@pytest.mark.parametrize("command, flag, required", DTYPE_FLAGS, ids=[f"{c} {f}" for c, f, _ in DTYPE_FLAGS])
def test_every_dtype_flag_takes_every_name(command, flag, required):
    parser = parser_of(command)
    dest = flag.lstrip("-").replace("-", "_")
    for name, canonical in DTYPE_NAMES.items():
        assert getattr(parser.parse_args([*required, flag, name]), dest) == canonical, name


def test_dtype_is_the_target_s_in_every_command_and_other_dtypes_have_their_own_flag(capsys):
    with_dtype = {name for name in all_commands() if "--dtype" in parser_of(name)._option_string_actions}
    # those loading a target (serve-bench: in the engines it launches)
    assert with_dtype == {"regenerate", "eval", "check", "acceptance", "cache-features", "serve-bench"}
    for name in sorted(with_dtype):
        assert "--dtype DTYPE the target model's dtype: bf16, fp16 or fp32" in help_of(name, capsys), name
    assert "--target-dtype" not in parser_of("cache-features")._option_string_actions
    assert "--feature-dtype DTYPE the features' storage dtype" in help_of("cache-features", capsys)
    assert "--weights-dtype DTYPE the dtype of the written weights" in help_of("export", capsys)


def test_cache_features_runs_the_target_in_dtype_and_stores_in_feature_dtype(tmp_path, tiny_target_dir, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{k}", "messages": [
        {"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w} {w}."}]}) + "\n"
        for k, w in enumerate(["one", "two", "three"])))
    out = tmp_path / "cache"
    assert main(["cache-features", str(data), "--out", str(out), "--target", str(tiny_target_dir), "--layers", "1",
                 "--max-length", "32", "--device", "cpu", "--dtype", "bf16", "--feature-dtype", "fp16",
                 "--precision", "fp32", "--no-progress"]) == 0
    assert "on cpu, bfloat16" in capsys.readouterr().err  # the target, as loaded
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "float16"
    shard = next(out.glob("**/*.safetensors"))
    with safetensors.safe_open(shard, "pt") as f:
        names = [k for k in f.keys() if k != "input_ids" and k != "loss_mask"]  # noqa: SIM118 (no __iter__)
        assert names and {f.get_slice(k).get_dtype() for k in names} == {"F16"}


def test_export_writes_weights_in_weights_dtype(tmp_path, tiny_target_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{k}", "messages": [
        {"role": "user", "content": f"Question {k}: say {w}."}, {"role": "assistant", "content": f"{w}, as asked."}]})
        + "\n" for k, w in enumerate(["one", "two", "three", "four", "five", "six"])))
    run = tmp_path / "run"
    assert main(["train", f"target.path={tiny_target_dir}", f"data.train={data}", f"train.out_dir={run}",
                 "data.max_length=64", "drafter.draft_vocab_size=256", "train.steps=1", "--no-progress"]) == 0
    for name, code in (("bf16", "BF16"), ("fp16", "F16")):
        served = tmp_path / f"served-{name}"
        assert main(["export", str(run), "--out", str(served), "--weights-dtype", name]) == 0
        with safetensors.safe_open(next(served.glob("*.safetensors")), "pt") as f:
            names = [k for k in f.keys() if "weight" in k]  # noqa: SIM118 (no __iter__)
            assert names and {f.get_slice(k).get_dtype() for k in names} == {code}, name


# ----------------------------------------------------------------------------- 2. help and errors
@pytest.mark.parametrize("name", list(all_commands()))
def test_every_help_shows_the_defaults_once(name, capsys):
    text = help_of(name, capsys)
    for action in parser_of(name)._actions:
        if action.default in (None, False, "", (), []) or action.nargs == 0 or action.dest == "help":
            continue
        shown = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
        assert f"(default: {shown})" in text, (name, action.option_strings)
    assert "(default" not in text.replace("(default: ", ""), name  # no hand-written "(default ...)" beside it


def test_help_shows_the_default_of_a_flag_with_no_help_text(capsys):
    assert "--device DEVICE (default: auto)" in help_of("eval", capsys)
    assert "--max-new-tokens MAX_NEW_TOKENS (default: 512)" in help_of("regenerate", capsys)
    assert "--shard-size SHARD_SIZE bytes per shard (KiB, MiB, GiB, ...) (default: 1GiB)" in help_of(
        "cache-features", capsys)


def test_ablate_help_is_ablate_s(capsys):
    text = help_of("ablate", capsys)
    assert "the paper's ablation on one drafter" in text
    assert "--out OUT report folder (default: reports/ablate)" in text
    assert "--drafter {eagle3,dflash} the drafter trained in every arm (default: dflash)" in text
    assert "unset: ablation, or objectives with --arms" in text
    for demo_only in ("--redecode", "--seeds", "demo-quick; CI runs it", "reports/demo"):
        assert demo_only not in text, demo_only
    demo = help_of("demo", capsys)
    assert "--out OUT report folder (default: reports/demo)" in demo and "--redecode" in demo


def test_export_of_a_path_without_a_draft_names_the_cause(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (f"vatspec export: error: {tmp_path / 'nothing'} does not exist: expected a "
                                       "checkpoint, a run folder or an exported draft\n")
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'empty'} holds no draft" in err and "--target" not in err
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "config.json").write_text("{}")
    assert main(["export", str(tmp_path / "served"), "--out", str(tmp_path / "o")]) == 2
    assert "is an exported draft, not a training run: pass --target" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 3. --config NAME
def test_config_takes_an_installed_name(tmp_path, monkeypatch, capsys):
    from vatspec.config import installed_configs

    monkeypatch.chdir(tmp_path)
    installed = installed_configs()  # vatspec_recipes registers its configs/ under vatspec.configs
    assert installed["qwen3-8b-eagle3-vat"].parent.name == "configs"
    for name in ("qwen3-8b-eagle3-vat", "qwen3-8b-eagle3-vat.yaml"):
        assert main(["train", "--config", name, "--print-config"]) == 0
        assert re.search(rf"^target\.path +/models/Qwen3-8B +{installed['qwen3-8b-eagle3-vat']}\n",
                         capsys.readouterr().out, re.M)
    (tmp_path / "qwen3-8b-eagle3-vat.yaml").write_text("train:\n  steps: 3\n")  # a file of that name wins
    assert main(["train", "--config", "qwen3-8b-eagle3-vat.yaml", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\ntrain\.steps +3 +qwen3-8b-eagle3-vat\.yaml\n", out) and "/models/Qwen3-8B" not in out


def test_an_unknown_config_name_lists_the_installed_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "qwen3-8b-eagle", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vatspec train: error: config qwen3-8b-eagle does not exist: it is neither a file nor an "
                          "installed config (installed: gpt-oss-20b-eagle3, ")
    assert "qwen3-8b-eagle3-vat" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- 4. --print-config sizes the run
def print_config(argv: list[str], capsys) -> tuple[dict, dict]:
    """``vatspec train ARGV --print-config`` -> ({field: value}, {size row: value})."""
    assert main(["train", *argv, "--print-config"]) == 0
    blocks = capsys.readouterr().out.split("\n\n")
    fields, sizes = ({row[0]: row[1] for row in (re.split(r"\s{2,}", line, maxsplit=2) for line in block.splitlines())}
                     for block in blocks)
    return fields, sizes


def conversations(n: int) -> str:
    return "".join(json.dumps({"id": f"c{k}", "messages": [
        {"role": "user", "content": f"Question {k}: say {k}."}, {"role": "assistant", "content": f"{k}, as asked."}]})
        + "\n" for k in range(n))


def test_print_config_shows_only_the_drafter_kind_s_fields(capsys):
    eagle3, _ = print_config([], capsys)
    dflash, _ = print_config(["drafter=dflash"], capsys)
    assert {"drafter.ttt_steps", "drafter.draft_vocab_size", "drafter.init_lm_head"} <= set(eagle3)
    assert not {k for k in eagle3 if k in ("drafter.block_size", "drafter.num_anchors", "drafter.num_layers",
                                            "drafter.mask_token_id")}
    assert {"drafter.block_size", "drafter.num_anchors", "drafter.num_layers", "drafter.mask_token_id"} <= set(dflash)
    assert not {k for k in dflash if k in ("drafter.ttt_steps", "drafter.draft_vocab_size", "drafter.init_lm_head")}


def test_print_config_sizes_a_run_on_several_ranks(tmp_path, monkeypatch, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(conversations(43))
    monkeypatch.setenv("WORLD_SIZE", "4")
    _, sizes = print_config([f"data.train={data}", "data.batch_size=2", "optim.grad_accum=2", "train.epochs=3",
                             "optim.warmup_ratio=0.25"], capsys)
    # 43 conversations, 2 held out (5%); 41 / 4 ranks = 10 each, in 5 batches of 2: 2 steps of 2 batches an epoch
    assert sizes == {"world size": "4", "global batch": "16", "conversations": "~43", "steps per epoch": "~2",
                     "total steps": "~6", "warm-up steps": "~2"}


def test_print_config_counts_the_steps_training_takes(tmp_path, tiny_target_dir, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(conversations(9))
    run = tmp_path / "run"
    argv = [f"target.path={tiny_target_dir}", f"data.train={data}", f"train.out_dir={run}", "data.max_length=64",
            "drafter.draft_vocab_size=256", "data.batch_size=2", "train.epochs=2"]
    _, sizes = print_config(argv, capsys)
    assert main(["train", *argv, "--no-progress"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sizes["total steps"] == f"~{steps[-1]}" == "~8"  # 8 of the 9 train, in 4 batches, for 2 epochs


def test_print_config_gives_the_feature_cache_s_disk(tmp_path, tiny_target_dir, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(conversations(6))
    cache = tmp_path / "cache"
    argv = [f"target.path={tiny_target_dir}", f"data.train={data}", f"data.features={cache}", "data.max_length=64"]
    _, sizes = print_config(argv, capsys)
    # not written yet: at most 6 conversations x 64 tokens x (4 + 1 + (3 layers + 1) x 32 x 2) B = 100,224 B
    assert sizes["feature cache"] == "<= 97.9 KiB"
    assert main(["cache-features", str(data), "--out", str(cache), "--target", str(tiny_target_dir),
                 "--drafter", "eagle3", "--max-length", "64", "--device", "cpu", "--no-progress"]) == 0
    capsys.readouterr()
    _, sizes = print_config(argv, capsys)
    shards = sum(p.stat().st_size for p in cache.glob("**/*.safetensors"))
    assert sizes["feature cache"] == f"{shards / 1024:.1f} KiB" and sizes["conversations"] == "6"  # the rows


# ----------------------------------------------------------------------------- 6. regenerate's defaults
def test_regenerate_defaults_a_server_s_concurrency_and_a_small_in_process_batch(capsys):
    args = parser_of("regenerate").parse_args(["in.jsonl", "--out", "o.jsonl", "--target", "default"])
    assert args.concurrency == 64 and args.batch_size == 8
    text = help_of("regenerate", capsys)
    assert "a GPU server (vLLM, SGLang) batches all it holds into one forward, so this many keep it busy; a CPU " \
           "server (llama.cpp, transformers serve) wants 1-4" in text and "(default: 64)" in text


def test_regenerate_keeps_a_prompt_that_fits_max_length(tmp_path, tiny_target_dir, capsys):
    """--max-prompt-tokens follows --max-length: a 2,500-token prompt fits a 4,096-token training length and is
    answered; with no training length given, the 2,048-token limit drops it."""
    data = tmp_path / "in.jsonl"
    long = {"id": "long", "messages": [{"role": "user", "content": "word " * 2500}]}
    short = {"id": "short", "messages": [{"role": "user", "content": "Say one."}]}
    data.write_text(json.dumps(long) + "\n" + json.dumps(short) + "\n")
    common = [str(data), "--target", str(tiny_target_dir), "--max-new-tokens", "2", "--device", "cpu"]
    for extra, name, kept in ((["--max-length", "4096"], "fits.jsonl", {"long", "short"}), ([], "no.jsonl", {"short"})):
        assert main(["regenerate", *common, "--out", str(tmp_path / name), *extra]) == 0
        written = {json.loads(line)["id"] for line in (tmp_path / name).read_text().splitlines()}
        assert written == kept, extra
        assert f"{2 - len(kept)} too long" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["inf", "nan", "1e999"])
def test_a_number_flag_takes_only_finite_numbers(value, capsys):
    """`--timeout inf` reached the socket as an internal OverflowError; every number flag refuses it on parsing."""
    with pytest.raises(SystemExit) as e:
        main(["regenerate", "x.jsonl", "--out", "y.jsonl", "--target", "default", "--timeout", value])
    assert e.value.code == 2 and f"--timeout: expected a finite number, got {value}" in capsys.readouterr().err
