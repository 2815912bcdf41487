"""Task registry and ``build_task``: every conf/task yaml builds fast, bad input fails with the value named."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.errors import ConfigError
from kvbench.tasks import TASKS, build_task
from kvbench.tasks.base import Task

CONF_TASK = Path(__file__).resolve().parents[1] / "conf" / "task"
LMEVAL = {"gsm8k", "coqa", "truthfulqa"}  # need the lmeval extra (in dev); tests/test_task_lmeval.py covers them
IMPLEMENTED = {"needle", "needle_retrieval_head", "needle_kvpress", "needle_multiturn", "passkey", "2stageretr",
               "longbench", "longbench_e", "longbench_zh", "longbench_v2", "leval", "zeroscrolls", "infinitebench",
               "ruler", "pg19", "math500", "aime24", "aime25",
               *LMEVAL}
BUILDABLE = IMPLEMENTED if importlib.util.find_spec("lm_eval") is not None else IMPLEMENTED - LMEVAL


def _yaml(name: str):
    return OmegaConf.load(CONF_TASK / f"{name}.yaml")


def test_registry_names():
    assert set(TASKS.names()) == IMPLEMENTED
    assert not TASKS.pending  # every benchmark of issue #5 has landed


@pytest.mark.parametrize("name", sorted(BUILDABLE))
def test_yaml_builds_and_matches_dataclass_defaults(name, monkeypatch):
    cfg = _yaml(name)

    def forbidden(*args, **kwargs):
        raise AssertionError("building a task must not load a model or generate samples")

    monkeypatch.setattr(TASKS.get_class(name), "samples", forbidden)
    monkeypatch.setattr("kvbench.models.load_model", forbidden)
    task = build_task(cfg)
    assert isinstance(task, Task) and task.name == name
    default = TASKS.get_class(name)()
    assert task == default, "conf/task yaml must list every protocol field with its dataclass default"
    listed = set(OmegaConf.to_container(cfg)) - {"name"}
    assert listed == {f.name for f in dataclasses.fields(default)}


def test_every_yaml_in_conf_task_is_known():
    """Each file is a task (file name = task name) or a variant of one composed through Hydra's defaults list."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers

    names = {path.stem for path in CONF_TASK.glob("*.yaml")}
    assert IMPLEMENTED <= names
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for stem in names - IMPLEMENTED:
            task_cfg = compose(config_name="config", overrides=[f"task={stem}"]).task
            assert task_cfg.name in IMPLEMENTED, stem
            build_task(task_cfg)


def test_longbench_yaml_has_the_16_english_datasets():
    cfg = _yaml("longbench")
    assert len(cfg.datasets) == 16 and len(set(cfg.datasets)) == 16
    assert not {"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"} & set(cfg.datasets)
    assert build_task(cfg).name == "longbench"


def test_unknown_name_lists_valid_tasks():
    with pytest.raises(ConfigError, match=r"unknown task 'needel'.*needle"):
        build_task({"name": "needel"})


def test_missing_name():
    with pytest.raises(ConfigError, match="name"):
        build_task({"context_lengths": [1000]})
    with pytest.raises(ConfigError, match="mapping"):
        build_task(["needle"])


def test_unknown_field_is_named():
    with pytest.raises(ConfigError, match="context_length"):
        build_task({"name": "needle", "context_length": 1000})


def test_overrides_from_dictconfig():
    cfg = _yaml("needle")
    cfg.context_lengths = [1200]
    cfg.depths = [10, 90]
    task = build_task(cfg)
    assert task.context_lengths == [1200] and task.depth_list() == [10.0, 90.0]
    assert isinstance(task.context_lengths, list)  # plain containers, not ListConfig
    assert build_task(dict(cfg)).context_lengths == [1200]  # a dict of a DictConfig still holds ListConfigs


@pytest.mark.parametrize(
    ("name", "field", "value", "shown"),
    [
        ("needle", "context_lengths", 1000, "1000"),
        ("needle", "context_lengths", [1000, -5], "-5"),
        ("needle", "context_lengths", [150], "150"),  # not more than buffer_tokens
        ("needle", "depths", [0, 101], "101"),
        ("needle", "n_depths", 0, "0"),
        ("needle", "max_new_tokens", 0, "0"),
        ("needle", "chat_template", "yes", "'yes'"),
        ("needle", "file_order", "random", "'random'"),
        ("needle", "stop_strings", [""], "['']"),
        ("passkey", "repeats", 0, "0"),
        ("passkey", "seed", -1, "-1"),
        ("passkey", "context_lengths", [True], "True"),
        ("passkey", "truncate_to", 0, "0"),
        ("2stageretr", "num_samples", 0, "0"),
        ("2stageretr", "dict_lengths", [], "[]"),
        ("2stageretr", "template", "mistral", "'mistral'"),
        ("2stageretr", "cot", 1, "1"),
    ],
)
def test_bad_values_raise_config_error_naming_the_value(name, field, value, shown):
    with pytest.raises(ConfigError) as err:
        build_task({"name": name, field: value})
    message = str(err.value)
    assert name in message and field in message and shown in message


def test_2stageretr_mode_combinations():
    with pytest.raises(ConfigError, match="chat_template"):
        build_task({"name": "2stageretr", "cot": True, "chat_template": False})
    with pytest.raises(ConfigError, match="chat_template=false"):
        build_task({"name": "2stageretr", "template": "yi", "chat_template": True})
    assert build_task({"name": "2stageretr", "cot": False, "chat_template": False}).cot is False
    assert build_task({"name": "2stageretr", "template": "yi", "chat_template": False, "max_new_tokens": 50})


def test_protocol_holds_every_field():
    for name in BUILDABLE:
        task = build_task({"name": name})
        protocol = task.protocol()
        assert protocol["task"] == name and protocol["version"] == task.version
        # data_dir / data_file say where the files are, not what they are: they stay out of the result key
        # a field a task keys only once set (MathTask.enable_thinking) is in the protocol exactly when it is set
        unset = {n for n in getattr(task, "keyed_when_set", ()) if getattr(task, n) is None}
        assert {f.name for f in dataclasses.fields(task)} - {"data_dir", "data_file"} - unset <= set(protocol)
        assert not unset & set(protocol)
        assert not {"data_dir", "data_file"} & set(protocol)
    assert build_task({"name": "needle"}).protocol()["depths"] == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
