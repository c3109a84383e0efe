"""A rank's side of its node agent: find or start it (``client``), introduce the agents of a multi-node job and pull
replicas (``replicas``), read what the agent publishes about persists (``persist_watch``) and backups (``lag_gate``),
and the standalone launcher under torchrun (``launcher``)."""
