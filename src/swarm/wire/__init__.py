"""Schemas of what crosses the network (DHT records, tensors) and strict checks on what arrives."""

# The version of the messages and records peers exchange: bumped on every incompatible change, and part
# of the configuration hash, so that peers of different versions refuse each other with a clear message
# instead of misreading each other.
PROTOCOL_VERSION = 6
