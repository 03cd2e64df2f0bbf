"""Keeping the replicas of a stage in step: the stage-wise gradient all-reduce."""
