"""The offline feature cache on a tiny random Llama: what it stores, training from it equals online
training, a killed write resumes, and every kind of bad cache is refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import COUNT_CONVS, tiny_llama
from vatspec.config import load_config
from vatspec.features import FeatureCache, FeatureCacheError, finalize_cache, plan_shards, write_cache
from vatspec.target import Target
from vatspec.train import train_arms

pytestmark = pytest.mark.usefixtures("one_thread")

CONVS = COUNT_CONVS
LAYERS = [1, 2, 3]  # covers both drafters on a 6-layer target: eagle3 (1, 2, 2), dflash [3]
# Online and cached runs see the same batches; the features differ only by the float rounding of
# a forward over another batch composition (the cache pads each shard's batches differently).
LOSS_RTOL = 1e-5
BF16_LOSS_RTOL = 1e-4  # the same under bfloat16 products: ~2e-5 on these losses


@pytest.fixture(scope="module")
def tok(default_target_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_target_path)


def _save_tiny(path: Path, tok, seed: int = 0) -> Path:
    tiny_llama(vocab_size=len(tok), hidden_size=32, layers=6, seed=seed).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok):
    return _save_tiny(tmp_path_factory.mktemp("tiny_target"), tok)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    return path


@pytest.fixture(scope="module")
def target(tiny_dir):
    return Target.from_pretrained(tiny_dir)


def _write(target, data_file, out, **kw):
    from vatspec.data import load_conversations

    kw = {"layer_ids": LAYERS, "dtype": "float32", "max_length": 64, "batch_size": 4, "shard_size": 70_000,
          "source": str(data_file), "progress": False, **kw}
    return write_cache(target, load_conversations(data_file), out, **kw)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, target, data_file):
    out = tmp_path_factory.mktemp("cache") / "f32"
    _write(target, data_file, out)
    return out


def _cfg(tiny_dir, out_dir, *extra, data=None, features=None):
    src = [f"data.train={data}"] if data else []
    src += [f"data.features={features}"] if features else []
    return load_config(None, [
        f"target.path={tiny_dir}", *src, f"train.out_dir={out_dir}", "target.device=cpu",
        "data.batch_size=2", "data.max_length=64", "data.heldout_max=4", "drafter.draft_vocab_size=256",
        "drafter.ttt_steps=3", "drafter.block_size=4", "drafter.num_anchors=4", "train.steps=3",
        "train.eval_every=2", "optim.lr=1e-3", *extra,
    ])


def _records(run_dir: Path) -> list[dict]:
    from vatspec.train.checkpointer import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


# ----------------------------------------------------------------------------- layout
def test_plan_shards_packs_whole_conversations_in_order():
    # 10 bytes a token, 100 bytes a shard: lengths 4 5 | 3 3 3 | 20 (alone, over the size) | 2
    assert plan_shards([4, 5, 3, 3, 3, 20, 2], 10, 100) == [(0, 2), (2, 5), (5, 6), (6, 7)]
    assert plan_shards([1, 1], 10, 1000) == [(0, 2)]


def test_cache_stores_layer_outputs_and_final_hidden(cache_dir, target):
    """Layer id i = output of decoder layer i = HF hidden_states[i + 1]; hidden = the lm_head's input.
    The reference is HF's own forward, row by row, not vatspec's capture hooks."""
    cache = FeatureCache(cache_dir)
    assert cache.layer_ids == LAYERS and len(cache) == len(CONVS) and len(cache.manifest["shards"]) > 2
    for row in (0, 11, 23):
        ex = cache.examples([row])[0]
        ids = torch.tensor([ex.input_ids])
        with torch.no_grad():
            out = target.model(ids, output_hidden_states=True)
        feats, hidden = cache.read(row, LAYERS)
        for c, i in enumerate(LAYERS):
            torch.testing.assert_close(feats[:, c * 32 : (c + 1) * 32], out.hidden_states[i + 1][0])
        torch.testing.assert_close(hidden @ target.lm_head.weight.T, out.logits[0], rtol=1e-4, atol=1e-4)
        assert ex.id == f"c{row}" and any(ex.loss_mask)


# ----------------------------------------------------------------------------- equality
ARMS = [("eagle3", "eagle3"), ("eagle3", "vat"), ("eagle3", "dflash"),
        ("dflash", "dflash"), ("dflash", "vat"), ("dflash", "eagle3")]


def _arm_cfgs(tiny_dir, root: Path, **src):
    return [_cfg(tiny_dir, root / f"{k}-{loss}", f"drafter.kind={k}", f"loss.kind={loss}",
                 *(["loss.gamma=2.0"] if (k, loss) == ("eagle3", "dflash") else []), **src)
            for k, loss in ARMS]


def test_training_from_the_cache_equals_online_training(tiny_dir, data_file, cache_dir, tmp_path, monkeypatch):
    """Both drafters, every loss kind, lockstep arms: the same train losses and held-out metrics, and
    no target forward in the cached run (only Target.logits, the lm_head)."""
    train_arms(_arm_cfgs(tiny_dir, tmp_path / "online", data=data_file), progress=False)

    def no_forward(*a, **k):
        raise AssertionError("the target ran a forward pass while training from the cache")

    monkeypatch.setattr(Target, "forward", no_forward)
    monkeypatch.setattr(Target, "__call__", no_forward)
    train_arms(_arm_cfgs(tiny_dir, tmp_path / "cached", features=cache_dir), progress=False)
    for k, loss in ARMS:
        a, b = _records(tmp_path / "online" / f"{k}-{loss}"), _records(tmp_path / "cached" / f"{k}-{loss}")
        assert len(a) == len(b) == 3
        assert "eval/tau_sim" in a[-1] and "eval/loss" in a[-1]
        for ra, rb in zip(a, b):
            keys = [key for key in ra if key.startswith(("loss", "grad_norm", "train/", "eval/"))]
            assert set(keys) == {key for key in rb if key.startswith(("loss", "grad_norm", "train/", "eval/"))}
            want = pytest.approx(_flat(ra, keys), rel=LOSS_RTOL, abs=1e-6, nan_ok=True)
            assert _flat(rb, keys) == want, (k, loss, ra["step"])


def _flat(record: dict, keys: list[str]) -> list[float]:
    return [float(x) for key in keys for x in (record[key] if isinstance(record[key], list) else [record[key]])]


def test_data_train_beside_the_cache_must_be_its_data(tiny_dir, data_file, cache_dir, tmp_path, capsys):
    from vatspec.cli import main

    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(c) + "\n" for c in CONVS[:-1]))
    base = [f"target.path={tiny_dir}", f"data.features={cache_dir}", "data.max_length=64", "train.steps=1",
            "drafter.draft_vocab_size=256", "target.device=cpu"]
    assert main(["train", *base, f"data.train={other}", f"train.out_dir={tmp_path / 'r'}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "not the conversations the cache was built from" in err and not (tmp_path / "r").exists()
    assert main(["train", *base, f"data.train={data_file}", f"train.out_dir={tmp_path / 'ok'}", "--no-progress"]) == 0


# ----------------------------------------------------------------------------- resume
class Killed(Exception):
    pass


def _shas(root: Path) -> list[str]:
    return [s["sha256"] for s in json.loads((root / "manifest.json").read_text())["shards"]]


def test_a_killed_write_resumes_and_redoes_a_torn_shard(target, data_file, cache_dir, tmp_path):
    out = tmp_path / "c"

    def kill_after_2(k):
        if k == 2:
            raise Killed

    with pytest.raises(Killed):
        _write(target, data_file, out, on_shard=kill_after_2)
    with pytest.raises(FeatureCacheError, match="incomplete"):
        FeatureCache(out)
    done = {k: os.stat(out / f"shard-0000{k}.safetensors") for k in range(3)}
    with open(out / "shard-00001.safetensors", "r+b") as f:  # torn: cut short after it was written
        f.truncate(1000)
    (out / "shard-00003.safetensors.tmp-99999").write_bytes(b"half a shard")  # killed mid-write
    man = _write(target, data_file, out)
    assert man["complete"] and man["written"]["shards"] == len(man["shards"]) - 2  # 0 and 2 kept
    for k in (0, 2):
        st = os.stat(out / f"shard-0000{k}.safetensors")
        assert (st.st_ino, st.st_mtime_ns) == (done[k].st_ino, done[k].st_mtime_ns)
    assert not list(out.glob("*.tmp-*")) and not list(out.glob("*.json.tmp*")) and not list(out.glob("shard-*.json"))
    assert _shas(out) == _shas(cache_dir)  # the same bytes as an uninterrupted write
    again = _write(target, data_file, out)  # complete: nothing to do
    assert again["written"]["shards"] == 0


def test_a_complete_cache_missing_a_shard_is_repaired(target, data_file, cache_dir, tmp_path):
    import shutil

    out = tmp_path / "c"
    shutil.copytree(cache_dir, out)
    (out / "shard-00002.safetensors").unlink()
    man = _write(target, data_file, out)
    assert man["written"]["shards"] == 1 and _shas(out) == _shas(cache_dir)


def test_rank_parts_equal_one_process(target, data_file, cache_dir, tmp_path):
    """torchrun: rank r writes shards k % world == r; one process finalizes."""
    out = tmp_path / "c"
    for rank in (1, 0):
        _write(target, data_file, out, rank=rank, world=2, finalize=False)
    assert finalize_cache(out)["complete"] and _shas(out) == _shas(cache_dir)
    assert (out / "index.jsonl").read_bytes() == (cache_dir / "index.jsonl").read_bytes()


def test_a_cache_with_other_settings_is_not_overwritten(target, data_file, cache_dir, tmp_path):
    import shutil

    out = tmp_path / "c"
    shutil.copytree(cache_dir, out)
    before = (out / "manifest.json").read_text()
    with pytest.raises(FeatureCacheError, match="dtype differs"):
        _write(target, data_file, out, dtype="bfloat16")
    with pytest.raises(FeatureCacheError, match="layer_ids differs"):
        _write(target, data_file, out, layer_ids=[1])
    assert (out / "manifest.json").read_text() == before


# ----------------------------------------------------------------------------- bad caches
def _rewrite_shard(root: Path, k: int, edit) -> None:
    """Edit shard k's tensors and record the new file in the manifest, as a writer that did not
    check its values would: the checksums then agree, and only the content check can catch it."""
    from safetensors.torch import load_file, save_file

    from vatspec.features.format import file_sha256

    path = root / f"shard-{k:05d}.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    man = json.loads((root / "manifest.json").read_text())
    man["shards"][k].update(bytes=path.stat().st_size, sha256=file_sha256(path))
    (root / "manifest.json").write_text(json.dumps(man))


def _nan_row(t):
    t["layer.2"][5, 3] = float("nan")


def _edit_manifest(**fields):
    def edit(root: Path):
        man = json.loads((root / "manifest.json").read_text())
        man.update(fields)
        (root / "manifest.json").write_text(json.dumps(man))

    return edit


@pytest.mark.parametrize("damage, extra, message", [
    (_edit_manifest(max_length=128), [], "max_length is 128 in the cache but data.max_length=64"),
    (_edit_manifest(chat_template_sha256="0" * 64), [], "chat_template_sha256 differs"),
    (_edit_manifest(complete=False), [], "the cache is incomplete"),
    (None, ["drafter.target_layer_ids=[1,4]"], "do not cover layers [4] of the eagle3 drafter"),
    (lambda r: (r / "shard-00001.safetensors").unlink(), [], "shard-00001.safetensors is missing"),
    (lambda r: os.truncate(r / "shard-00001.safetensors", 5000), [], "is 5000 bytes, the manifest records"),
    (lambda r: _rewrite_shard(r, 0, _nan_row), [], "layer.2 of conversation 'c0' (index row 0, token 5) is not finite"),
    (lambda r: (r / "index.jsonl").write_text((r / "index.jsonl").read_text().replace('"c3"', '"c33"')), [],
     "index.jsonl: sha256 differs"),
])
def test_train_refuses_a_bad_cache_in_one_line(tiny_dir, cache_dir, tmp_path, capsys, damage, extra, message):
    import shutil

    from vatspec.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(cache_dir, bad)
    if damage is not None:
        damage(bad)
    rc = main(["train", f"target.path={tiny_dir}", f"data.features={bad}", "data.max_length=64",
               "drafter.draft_vocab_size=256", "target.device=cpu", "train.steps=1", *extra,
               f"train.out_dir={tmp_path / 'r'}", "--no-progress"])
    err = _error_lines(capsys.readouterr().err)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"vatspec train: error: data.features={bad}: ") and message in err[0], err
    assert not (tmp_path / "r").exists()  # no run folder: nothing was trained on a partial cache


def _error_lines(err: str) -> list[str]:
    """What vatspec printed on stderr (transformers' progress bars of loading a target left out); no traceback."""
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("vatspec")]


def test_train_refuses_a_cache_of_another_target(tiny_dir, cache_dir, tmp_path, tok, capsys):
    from vatspec.cli import main

    other = _save_tiny(tmp_path / "other_target", tok, seed=1)
    rc = main(["train", f"target.path={other}", f"data.features={cache_dir}", "data.max_length=64",
               "target.device=cpu", f"train.out_dir={tmp_path / 'r'}", "--no-progress"])
    err = _error_lines(capsys.readouterr().err)
    assert rc == 2 and len(err) == 1, err
    assert "target.weights_sha256 is" in err[0] and "the cache was built for another target" in err[0]
    assert not (tmp_path / "r").exists()


def test_a_shard_changed_after_it_was_written_fails_its_checksum(cache_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(cache_dir, bad)
    path = bad / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte: same size, valid header
    path.write_bytes(bytes(data))
    cache = FeatureCache(bad)  # sizes fine
    with pytest.raises(FeatureCacheError, match="shard-00001.safetensors: sha256 differs from the manifest"):
        cache.read(cache.manifest["shards"][1]["rows"][0], LAYERS)  # no read of an unverified shard


# ----------------------------------------------------------------------------- command line
def test_cli_writes_validates_and_trains(tiny_dir, data_file, tmp_path, capsys):
    """bfloat16 storage computed under bf16 autocast, both drafters' default layers, several shards;
    --validate passes (its fresh forward under autocast too); a damaged copy is reported line by line;
    training from the bfloat16 cache runs."""
    import shutil

    from vatspec.cli import main

    out = tmp_path / "c"
    rc = main(["cache-features", str(data_file), "--out", str(out), "--target", str(tiny_dir), "--drafter", "eagle3",
               "--drafter", "dflash", "--max-length", "64", "--shard-size", "16KiB", "--batch-size", "3",
               "--device", "cpu", "--precision", "bf16", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and "24 conversations" in text and "layers [1, 2, 3], bfloat16 computed in bf16" in text, text
    man = json.loads((out / "manifest.json").read_text())
    assert man["layer_ids"] == [1, 2, 3] and man["dtype"] == "bfloat16" and len(man["shards"]) > 2
    assert man["precision"] == "bf16"
    assert man["target"]["path"] == str(tiny_dir) and man["source"]["path"] == str(data_file)

    assert main(["cache-features", "--validate", str(out), "--sample", "3"]) == 0
    text = capsys.readouterr().out
    assert "3 rows match a fresh forward" in text and text.strip().endswith("ok"), text

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    os.truncate(bad / "shard-00001.safetensors", 100)
    (bad / "shard-00002.safetensors").unlink()
    assert main(["cache-features", "--validate", str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any("shard-00001.safetensors is 100 bytes" in x for x in lines)
    assert any("shard-00002.safetensors is missing" in x for x in lines)
    assert lines[-1] == "2 problem(s)"

    args = [f"target.path={tiny_dir}", f"data.features={out}", "data.max_length=64", "data.batch_size=2",
            "drafter.draft_vocab_size=256", "drafter=dflash", "drafter.block_size=4", "drafter.num_anchors=4",
            "loss=vat", "train.steps=1", "target.device=cpu", f"train.out_dir={tmp_path / 'r'}", "--no-progress"]
    assert main(["train", *args]) == 2  # a bf16 cache, an fp32 run (auto on a CPU): the features would differ
    assert "the cache's target pass ran in bf16, the run trains in train.precision=fp32" in capsys.readouterr().err
    assert main(["train", *args, "train.precision=bf16"]) == 0
    assert "held-out: tau_sim=" in capsys.readouterr().out


def test_validate_catches_a_wrong_layer(tiny_dir, target, data_file, cache_dir, tmp_path):
    """A cache whose layer.2 holds layer 3's outputs (a layer-id mix-up) fails the fresh-forward sample."""
    import shutil

    from vatspec.features.validate import validate_cache

    bad = tmp_path / "bad"
    shutil.copytree(cache_dir, bad)
    for k in range(len(json.loads((bad / "manifest.json").read_text())["shards"])):
        _rewrite_shard(bad, k, lambda t: t.__setitem__("layer.2", t["layer.3"].clone()))
    rep = validate_cache(bad, target, sample=2)
    assert not rep.ok and all("layer.2 differs from a fresh target forward" in p for p in rep.problems), rep.problems
    assert validate_cache(cache_dir, target, sample=2).ok


def test_the_template_is_passed_not_installed(target, data_file, tmp_path):
    """The chat template reaches the cache as an argument: its arguments are recorded, the run is checked against
    the template it passes (not one left on the target), and --validate asks the cache's own settings."""
    from vatspec.data.chat import ChatTemplate
    from vatspec.features import FeatureCache, FeatureCacheError
    from vatspec.features.validate import validate_cache

    lang = ChatTemplate(kwargs={"lang": "fr"})
    out = tmp_path / "kw"
    man = _write(target, data_file, out, template=lang)
    assert man["chat_template_kwargs"] == {"lang": "fr"} and not hasattr(target, "chat")
    cache = FeatureCache(out)
    cache.check_run(target, {"a drafter": LAYERS}, 64, lang)
    with pytest.raises(FeatureCacheError, match=r"chat_template_kwargs is lang=fr in the cache but \(none\)"):
        cache.check_run(target, {"a drafter": LAYERS}, 64)  # the tokenizer's own template, no arguments
    rep = validate_cache(out, target, sample=1)
    assert rep.ok, rep.problems


@pytest.mark.parametrize("value, n", [("1GiB", 2**30), ("512MiB", 2**29), ("2GB", 2 * 10**9), ("4096", 4096),
                                      ("1.5KiB", 1536)])
def test_shard_size_takes_units(value, n):
    from vatspec.commands.cache_features import size_arg

    assert size_arg(value) == n


def test_parts_then_a_weightless_finish(tiny_dir, data_file, cache_dir, tmp_path, capsys):
    """--part I/N in independent processes, then one run without --part on the meta device (no
    weights: nothing is left to compute) writes the index and completes the manifest."""
    from vatspec.cli import main

    out = tmp_path / "c"
    common = [str(data_file), "--out", str(out), "--target", str(tiny_dir), "--layers", "1,2,3", "--max-length", "64",
              "--feature-dtype", "float32", "--shard-size", "70000", "--batch-size", "4", "--dtype", "float32",
              "--no-progress"]
    assert main(["cache-features", *common, "--device", "meta"]) == 2  # nothing written yet: refused
    assert "not written yet" in capsys.readouterr().err
    for part in ("1/2", "0/2"):
        assert main(["cache-features", *common, "--device", "cpu", "--part", part]) == 0
        assert f"part {part} written" in capsys.readouterr().out
    assert not (out / "index.jsonl").exists()
    assert main(["cache-features", *common, "--device", "meta"]) == 0
    assert "wrote 0 shard(s) (already complete)" in capsys.readouterr().out
    assert _shas(out) == _shas(cache_dir) and FeatureCache(out).manifest["complete"]


def test_a_heldout_cache_equals_a_heldout_file(tiny_dir, target, data_file, tmp_path):
    """data.heldout names a second cache when training from one: the held-out metrics of online training."""
    train_file, held_file = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train_file.write_text("".join(json.dumps(c) + "\n" for c in CONVS[:20]))
    held_file.write_text("".join(json.dumps(c) + "\n" for c in CONVS[20:]))
    for f in (train_file, held_file):
        _write(target, f, tmp_path / f"{f.stem}-cache")
    kind = ["drafter.kind=dflash", "loss.kind=vat"]
    online = _cfg(tiny_dir, tmp_path / "on", *kind, f"data.heldout={held_file}", data=train_file)
    cached = _cfg(tiny_dir, tmp_path / "ca", *kind, f"data.heldout={tmp_path / 'held-cache'}",
                  features=tmp_path / "train-cache")
    a, b = train_arms([online], progress=False)[0], train_arms([cached], progress=False)[0]
    assert a["chains"] == b["chains"] and b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL)
    assert b["tau_sim"] == pytest.approx(a["tau_sim"], rel=LOSS_RTOL)


def test_ddp_ranks_verify_only_their_shards(tiny_dir, cache_dir, tmp_path):
    """torchrun, 2 CPU ranks: each rank checks (and reads) the shards of its half of the training set
    and of the held-out rows, not the other half's."""
    import subprocess
    import sys

    script = tmp_path / "ddp.py"
    script.write_text(
        "import os, sys, json\n"
        "from vatspec.config import load_config\n"
        "from vatspec.features import FeatureCache\n"
        "import vatspec.train as T\n"
        "seen = []\n"
        "orig = FeatureCache.verify_shard\n"
        "def spy(self, k):\n"
        "    seen.append(k)\n"
        "    return orig(self, k)\n"
        "FeatureCache.verify_shard = spy\n"
        "T.train(load_config(None, sys.argv[2:]), progress=False)\n"
        "open(sys.argv[1] + f'.{os.environ[\"RANK\"]}', 'w').write(json.dumps(sorted(set(seen))))\n"
    )
    out = tmp_path / "seen"
    args = [f"target.path={tiny_dir}", f"data.features={cache_dir}", f"train.out_dir={tmp_path / 'ddp'}",
            "data.batch_size=2", "data.max_length=64", "drafter.draft_vocab_size=256", "drafter.ttt_steps=3",
            "train.steps=1", "target.device=cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_port=29541", str(script), str(out), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [set(json.loads(Path(f"{out}.{r}").read_text())) for r in (0, 1)]
    n = len(json.loads((cache_dir / "manifest.json").read_text())["shards"])
    assert all(s and len(s) < n for s in seen), seen  # neither rank read the whole cache
    assert seen[0] != seen[1], seen


def test_a_device_map_target_writes_the_same_cache(tiny_dir, data_file, cache_dir, tmp_path):
    """--device-map: the target loaded by accelerate (here all on the CPU) captures the same layers."""
    mapped = Target.from_pretrained(tiny_dir, device_map="cpu")
    _write(mapped, data_file, tmp_path / "c")
    assert _shas(tmp_path / "c") == _shas(cache_dir)


# ----------------------------------------------------------------------------- precision
def test_a_bf16_cache_trains_as_online_bf16_training(tiny_dir, target, data_file, cache_dir, tmp_path):
    """precision=bf16 runs the target pass under bfloat16 autocast, as train.precision=bf16 runs it online:
    its features are an autocast forward's (bfloat16 products, a ~1e-2 change from the float32 pass), and
    training from it gives online bf16 training's losses and held-out metrics."""
    from vatspec.target.precision import precision_context

    c16 = tmp_path / "bf16"
    assert _write(target, data_file, c16, precision="bf16")["precision"] == "bf16"
    cache, old = FeatureCache(c16), FeatureCache(cache_dir)
    assert cache.precision == "bf16" and old.precision == "fp32"
    for row in (0, 11, 23):
        ids = torch.tensor([cache.examples([row])[0].input_ids])
        with torch.no_grad(), precision_context(target.device, "bf16"):
            fresh = target(ids, torch.ones_like(ids), LAYERS, logits=False)
        feats, hidden = cache.read(row, LAYERS)
        torch.testing.assert_close(feats, fresh.features[0].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(hidden, fresh.hidden[0].float(), rtol=1e-2, atol=1e-2)
        f32, _ = old.read(row, LAYERS)
        assert 1e-3 < float((feats - f32).norm() / f32.norm()) < 5e-2  # bfloat16 rounding, not another layer

    kinds = [("eagle3", "vat"), ("dflash", "vat")]

    def cfgs(root, **src):
        return [_cfg(tiny_dir, root / k, f"drafter.kind={k}", f"loss.kind={loss}", "train.precision=bf16", **src)
                for k, loss in kinds]

    train_arms(cfgs(tmp_path / "online", data=data_file), progress=False)
    train_arms(cfgs(tmp_path / "cached", features=c16), progress=False)
    for k, _ in kinds:
        a, b = _records(tmp_path / "online" / k), _records(tmp_path / "cached" / k)
        assert len(a) == len(b) == 3 and "eval/tau_sim" in a[-1]
        for ra, rb in zip(a, b):
            keys = [key for key in ra if key.startswith(("loss", "train/", "eval/"))]
            assert _flat(rb, keys) == pytest.approx(_flat(ra, keys), rel=BF16_LOSS_RTOL, abs=1e-6, nan_ok=True), k


def test_a_cache_without_a_recorded_precision_is_refused(target, data_file, cache_dir, tmp_path):
    """A manifest without ``precision`` (an older vatspec's) is refused for reading and for resuming a write,
    in one line; an unknown precision is refused before anything is written."""
    import shutil

    out = tmp_path / "old"
    shutil.copytree(cache_dir, out)
    man = json.loads((out / "manifest.json").read_text())
    del man["precision"]
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(FeatureCacheError, match="the manifest records no precision"):
        FeatureCache(out)
    with pytest.raises(FeatureCacheError, match="precision differs"):
        _write(target, data_file, out)
    with pytest.raises(FeatureCacheError, match="precision 'fp16' is not one of fp32, bf16"):
        _write(target, data_file, tmp_path / "new", precision="fp16")
    assert not (tmp_path / "new").exists()
