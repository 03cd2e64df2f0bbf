"""Training data: a byte-level corpus and the disjoint per-trainer sample shards cut from it."""

from swarm.data.corpus import load_documents
from swarm.data.sharding import SampleShard, chunk_documents, split_inputs_targets

__all__ = ["SampleShard", "chunk_documents", "load_documents", "split_inputs_targets"]
