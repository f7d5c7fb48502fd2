"""The data plane: the ext_proc sidecar. Never imports `llmgw` or `enginesim`."""

# google-re2 must load before regopy: with regopy's shared library loaded first, redaction of the
# same prompt measured 2x slower (librego_shared carries its own copies of the C++ runtime pieces
# both use). Loading order is the only coupling between the two.
import re2  # noqa: F401
