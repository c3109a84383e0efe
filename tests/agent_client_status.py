"""Read a test job's agent status (the agent's own view: safe step, persisted step)."""
from __future__ import annotations

from typing import Any

from conftest import Env


def agent_status(env: Env) -> dict[str, Any] | None:
    from easyckpt.node.client import AgentTimeout, query_status

    try:
        return query_status(env.job_dir(), timeout=5.0)
    except (AgentTimeout, AssertionError):
        return None


def safe_step_of(env: Env) -> int | None:
    status = agent_status(env)
    return None if status is None else status.get("safe_step")
