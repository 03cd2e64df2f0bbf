"""Schemas of what crosses the network (DHT records, tensors) and strict checks on what arrives."""
