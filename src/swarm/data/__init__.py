"""Training data: a byte-level corpus cut into samples, and the order of each pass over them."""

from swarm.data.corpus import load_documents
from swarm.data.sharding import SampleTable, chunk_documents, split_inputs_targets

__all__ = ["SampleTable", "chunk_documents", "load_documents", "split_inputs_targets"]
