"""Agents: Skills (operating instructions as versioned Markdown) and, next, the orchestrator of sub-agents."""
