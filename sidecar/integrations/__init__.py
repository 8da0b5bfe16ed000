"""Integrations with trainers that drive the rollout hook (verl / verl-omni: ``sidecar.integrations.verl``,
docs/rl.md). Each imports its framework only when used."""
