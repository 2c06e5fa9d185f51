"""The step runner is chosen once, from the config: DeepSpeed's, a pipeline's, or plain torch's."""

from __future__ import annotations

import pytest

from tessera.config import ConfigError, JobConfig
from tessera.train.steps import DeepSpeedSteps, PipelineSteps, TorchSteps, runner_class


def _config(**parallel) -> JobConfig:
    config = JobConfig()
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    return config


def test_the_runner_follows_the_engine_and_the_pipeline_degree():
    assert runner_class(_config()) is TorchSteps
    assert runner_class(_config(pp=2)) is PipelineSteps
    assert runner_class(_config(engine="deepspeed")) is DeepSpeedSteps
    assert DeepSpeedSteps.scales_fp16_itself and not DeepSpeedSteps.fuses_head
    assert TorchSteps.fuses_head and PipelineSteps.fuses_head and not TorchSteps.scales_fp16_itself


def test_deepspeed_refuses_asynchronous_checkpoints():
    config = _config(engine="deepspeed")
    config.checkpoint.async_save = True
    with pytest.raises(ConfigError, match="checkpoint.async"):
        DeepSpeedSteps.check_config(config)
    TorchSteps.check_config(config)  # torch saves in the background
