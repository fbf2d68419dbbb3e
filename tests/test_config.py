import pytest

from vatspec.config import Config, ConfigError, config_from_dict, dump_config, load_config


def test_defaults_yaml_then_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  steps: 50\n  seed: 3\ndrafter:\n  kind: dflash\n  block_size: 8\n")
    cfg = load_config(f, ["train.steps=7", "loss.kind=vat", "optim.lr=3e-4", "drafter.target_layer_ids=[1,2,3]"])
    assert cfg.train.steps == 7 and cfg.train.seed == 3  # override beats file, file beats default
    assert cfg.drafter.kind == "dflash" and cfg.drafter.block_size == 8
    assert cfg.loss.kind == "vat" and cfg.optim.lr == 3e-4
    assert cfg.drafter.target_layer_ids == (1, 2, 3)
    assert Config().train.steps == 0  # defaults untouched (frozen dataclasses)


def test_kind_shorthands():
    # `vatspec train drafter=dflash loss=vat`, as in SpecForge-style launchers
    cfg = load_config(None, ["drafter=dflash", "loss=vat"])
    assert cfg.drafter.kind == "dflash" and cfg.loss.kind == "vat"
    assert cfg == load_config(None, ["drafter.kind=dflash", "loss.kind=vat"])


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=9", "optim.betas=[0.8,0.9]", "drafter.target_layer_ids=[0,4]"])
    import yaml

    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown field 'train.stepz'"),
        ("nosection.x=1", "unknown field 'nosection'"),
        ("train.steps=abc", "train.steps expects an integer"),
        ("train.steps=1.5", "train.steps expects an integer"),
        ("optim.lr=fast", "optim.lr expects a number"),
        ("data.skip_bad=3", "data.skip_bad expects true/false"),
        ("optim.betas=[0.9]", "optim.betas expects 2 values"),
        ("train.steps", "expected section.field=value"),
        ("train=5", "expected section.field=value"),
        ("drafter=medusa", "drafter.kind 'medusa' is not one of eagle3, dflash"),
        ("loss=focal", "LossConfig.kind must be one of"),
        ("target.dtype=fp8", "'target.dtype=fp8': target.dtype 'fp8' is not one of float32, bfloat16, float16"),
        ("target.dtype=16", "target.dtype '16' is not one of"),
        ("target.device=gpu", "target.device 'gpu' is not a device"),
        ("drafter.target_layer_ids=[1,1,0]", "drafter.target_layer_ids: [1, 1, 0] repeats a layer"),
    ],
)
def test_bad_overrides_fail_loudly(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(None, [override])


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("train: [1, 2]\n")
    with pytest.raises(ConfigError, match=f"{f}: train must be a mapping"):
        load_config(f)
    f.write_text("train:\n  steps: 1\nextra:\n  a: 1\n")
    with pytest.raises(ConfigError, match=f"{f}: unknown field 'extra'"):
        load_config(f)


def test_dtype_aliases_are_stored_as_the_full_name(tmp_path):
    for alias, name in [("fp32", "float32"), ("float", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                        ("half", "float16"), ("float16", "float16")]:
        assert load_config(None, [f"target.dtype={alias}"]).target.dtype == name
    f = tmp_path / "run.yaml"
    f.write_text("target:\n  dtype: bf16\n  device: cpu\n")
    assert load_config(f).target == load_config(None, ["target.dtype=bfloat16", "target.device=cpu"]).target


def test_loss_is_resolved_when_the_config_loads():
    """The loss's open fields are filled for the drafter once, at load; the saved config loads back equal."""
    import yaml

    e = load_config(None, ["drafter=eagle3", "loss=vat"]).loss
    assert (e.weights, e.soft, e.hard, e.head, e.curve, e.gamma) == ("adaptive", True, True, True, "eagle3", None)
    d = load_config(None, ["drafter=dflash", "drafter.block_size=8", "loss=vat"]).loss
    assert (d.weights, d.curve, d.gamma) == ("adaptive", "dflash", 4.0)  # gamma from the block: 8 -> 4
    assert load_config(None, ["drafter=dflash", "loss=dflash"]).loss.gamma == 7.0  # block 16 -> 7
    # the order of overrides does not matter: the loss resolves after the last one
    assert load_config(None, ["loss=dflash", "drafter=dflash"]) == load_config(None, ["drafter=dflash", "loss=dflash"])
    for overrides in (["drafter=dflash", "drafter.block_size=8", "loss=vat"], ["loss=eagle3", "loss.head=true"]):
        cfg = load_config(None, overrides)
        assert cfg.loss.resolved and config_from_dict(yaml.safe_load(dump_config(cfg))) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["drafter=eagle3", "loss=dflash"], "drafter.kind=eagle3 with loss.kind=dflash: the dflash curve "
                                            "exp(-j/gamma) takes its gamma from a DFlash block"),
        (["loss=vat", "loss.curve=dflash"], "drafter.kind=eagle3 with loss.curve=dflash: .*set loss.gamma"),
        (["loss=eagle3", "loss.soft=false"], "there is nothing to train"),
    ],
)
def test_incompatible_drafter_and_loss_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_a_pair_that_resolves_is_allowed():
    # EAGLE-3 chains with DFlash's hard CE and curve: fine once gamma is given
    assert load_config(None, ["drafter=eagle3", "loss=dflash", "loss.gamma=3"]).loss.gamma == 3.0
    assert load_config(None, ["drafter=dflash", "loss=eagle3"]).loss.curve == "eagle3"


def test_a_day_is_read_as_written(tmp_path):
    """YAML would read an unquoted 2026-01-05 as a date (refused as 'not a string') and fail on 2026-13-01 with
    an error that names no field: a day stays text, and the field's check names what is wrong."""
    assert load_config(None, ["data.chat_template_date=2026-01-05"]).data.chat_template_date == "2026-01-05"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  chat_template_date: 2026-12-07\n")
    assert load_config(str(cfg), []).data.chat_template_date == "2026-12-07"
    with pytest.raises(ConfigError, match=r"data.chat_template_date: must be a day as YYYY-MM-DD .*'2026-13-01'"):
        load_config(None, ["data.chat_template_date=2026-13-01"])


def test_settings_that_said_one_thing_and_did_another_are_refused():
    # heldout_fraction=0 still held one conversation out; with data.heldout given, the fraction is not used
    with pytest.raises(ConfigError, match=r"data.heldout_fraction=0 holds nothing out.*give data.heldout"):
        load_config(None, ["data.heldout_fraction=0"])
    assert load_config(None, ["data.heldout_fraction=0", "data.heldout=held.jsonl"]).data.heldout == "held.jsonl"
    # `none` beside a tracker was called an unknown tracker, while the message offered `none`
    with pytest.raises(ConfigError, match=r"train.report_to: none means no tracker, and cannot be given with "
                                          r"tensorboard"):
        load_config(None, ["train.report_to=none,tensorboard"])
    assert load_config(None, ["train.report_to=none"]).train.report_to == ()
