"""Models as lists of pipeline stages: the default GPT and the spec interface that loads any model."""

from swarm.model.gpt import GPTStage, build_stages
from swarm.model.spec import Boundary, ComposedModel, build_stage, load_stages, stage_boundary

__all__ = [
    "Boundary", "ComposedModel", "GPTStage", "build_stage", "build_stages", "load_stages", "stage_boundary",
]
