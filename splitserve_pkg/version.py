"""splitserve: disaggregated LLM serving (prefill and decode workers joined by UCX).

`splitserve` and its top-level subpackages are namespace packages (no __init__.py): the
repository folders they map from must never shadow a published package of the same name
(kernels/ vs Hugging Face kernels) when the repository root is on sys.path.
"""

__version__ = "0.1.0"
