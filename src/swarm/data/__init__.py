"""Training data: text from files or saved datasets, as bytes or a tokenizer's ids, cut into samples
(tokenized ones cached), a held-out validation split, and the order of each pass over the rest."""

from swarm.data.corpus import load_documents
from swarm.data.samples import load_samples
from swarm.data.sharding import SampleTable, chunk_documents, split_inputs_targets
from swarm.data.tokens import BYTE_PAD_ID, BYTES, Tokens, load_tokens

__all__ = [
    "BYTES", "BYTE_PAD_ID", "SampleTable", "Tokens", "chunk_documents", "load_documents", "load_samples", "load_tokens",
    "split_inputs_targets",
]
