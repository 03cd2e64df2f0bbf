"""swarm: SWARM parallelism (stochastic wiring, stage-wise averaging) on hivemind."""

__version__ = "0.1.0"
