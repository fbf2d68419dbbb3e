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
