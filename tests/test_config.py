"""--config FILE on every entry point (dalle_pytorch/config.FileParser): a YAML or JSON file under the command
line; a run's config.yaml reads back; bad files and keys end in one line naming what to fix."""

import json

import pytest

from dalle_pytorch.config import FileParser, add_flags, take
from dalle_pytorch.training.configs import TrainConfig
from distributed import DeepSpeedOptions


def parser():
    p = FileParser(prog="train")
    add_flags(p, TrainConfig, "training")
    add_flags(p, DeepSpeedOptions, "deepspeed backend")
    return p


def parse(tmp_path, text, *argv, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return parser().parse_args(["--config", str(path), *argv])


def test_the_file_sets_flags_and_the_command_line_overrides_it(tmp_path):
    ns = parse(tmp_path, "batch_size: 4\nlearning_rate: 0.01\nzero_stage: 2\nquiet: true\n", "--batch_size", "8")
    cfg = take(ns, TrainConfig)
    assert (cfg.batch_size, cfg.learning_rate, cfg.quiet) == (8, 0.01, True)
    assert ns.zero_stage == "2"  # converted to the flag's type, within its choices
    assert take(parser().parse_args([]), TrainConfig) == TrainConfig()  # no file: the defaults


def test_json_and_a_runs_sections_read_back(tmp_path):
    sections = {"training": {"steps": 7, "seed": 3}, "deepspeed": {"offload_optimizer": True}, "derived": {"x": 1}}
    ns = parse(tmp_path, json.dumps(sections), name="run.json")
    assert (ns.steps, ns.seed, ns.offload_optimizer) == (7, 3, True)


@pytest.mark.parametrize(
    "text,message",
    [
        ("learnig_rate: 0.1\n", "unknown key 'learnig_rate' (did you mean 'learning_rate'?)"),
        ("batch_size: [1, 2\n", "does not parse as YAML or JSON"),
        ("- 1\n- 2\n", "expected a mapping of flag names to values"),
        ("zero_stage: 5\n", "zero_stage must be one of auto, 0, 1, 2, 3"),
        ("batch_size: eight\n", "batch_size: 'eight' is not a int"),
        ("quiet: maybe\n", "quiet must be true or false"),
    ],
)
def test_bad_files_end_in_one_line(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as exit:
        parse(tmp_path, text)
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_runs_config_json_says_to_relaunch_from_its_config_yaml(tmp_path, capsys):
    """config.json records what the run worked out too (the model's derived sizes): not flags."""
    record = {"model": {"image_fmap_size": 8, "num_image_tokens": 64}, "training": {"steps": 7}, "derived": {}}
    with pytest.raises(SystemExit) as exit:
        parse(tmp_path, json.dumps(record), name="config.json")
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and len(err.splitlines()) == 1, err
    assert "is a run's record" in err and f"--config {tmp_path / 'config.yaml'}" in err, err


def test_a_missing_file_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml: No such file or directory" in capsys.readouterr().err


@pytest.mark.e2e
def test_every_entry_point_takes_config(tmp_path, capsys):
    import generate
    import train_clip
    import train_dalle
    import train_vae
    from dalle_pytorch import convert
    from dalle_pytorch.eval import evaluate, plot

    for main in (
        train_vae.main,
        train_dalle.main,
        train_clip.main,
        generate.main,
        convert.main,
        evaluate.main,
        plot.main,
    ):
        with pytest.raises(SystemExit):
            main(["--config", str(tmp_path / "absent.yaml")])
        assert "absent.yaml: No such file or directory" in capsys.readouterr().err


def test_a_section_named_like_a_flag_is_a_section(tmp_path):
    """A run's config.yaml has a `deepspeed:` section; the predecessor's --deepspeed flag must not take it."""
    p = parser()
    p.add_argument("--deepspeed", action="store_true")
    path = tmp_path / "run.yaml"
    path.write_text("deepspeed:\n  offload_optimizer: true\n")
    ns = p.parse_args(["--config", str(path)])
    assert ns.offload_optimizer is True and ns.deepspeed is False
