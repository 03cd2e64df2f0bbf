"""Stage state kept outside the stage: holders of copies, and the `swarm backup` role."""
