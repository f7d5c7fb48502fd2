"""The data plane: the ext_proc sidecar. Never imports `llmgw` or `enginesim`."""
