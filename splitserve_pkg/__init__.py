"""splitserve: disaggregated LLM serving (prefill and decode workers joined by UCX)."""

__version__ = "0.1.0"
