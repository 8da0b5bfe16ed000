"""Contract tests against the real vllm / vllm-omni packages (pytest -m contract)."""
