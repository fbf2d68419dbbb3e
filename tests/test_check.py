"""``vatspec check``: each way of serving a draft wrong is caught with a line naming it; acceptance is
measured per position and compared with training's record."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.test_export import make_drafter, tamper
from vatspec.cli import main
from vatspec.eval.check import (
    COLLAPSE_RATIO,
    acceptance_finding,
    check_draft,
    convention_findings,
    measure,
)
from vatspec.eval.decode import GenerationResult, Round
from vatspec.export import export_draft

pytestmark = pytest.mark.usefixtures("one_thread")

TRAINING = {"checkpoint": "RUN/checkpoints/step-000010", "step": 10, "k": 3,
            "heldout": {"step": 10, "tau_sim": 1.6, "cond_acc": [0.5, 0.4, 0.3], "chains": 100}}


@pytest.fixture(scope="module")
def exports(smol_tokenizer_target, tmp_path_factory):
    t = smol_tokenizer_target
    root = tmp_path_factory.mktemp("served")
    e3, df = make_drafter("eagle3", t), make_drafter("dflash", t)
    return {
        "hf": export_draft(e3, t, root / "hf", training=TRAINING),
        "spec": export_draft(e3, t, root / "spec", fmt="speculators", training=TRAINING),
        "df": export_draft(df, t, root / "df", training=TRAINING),
    }


def failures(folder, target) -> dict[str, str]:
    _, found = convention_findings(folder, target)
    return {f.what: f.detail for f in found if not f.ok}


def test_good_exports_pass_every_convention(exports, smol_tokenizer_target):
    for name, folder in exports.items():
        fmt, found = convention_findings(folder, smol_tokenizer_target)
        assert not failures(folder, smol_tokenizer_target), name
        checked = {f.what for f in found}
        assert {"format", "layer ids", "layer order", "layer ids vs training", "sizes", "rope", "tokenizer",
                "chat template"} <= checked
        assert ("mask token" in checked) == (fmt == "dflash")
        assert ("embedding" in checked) == (fmt == "speculators")
        report = check_draft(folder, smol_tokenizer_target)  # no prompts: conventions and loading only
        assert report.ok and report.measured is None and report.training == TRAINING


def test_each_broken_folder_is_caught_with_a_line_naming_it(exports, smol_tokenizer_target, tmp_path):
    t = smol_tokenizer_target

    def shift(c):  # every id one layer later, both engines' fields consistently
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in
                                                                 c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        c["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in c["eagle_aux_hidden_state_layer_ids"]]

    cases = {
        "shifted": (exports["hf"], dict(config=shift), "layer ids vs training", "trained on \\[1, 3, 4\\]"),
        "no_embedding": (exports["spec"], dict(weights=lambda w: w.pop("embed_tokens.weight")), "embedding",
                         "embed_tokens.weight is missing"),
        "rope": (exports["hf"], dict(config=lambda c: c.update(rope_theta=5e5)), "rope",
                 "rope_theta 500000.*the target's: rope_theta 10000"),
        "foreign_embedding": (exports["spec"], dict(weights=lambda w: w["embed_tokens.weight"].mul_(2)), "embedding",
                              "not the target's input embedding"),
        "unsorted": (exports["hf"], dict(config=lambda c: (
            c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[4, 1, 3]),
            c.update(eagle_aux_hidden_state_layer_ids=[5, 2, 4]))), "layer order", "not distinct and increasing"),
        "engines_disagree": (exports["hf"], dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4])),
                             "layer ids", "SGLang and vLLM would read different layers"),
        "mask_is_eos": (exports["df"], dict(config=lambda c: c["dflash_config"].update(mask_token_id=2)),
                        "mask token", "end-of-turn token"),
        "mask_string": (exports["df"], dict(config=lambda c: c["dflash_config"].update(mask_token="<|MASK|>")),
                        "mask token", "mask_token '<\\|MASK\\|>' but id"),
        "vocab_maps": (exports["hf"], dict(weights=lambda w: w["t2d"].fill_(False)), "vocab maps", "t2d"),
        "sizes": (exports["df"], dict(config=lambda c: c.update(num_target_layers=12)), "sizes",
                  "num_target_layers=12 \\(target 8\\)"),
        "nan": (exports["hf"], dict(weights=lambda w: w["fc.weight"].view(-1)[:3].fill_(float("nan"))),
                "weight values", "fc.weight has 3 NaN/inf of"),
        "zeroed": (exports["df"], dict(weights=lambda w: w["fc.weight"].zero_()), "weight values",
                   "fc.weight is constant \\(0 everywhere\\)"),
        "dtype_declared": (exports["spec"], dict(config=lambda c: c.update(torch_dtype="bfloat16")), "weight dtype",
                           "the tensors are float32, config.json declares bfloat16"),
        "dtype_mixed": (exports["df"], dict(weights=lambda w: w.update({"fc.weight": w["fc.weight"].bfloat16()})),
                        "weight dtype", "mixed: 1 tensors bfloat16 \\(e.g. fc.weight\\); .* float32"),
    }
    for name, (src, kw, what, msg) in cases.items():
        bad = failures(tamper(src, tmp_path / name, **kw), t)
        assert what in bad, (name, bad)
        assert re.search(msg, bad[what]), (name, bad[what])
    # a stale second weight file with the same tensors (which one an engine keeps depends on its loading order)
    stale = tamper(exports["hf"], tmp_path / "stale", config=lambda c: None)
    shutil.copy(stale / "model.safetensors", stale / "model-old.safetensors")
    assert re.search("d2t is in both model-old.safetensors and model.safetensors: .* remove the stale file",
                     failures(stale, t)["weights"])
    # a FIFO named like weights: named, never opened (reading it would block forever)
    fifo = tamper(exports["hf"], tmp_path / "fifo", config=lambda c: None)
    os.mkfifo(fifo / "extra.safetensors")
    assert re.search("extra.safetensors in .* is not a regular file", failures(fifo, t)["weights"])
    # a broken record: said, not skipped in silence
    broken = tamper(exports["hf"], tmp_path / "broken_record", config=lambda c: None)
    (broken / "vatspec.json").write_text('{"format": "vatspec-record", ')
    assert "checks against training are skipped" in failures(broken, t)["record"]
    rec = json.loads((exports["hf"] / "vatspec.json").read_text())
    rec["target"]["chat_template_kwargs"] = "enable_thinking=false"  # hand-edited: a string, not an object
    (broken / "vatspec.json").write_text(json.dumps(rec))
    assert "checks against training are skipped" in failures(broken, t)["record"]
    # the tokenizer it was trained with, recorded
    rec = json.loads((exports["hf"] / "vatspec.json").read_text())
    rec["target"]["tokenizer_sha256"] = "0" * 64
    other = tamper(exports["hf"], tmp_path / "tok", config=lambda c: None)
    (other / "vatspec.json").write_text(json.dumps(rec))
    assert "tokenizer" in failures(other, t) and "chat template" not in failures(other, t)


def test_measure_counts_acceptance_per_position(monkeypatch, smol_tokenizer_target):
    # three rounds of 3 drafts: accepted 0, 2 and 3 -> position 1 reached 3x accepted 2x, position 2
    # reached 2x accepted 2x, position 3 reached 2x accepted 1x
    rounds = [Round(3, 0, 1, 0.0, 0.0), Round(3, 2, 3, 0.0, 0.0), Round(3, 3, 4, 0.0, 0.0)]
    monkeypatch.setattr("vatspec.eval.check.generate",
                        lambda *a, **kw: GenerationResult(tokens=[0] * 8, prompt_len=1, rounds=rounds))
    d = make_drafter("eagle3", smol_tokenizer_target)
    m = measure(smol_tokenizer_target, d, [[1, 2]], k=3)
    assert m["cond_accept"] == [2 / 3, 1.0, 0.5] and m["tau"] == pytest.approx(8 / 3) and m["rounds"] == 3


def test_acceptance_far_below_training_fails():
    measured = {"tau": 1.25}
    assert acceptance_finding(measured, None) is None  # nothing recorded: nothing to compare
    assert acceptance_finding(measured, {"heldout": None}) is None
    ok = acceptance_finding({"tau": 1.0 + 0.6 * COLLAPSE_RATIO}, TRAINING)  # 0.3 of 0.6 accepted: exactly half
    assert ok.ok and "50%" in ok.detail
    bad = acceptance_finding(measured, TRAINING)  # 0.25 of 0.6
    assert not bad.ok and "42%" in bad.detail and "served differently" in bad.detail
    weak = acceptance_finding({"tau": 1.0}, {"heldout": {"tau_sim": 1.03, "step": 5}})
    assert weak.ok and "too few to compare" in weak.detail


def test_cli_verdict_and_exit_status(exports, smol_tokenizer_target, tmp_path, capsys):
    t = smol_tokenizer_target
    assert main(["check", str(exports["spec"]), "--target", t.path, "--no-measure",
                 "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "verdict: OK" in out and "FAIL" not in out
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
    bad = tamper(exports["spec"], tmp_path / "bad", weights=lambda w: w.pop("embed_tokens.weight"))
    assert main(["check", str(bad), "--target", t.path, "--no-measure"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  embedding" in out and "verdict: FAIL (embedding)" in out
    assert main(["check", str(tmp_path), "--target", t.path]) == 2  # no config.json
    assert "no config.json" in capsys.readouterr().err
    # --json: never into the checked folder, never over a file that is not an earlier report
    assert main(["check", str(exports["spec"]), "--target", t.path, "--no-measure",
                 "--json", str(exports["spec"] / "r.json")]) == 2
    assert "is inside the input FOLDER" in capsys.readouterr().err and not (exports["spec"] / "r.json").exists()
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    assert main(["check", str(exports["spec"]), "--target", t.path, "--no-measure",
                 "--json", str(tmp_path / "notes.json")]) == 2
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}'
    assert main(["check", str(exports["spec"]), "--target", t.path, "--no-measure",
                 "--json", str(tmp_path / "r.json")]) == 0  # an earlier report is replaced


@pytest.mark.slow
def test_cli_measures_acceptance_on_prompts(exports, smol_tokenizer_target, tmp_path, capsys):
    t = smol_tokenizer_target
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"Count to {i}."}]}) + "\n"
                               for i in range(2)))
    code = main(["check", str(exports["df"]), "--target", t.path, "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--json", str(tmp_path / "r.json")])
    rep = json.loads((tmp_path / "r.json").read_text())
    m = rep["measured"]
    assert m["prompts"] == 2 and m["rounds"] >= 2 and 1.0 <= m["tau"] <= 1 + m["k"]
    # a random draft accepts far less than the recorded training: the verdict says so
    assert code == 1 and "acceptance" in [f["what"] for f in rep["findings"] if not f["ok"]]
    assert "served differently" in capsys.readouterr().out


def test_weights_of_a_third_party_folder_without_record(exports, smol_tokenizer_target, tmp_path):
    """No vatspec.json: conventions still checked, no training comparison."""
    bare = tamper(exports["hf"], tmp_path / "bare")
    (bare / "vatspec.json").unlink()
    w = load_file(bare / "model.safetensors")
    w["embed_tokens.weight"] = smol_tokenizer_target.embed_tokens.weight.detach().clone()  # as SGLang drafts ship
    save_file(w, bare / "model.safetensors")
    report = check_draft(bare, smol_tokenizer_target)
    whats = {f.what for f in report.findings}
    assert report.ok and report.training is None and "layer ids vs training" not in whats and "embedding" in whats


def test_a_served_learned_mask_row_is_named(smol_tokenizer_target, tmp_path):
    from vatspec.drafters.dflash import DFlashConfig, DFlashDrafter
    from vatspec.target import Target

    t = smol_tokenizer_target
    bare = Target(t.model, tokenizer=None)  # no tokenizer: no unused id known -> a learned MASK row
    d = DFlashDrafter(DFlashConfig.from_target(bare, block_size=4))
    d.attach_target(bare)
    out = export_draft(d, t, tmp_path / "df", mask_token_id=7)
    report = check_draft(out, t)
    mask = next(f for f in report.findings if f.what == "mask token")
    assert report.ok and "a learned row in mask_embedding.pt" in mask.detail
