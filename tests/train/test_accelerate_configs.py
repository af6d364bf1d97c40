"""conf/accelerate: every trainer= config has the accelerate launch config of the same name, accelerate's own
loader reads it, and its DeepSpeed JSON is the ZeRO stage the trainer config expects (with no optimizer or scheduler
of its own: the trainer builds them)."""
from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from core.io import PROJECT_ROOT
from train.run import validate

CONF = PROJECT_ROOT / "conf"
TRAINERS = sorted(p.stem for p in (CONF / "trainer").glob("*.yaml"))
OmegaConf.register_new_resolver("specdraft_root", lambda: str(PROJECT_ROOT), replace=True)


def test_each_trainer_config_has_its_accelerate_config():
    assert TRAINERS == sorted(p.stem for p in (CONF / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("name", TRAINERS)
def test_accelerate_config_matches_the_trainer_config(name):
    from accelerate.commands.config.config_args import load_config_from_file

    acc = load_config_from_file(str(CONF / "accelerate" / f"{name}.yaml"))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        rc = validate(compose("config", overrides=[f"trainer={name}"]))
    assert rc.trainer.strategy == name
    if name.startswith("deepspeed"):
        assert acc.distributed_type == "DEEPSPEED"
        ds = json.loads((PROJECT_ROOT / acc.deepspeed_config["deepspeed_config_file"]).read_text())
        assert ds["zero_optimization"]["stage"] == int(name[-1])
        assert "optimizer" not in ds and "scheduler" not in ds
        assert ds["zero_force_ds_cpu_optimizer"] is False  # the trainer's torch AdamW, also on CPU
        assert rc.trainer.global_batch_size > 0
    else:
        assert acc.distributed_type == {"single": "NO", "ddp": "MULTI_GPU"}[name]
        assert (acc.num_processes == 1) == (name == "single")
